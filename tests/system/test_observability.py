"""Headers, traces and logs of real processes: a ``d3stream serve`` process with ``--log-format json`` writes
nothing but JSON lines, aiokafka's own warnings included, and with ``--otlp-endpoint`` posts its spans to an
OTLP/HTTP receiver; header and tracing settings are checked, and with tracing off a fresh interpreter
imports no OpenTelemetry.
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

from d3stream.ops.tracing import Tracing, traces_url
from d3stream.settings import Settings
from tests.support.stream_helpers import Q_NOUL, Reader, free_port, record, run

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


def test_header_and_tracing_settings_are_checked():
    with pytest.raises(ValueError, match="forward_headers may not name content-type"):
        Settings.from_flat(forward_headers=["content-type"]).check()
    with pytest.raises(ValueError, match="forward_headers_max_bytes"):
        Settings.from_flat(forward_headers_max_bytes=-1).check()
    defaults = Settings()
    # Off by default: the service builds no spans at all.
    assert Tracing.from_settings(defaults.observability, defaults.delivery) is None
    # ... and never imports OpenTelemetry (checked in a fresh interpreter: this session may have imported it).
    probe = ("import sys, d3stream.service, d3stream.jobs.replay; from d3stream.settings import Settings; "
             "from d3stream.ops.tracing import Tracing; s = Settings(); "
             "assert Tracing.from_settings(s.observability, s.delivery) is None; "
             "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/custom/traces") == "http://collector:4318/custom/traces"


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
