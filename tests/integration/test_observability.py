"""Headers and traces: what an operator's tracing stack sees of d3stream.

Against the session's real broker and object store, with the tiny real model: request headers travel to
the answer records (both delivery modes, and a replay), and each request becomes one OpenTelemetry span with a
child per stage (recorded with the SDK's own in-memory exporter).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from d3stream_client.contract import HEADERS

from d3stream.jobs.replay import ReplayRange, run_replay
from d3stream.ops.tracing import Tracing
from tests.support.media_makers import make_png
from tests.support.stream_helpers import Q_CHOICE, Q_NOUL, read_all, record, run, serve

pytestmark = pytest.mark.timeout(240)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01".encode()
STAGES = {"fetch", "decode", "prepare", "queue", "forward", "publish"}


# ------------------------------------------------------------------------------ headers and spans


async def publish_with_headers(bootstrap: str, topic: str, items: list[tuple[dict, list[tuple[str, bytes]]]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for request, headers in items:
            key, value = record(request)
            await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()


def answer_records(records: list[Any]) -> dict[str, Any]:
    return {json.loads(item.value)["id"]: item for item in records}


@pytest.mark.parametrize("delivery", ["exactly_once", "at_least_once"])
def test_request_headers_travel_to_the_answer_and_each_request_is_a_span_with_its_stages(
    stack, qwen35_model, delivery
):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    picture = stack.put("traced/p.png", make_png(32, 32, seed=5))
    traced = {"id": "tr-traced", "state": "a traced request",
              "questions": {"noul": Q_NOUL, "route": Q_CHOICE}, "images": [picture]}
    plain = {"id": "tr-plain", "state": "no headers", "questions": {"noul": Q_NOUL}}
    invalid = {"id": "tr-invalid", "state": "no questions", "questions": {}}
    bulky = {"id": "tr-bulky", "state": "a header too large", "questions": {"noul": Q_NOUL}}
    other_parent = f"00-{TRACE_ID}-{'1' * 16}-01".encode()
    items = [
        (traced, [("traceparent", TRACEPARENT), ("tracestate", b"vendor=abc"), ("x-tenant", b"acme"),
                  ("x-secret", b"s3cr3t"), ("x-tenant", b"someone-else")]),
        (plain, []),
        (invalid, [("traceparent", other_parent)]),
        (bulky, [("x-tenant", b"t" * 300), ("traceparent", TRACEPARENT)]),
    ]
    ids = {request["id"] for request, _ in items}
    settings = stack.settings(delivery=delivery, forward_headers=["x-tenant"], forward_headers_max_bytes=256)
    exporter = InMemorySpanExporter()

    async def publish(service, reader, task):
        await publish_with_headers(stack.broker.bootstrap_servers, stack.requests, items)

    _, reader = run(serve(stack, settings, qwen35_model, [], ids, during=publish,
                          tracing=Tracing(exporter=exporter, group_id=stack.group)))

    # Headers: the answer's own two, then what was forwarded (bounded: the bulky tenant header is left out).
    answers = answer_records(reader.records)
    assert set(answers) == ids
    assert list(answers["tr-traced"].headers) == [
        *HEADERS, ("traceparent", TRACEPARENT), ("tracestate", b"vendor=abc"), ("x-tenant", b"acme"),
    ]
    assert list(answers["tr-plain"].headers) == HEADERS
    assert list(answers["tr-invalid"].headers) == [*HEADERS, ("traceparent", other_parent)]
    assert list(answers["tr-bulky"].headers) == [*HEADERS, ("traceparent", TRACEPARENT)]

    # Spans: one per request, a child of the incoming traceparent, with a child span per stage it went through.
    spans = exporter.get_finished_spans()
    requests = {span.attributes["d3stream.request.id"]: span for span in spans if span.kind == SpanKind.CONSUMER}
    assert set(requests) == ids

    def stages(span):
        return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id}

    span = requests["tr-traced"]
    answer = json.loads(answers["tr-traced"].value)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes["messaging.kafka.offset"] == answer["source"]["offset"]
    assert span.attributes["d3stream.answer_id"] == answer["answer_id"]
    children = stages(span)
    assert set(children) == STAGES
    for child in children.values():
        assert span.start_time <= child.start_time <= child.end_time <= span.end_time, child.name
    batch = answer["provenance"]["batch"]
    assert children["forward"].attributes["d3stream.batch.rows"] == batch["rows"] > 0
    assert children["forward"].attributes["d3stream.batch.passes"] == batch["passes"] > 0
    assert children["forward"].attributes["d3stream.batch.padded_tokens"] == batch["padded_tokens"]
    assert children["fetch"].attributes["d3stream.media.count"] == 1

    assert requests["tr-plain"].parent is None  # no traceparent: a trace of its own
    assert set(stages(requests["tr-plain"])) == STAGES - {"fetch", "decode"}
    refused = requests["tr-invalid"]
    assert format(refused.context.trace_id, "032x") == TRACE_ID
    assert refused.attributes["error.type"] == "invalid_request"
    assert refused.status.status_code == StatusCode.ERROR
    assert "publish" in stages(refused) and not {"queue", "forward"} & set(stages(refused))  # no pass carried it

    if delivery == "exactly_once":  # a replay of the same records forwards their headers too
        replayed = stack.unique("replayed")
        replay_settings = stack.settings(answer_topic=replayed, forward_headers=["x-tenant"],
                                         forward_headers_max_bytes=256)
        summary = run(run_replay(replay_settings, qwen35_model, ReplayRange(topic=stack.requests),
                                 replay_id="headers"))
        assert summary["replayed"] == len(ids)
        again = answer_records(run(read_all(stack.broker.bootstrap_servers, replayed, 4)))
        assert list(again["tr-traced"].headers) == list(answers["tr-traced"].headers)
        assert list(again["tr-plain"].headers) == HEADERS
