"""Scheduling for shared traffic on the real broker (docs/SCHEDULING.md): deadlines, priority lanes, tenants
and the cost each answer reports, through one exactly_once worker.

The pipeline-level and scheduler-level tests (tests/unit/core/test_pipeline.py, tests/unit/core/test_batching.py) pin each rule
down without a broker; this one checks they hold together with Kafka transactions: every request answered
exactly once and committed in order, expired ones without passes, the cost shares adding up.
"""

from __future__ import annotations

import pytest
from d3stream_client.contract import decode_answer

from tests.support.stream_helpers import Q_CHOICE, Q_NOUL, committed, record, run, serve

pytestmark = pytest.mark.timeout(300)


def test_deadlines_lanes_and_cost_over_the_broker(stack, qwen35_model):
    stack.broker.create_topic(stack.requests + "-1p", 1)
    stack.requests += "-1p"  # one partition: the committed offset says every earlier record is answered
    lanes = ("low", "normal", "high")
    requests = [
        {"id": f"r{n}", "state": {"text": "word " * (2 + n)}, "questions": {"a": Q_NOUL, "b": Q_CHOICE},
         "priority": lanes[n % 3], "tenant": f"team-{n % 2}"}
        for n in range(12)
    ]
    expired = [{"id": f"late{n}", "state": "s", "questions": {"a": Q_NOUL}, "deadline": 1_000 + n} for n in range(5)]
    expired.append({"id": "late-ttl", "state": "s", "questions": {"a": Q_NOUL}, "ttl_ms": 0, "priority": "high"})
    stream = [*requests[:3], *expired, *requests[3:]]  # expired requests in the middle of the partition
    settings = stack.settings(prefix_reuse="off", max_batch_rows=4, linger_ms=50)
    ids = [r["id"] for r in stream]

    service, reader = run(serve(stack, settings, qwen35_model, [record(r) for r in stream], ids))

    answers = [decode_answer(r.value) for r in reader.records]
    assert sorted(a.id for a in answers) == sorted(ids), "every request answered exactly once"
    by_id = {a.id: a for a in answers}
    for request in expired[:-1]:
        assert by_id[request["id"]].error.code == "deadline_exceeded" and by_id[request["id"]].error.late_ms > 0
    # ttl_ms 0 counts from the record's timestamp: already past when the worker reads it.
    assert by_id["late-ttl"].error.code == "deadline_exceeded"
    assert all(by_id[r["id"]].error is None for r in requests)
    rows = service.default.passes.rows
    assert rows.rows_run == 2 * len(requests), "the expired requests' rows never reached a pass"
    assert sum(a.provenance.cost.device_seconds for a in answers if a.provenance.cost) == pytest.approx(
        rows.device_seconds, rel=1e-9)
    assert {a.provenance.cost.tenant for a in answers if a.error is None} == {"team-0", "team-1"}
    assert run(committed(stack.broker.bootstrap_servers, stack.group, stack.requests, 1)) == {0: len(stream)}
