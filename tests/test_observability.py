"""Headers, traces and logs: what an operator's tracing and logging stack sees of d3stream.

Against the session's real broker and object store, with the tiny real model: request headers travel to
the answer records (both delivery modes, and a replay), each request becomes one OpenTelemetry span with a
child per stage (recorded with the SDK's own in-memory exporter), and a real ``d3stream serve`` process with
``--log-format json`` writes nothing but JSON lines, aiokafka's own warnings included, and with
``--otlp-endpoint`` posts its spans to an OTLP/HTTP receiver.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.contract import HEADERS

from d3stream.jobs.replay import ReplayRange, run_replay
from d3stream.ops.tracing import Tracing, forwarded_headers, header_names, traces_url
from d3stream.settings import Settings
from tests.media_makers import make_png
from tests.stream_helpers import Q_CHOICE, Q_NOUL, Reader, free_port, read_all, record, run, serve

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01".encode()
STAGES = {"fetch", "decode", "prepare", "queue", "forward", "publish"}


# --------------------------------------------------------------------------------- header selection


def test_forwarded_headers_take_the_allowed_names_once_within_the_byte_bound():
    names = header_names(["x-tenant", "traceparent", "x-route"])
    assert names == ("traceparent", "tracestate", "x-tenant", "x-route")
    incoming = [
        ("x-tenant", b"acme"), ("x-secret", b"never"), ("x-tenant", b"second"), ("x-route", None),
        ("tracestate", b"v=1"), ("traceparent", TRACEPARENT),
    ]
    # Trace headers first, the first occurrence of a name only, unlisted and valueless headers never.
    assert forwarded_headers(incoming, names, 4096) == [
        ("traceparent", TRACEPARENT), ("tracestate", b"v=1"), ("x-tenant", b"acme"),
    ]
    # The bound keeps the trace headers and leaves out what no longer fits.
    room = len("traceparent") + len(TRACEPARENT) + len("x-tenant") + len(b"acme")
    assert forwarded_headers([("x-tenant", b"x" * 500), ("traceparent", TRACEPARENT)], names, room) == [
        ("traceparent", TRACEPARENT)
    ]
    assert forwarded_headers(None, names, 4096) == [] and forwarded_headers(incoming, names, 0) == []


@pytest.mark.subprocess
def test_header_and_tracing_settings_are_checked():
    with pytest.raises(ValueError, match="forward_headers may not name content-type"):
        Settings.from_flat(forward_headers=["content-type"]).check()
    with pytest.raises(ValueError, match="forward_headers_max_bytes"):
        Settings.from_flat(forward_headers_max_bytes=-1).check()
    assert Tracing.from_settings(Settings()) is None  # off by default: the service builds no spans at all
    # ... and never imports OpenTelemetry (checked in a fresh interpreter: this session may have imported it).
    probe = ("import sys, d3stream.service, d3stream.jobs.replay; from d3stream.settings import Settings; "
             "from d3stream.ops.tracing import Tracing; assert Tracing.from_settings(Settings()) is None; "
             "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/custom/traces") == "http://collector:4318/custom/traces"


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


# ------------------------------------------------------------------------------------------ JSON logs


class Collector:
    """An OTLP/HTTP trace receiver on a free local port: the request ids of the spans posted to it."""

    def __init__(self) -> None:
        import http.server
        import threading

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        received = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the http.server interface
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest.FromString(body)
                for resource in export.resource_spans:
                    for scope in resource.scope_spans:
                        received.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def request_ids(self) -> set[str]:
        return {attribute.value.string_value for span in self.spans for attribute in span.attributes
                if attribute.key == "d3stream.request.id"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_serve_with_json_logs_and_otlp_writes_only_json_lines_and_exports_a_span_per_request(
    stack, qwen35_checkpoint, tmp_path
):
    # Three bootstrap addresses nobody listens on beside the real one: aiokafka reports each refused
    # connection, which was silenced before and must now show at info, as JSON.
    collector = Collector()
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    requests = [{"id": f"log-{n}", "state": f"log line {n}", "questions": {"noul": Q_NOUL}} for n in range(3)]
    requests.append({"id": "log-invalid", "state": "no questions", "questions": {}})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("D3STREAM_CONFIG", None)
    command = stack.serve_command(
        qwen35_checkpoint,
        "--commit-interval-ms", "100",
        "--metrics-port", str(free_port()),
        "--log-format", "json",
        "--log-level", "info",
        "--otlp-endpoint", collector.endpoint,
        bootstrap_servers=f"{dead},{stack.broker.bootstrap_servers}",
    )
    stdout, stderr = tmp_path / "serve.out", tmp_path / "serve.err"

    async def scenario() -> int:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout.open("wb"), stderr=stderr.open("wb"),
                                   start_new_session=True)
        try:
            async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
                from d3stream_client.publisher import produce

                await produce(stack.broker.bootstrap_servers, stack.requests, [record(r) for r in requests])
                await reader.wait(lambda: len(reader.counts()) >= len(requests) or process.poll() is not None, 120,
                                  what="the answers of `d3stream serve`")
            assert process.poll() is None, stderr.read_text()[-3000:]
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 90
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return process.returncode
        finally:
            if process.poll() is None:
                process.kill()

    try:
        returncode = run(scenario())
    finally:
        collector.close()
    assert returncode == 0, stderr.read_text()[-3000:]
    # The spans reached the collector (exported at the latest when the worker stopped).
    assert collector.request_ids() == {r["id"] for r in requests}
    lines = [line for path in (stdout, stderr) for line in path.read_text().splitlines() if line.strip()]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a log line is not JSON: {line[:300]!r}")
    assert all({"event", "level", "timestamp", "logger"} <= set(event) for event in events)
    named = {event["event"] for event in events if event["logger"].startswith("d3stream")}
    assert {"serving", "request refused", "stopped"} <= named
    refused = [e for e in events if e.get("logger", "").startswith("aiokafka") and "Unable connect" in e["event"]]
    assert refused and refused[0]["level"] == "error", [e for e in events if not e["logger"].startswith("d3stream")]
