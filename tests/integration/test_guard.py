"""One record must never take a worker down (issue 42): what escapes every stage anyway, on the real broker.

A record whose handling raises what no stage expected is answered ``internal_error`` naming the exception,
dead-lettered and counted (``d3stream_records_failed_total``), and its partition goes on: the records before
and after it are answered as usual and the committed offset moves past all of them. A background task of the
worker that dies anyway is logged with its traceback and makes ``/readyz`` answer 503 naming it.

The faults are made by replacing one function of the worker for one request (its key or id): nothing in the
stream itself is unusual, so everything else must go on exactly as it would.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from d3stream_client.contract import Request

from d3stream.core import pipeline
from d3stream.core.pipeline import RequestPipeline
from d3stream.kafka.registry import Registry
from d3stream.ops.logs import configure_logging
from d3stream.ops.metrics import MetricsServer
from tests.support.stream_helpers import Q_NOUL, committed, read_all, record, run, serve

pytestmark = pytest.mark.timeout(240)

POISON = "guard-poison"


def _requests() -> list[dict[str, Any]]:
    """Two requests, the poisoned one, two more: one partition, so "before" and "after" are offsets."""
    around = [{"id": f"guard-{n}", "state": f"an ordinary request {n}", "questions": {"noul": Q_NOUL}}
              for n in range(4)]
    return [*around[:2], {"id": POISON, "state": "an ordinary request too", "questions": {"noul": Q_NOUL}},
            *around[2:]]


def _one_partition(stack: Any) -> None:
    stack.broker.create_topic(stack.requests + "-1p", 1)
    stack.requests += "-1p"


def _readyz(server: MetricsServer) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(server.url + "/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _poison_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poisoned request's scheduling raises (a stage's bug, met by this one request only)."""
    real = pipeline.request_scheduling

    def scheduling(batching: Any, read: Any, request: Request) -> Any:
        if request.id == POISON:
            raise RecursionError("maximum recursion depth exceeded (simulated)")
        return real(batching, read, request)

    monkeypatch.setattr(pipeline, "request_scheduling", scheduling)


def _poison_unframe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the poisoned record through the Schema Registry raises, as a record nested too deep for the
    decoder did (the whole fetch was lost with it, and its partition stood still)."""
    real = Registry.unframe_known

    def unframe_known(self: Registry, records: Any, event: Any = Request) -> Any:
        if any(each.key == POISON.encode() for each in records):
            raise RecursionError("maximum recursion depth exceeded while decoding (simulated)")
        return real(self, records, event)

    monkeypatch.setattr(Registry, "unframe_known", unframe_known)


@pytest.mark.parametrize("where", ["admission", "unframe"])
def test_a_record_whose_handling_raises_is_skipped_and_its_partition_goes_on(stack, qwen35_model, monkeypatch,
                                                                               where):
    _one_partition(stack)
    options: dict[str, Any] = {}
    if where == "admission":
        _poison_admission(monkeypatch)
    else:
        _poison_unframe(monkeypatch)
        # Plain JSON records pass the registry's reading untouched: no registry needs to answer.
        options["schema_registry_url"] = "http://127.0.0.1:9"
    requests = _requests()
    records = [record(r) for r in requests]
    ids = [r["id"] for r in requests]
    readiness: list[tuple[bool, str | None]] = []

    async def during(service: Any, reader: Any, task: Any) -> None:
        await reader.wait_ids(ids, 60, task)
        readiness.append((service.metrics.is_ready(), service.metrics.why_not_ready()))

    service, reader = run(serve(stack, stack.settings(**options), qwen35_model, records, ids, during=during))

    assert reader.counts() == {rid: 1 for rid in ids}  # every record answered once, the poisoned one too
    by_id = reader.by_id()
    poisoned = by_id[POISON]
    assert poisoned["error"]["code"] == "internal_error", poisoned
    message = poisoned["error"]["message"]
    assert "RecursionError" in message and "maximum recursion depth exceeded" in message, message
    assert "skipped" in message and "dead-lettered" in message, message
    assert poisoned["source"]["offset"] == 2
    for rid in ids:
        if rid != POISON:  # before and after it, answered as if nothing had happened
            assert "error" not in by_id[rid], by_id[rid]
            assert by_id[rid]["answers"]["noul"]["type"] == "noul"

    bootstrap = stack.broker.bootstrap_servers
    letters = [json.loads(item.value) for item in run(read_all(bootstrap, stack.dead_letters, 4))]
    assert len(letters) == 1, letters
    (letter,) = letters
    assert letter["source"]["offset"] == 2 and letter["key"] == POISON
    assert "RecursionError" in letter["reason"]
    assert base64.b64decode(letter["value_base64"]) == records[2][1]  # the record's own bytes, to look at again

    assert run(committed(bootstrap, stack.group, stack.requests, 1)) == {0: len(records)}  # past all of them
    samples = service.metrics.registry
    assert samples.get_sample_value("d3stream_records_failed_total", {"exception": "RecursionError"}) == 1
    assert samples.get_sample_value("d3stream_answers_total", {"code": "internal_error"}) == 1
    assert readiness == [(True, None)]  # the guard answered it: nothing died, the worker stayed ready


def test_a_background_task_that_dies_is_logged_and_makes_the_worker_not_ready(stack, qwen35_model, monkeypatch,
                                                                                capfd):
    """Beginning the poisoned record raises, and beginning its skipped record again (the guard's last resort):
    the fetch's task dies. The worker says so: its log has the traceback, /readyz answers 503 naming the task."""
    _one_partition(stack)
    real = RequestPipeline._begin

    def begin(self: RequestPipeline, read: Any) -> Any:
        if read.key == POISON.encode():
            raise RuntimeError("simulated: nothing of this record can be answered")
        return real(self, read)

    monkeypatch.setattr(RequestPipeline, "_begin", begin)
    requests = _requests()
    records = [record(r) for r in requests]
    answered = [r["id"] for r in requests if r["id"] != POISON]
    settings = stack.settings(log_format="json")
    seen: dict[str, Any] = {}

    async def during(service: Any, reader: Any, task: Any) -> None:
        server = MetricsServer(service.metrics, host="127.0.0.1", port=0)
        server.start()
        try:
            assert await asyncio.to_thread(_readyz, server) == (200, "ready\n")
            await reader.wait_ids(answered, 60, task)  # the guard answered the others
            deadline = time.monotonic() + 30
            while (found := await asyncio.to_thread(_readyz, server))[0] == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            seen["readyz"] = found
        finally:
            server.stop()

    capfd.readouterr()
    restore = configure_logging(settings.observability.log_format, settings.observability.log_level)
    try:
        _, reader = run(serve(stack, settings, qwen35_model, records, answered, during=during, timeout=60))
        _, err = capfd.readouterr()
    finally:
        restore()

    status, body = seen["readyz"]
    assert status == 503, body
    assert "background task died" in body and f"answering the records of {stack.requests}-0@" in body, body
    assert "RuntimeError: simulated" in body, body
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    died = [e for e in events if e.get("event") == "background task died; the worker is not ready"]
    assert len(died) == 1, err[-3000:]
    assert "Traceback" in died[0]["exception"] and "RuntimeError: simulated" in died[0]["exception"]
    assert "Task exception was never retrieved" not in err
    assert POISON not in reader.counts()  # nothing could answer it: its partition stands at it
    assert set(reader.counts()) == set(answered)
