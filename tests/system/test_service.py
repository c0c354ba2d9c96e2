"""``d3stream serve`` as a process: SIGTERM mid-stream, then a restart, answers each request once."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from d3stream_client.publisher import produce

from d3stream.settings import SETTINGS
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    record,
    run,
)

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


def test_serve_command_sigterm_mid_stream_and_restart(stack, qwen35_checkpoint, tmp_path):
    requests = [{"id": f"cli-{n:02d}", "state": f"command {n}",
                 "questions": {"noul": Q_NOUL, "route": Q_CHOICE, "level": Q_SCORE}} for n in range(28)]
    ids = {r["id"] for r in requests}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("D3STREAM_CONFIG", None)
    command = stack.serve_command(
        qwen35_checkpoint,
        "--linger-ms", "5",
        "--max-batch-rows", "1",
        "--max-inflight-requests", "4",
        "--commit-interval-ms", "200",
        "--log-format", "json",
    )
    if "metrics_port" in SETTINGS:  # never the fixed default port: other workers may be serving on this machine
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            command += ["--metrics-host", "127.0.0.1", "--metrics-port", str(probe.getsockname()[1])]

    def start(number: int) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"serve-{number}.log"
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                   stderr=log.open("wb"), start_new_session=True)
        return process, log

    async def finish(process: subprocess.Popen, log: Path) -> int:
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 90
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                raise AssertionError(f"serve did not exit after SIGTERM:\n{log.read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        return process.returncode

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        async with Reader(bootstrap, stack.answers) as reader:
            first, first_log = start(1)
            try:
                # Publish while the worker serves, so the SIGTERM lands mid-stream.
                for request in requests[:10]:
                    await produce(bootstrap, stack.requests, [record(request)])
                await reader.wait(lambda: len(reader.counts()) >= 5 or first.poll() is not None, 120,
                                  what="the first answers from `d3stream serve`")
                assert first.poll() is None, first_log.read_text()[-3000:]
                publishing = asyncio.create_task(produce(bootstrap, stack.requests, [record(r) for r in requests[10:20]]))
                await reader.wait(lambda: len(reader.counts()) >= 13 or first.poll() is not None, 60,
                                  what="answers to the second part of the stream")
                rc_first = await finish(first, first_log)
                await publishing
                # The rest arrive while no worker serves: a first worker fast enough to answer the whole stream
                # before its SIGTERM left the restart nothing to do (it was stopped while still starting).
                await produce(bootstrap, stack.requests, [record(r) for r in requests[20:]])
            finally:
                if first.poll() is None:
                    first.kill()
            answered_by_first = len(reader.counts())
            second, second_log = start(2)
            try:
                await reader.wait(lambda: ids <= set(reader.counts()) or second.poll() is not None, 120,
                                  what="all answers after the restart")
                assert second.poll() is None, second_log.read_text()[-3000:]
                rc_second = await finish(second, second_log)
            finally:
                if second.poll() is None:
                    second.kill()
            await reader.caught_up()
            return rc_first, rc_second, first_log, second_log, reader.answers(), answered_by_first

    rc_first, rc_second, first_log, second_log, answers, answered_by_first = run(scenario())
    assert rc_first == 0, first_log.read_text()[-3000:]
    assert rc_second == 0, second_log.read_text()[-3000:]
    counts = collections.Counter(a["id"] for a in answers)
    assert set(counts) == ids
    assert all(v == 1 for v in counts.values()), {k: v for k, v in counts.items() if v != 1}
    assert all("error" not in a for a in answers)
    pids = collections.Counter(a["provenance"]["worker"]["pid"] for a in answers)
    assert len(pids) == 2, f"both processes answered: {pids}"
    assert 5 <= answered_by_first < len(requests)
    # Both logs say the worker stopped cleanly.
    for log in (first_log, second_log):
        events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(e.get("event") == "stopped" for e in events), log.read_text()[-2000:]
