"""A ``d3stream replay`` process SIGKILLed mid-range resumes without skipping or doubling a request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from d3stream_client.publisher import produce

REPO = Path(__file__).resolve().parents[2]


def request(number: int, *, long: bool = False) -> dict:
    state = f"Order {number}: " + ("widget " * (120 if long else (number % 13 + 1)))
    return {
        "id": f"r{number:04d}",
        "state": state,
        "questions": {
            "stock": {"type": "noul", "instructions": "In stock?"},
            "route": {"type": "choice", "criteria": {"north": "dock A", "south": "dock B", "hold": None}},
            "priority": {"type": "score", "criteria": ["low", "mid", "high"]},
        },
    }


def records(count: int, **kwargs) -> list[tuple[bytes, bytes]]:
    return [(f"r{n:04d}".encode(), json.dumps(request(n, **kwargs)).encode()) for n in range(count)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def request_topic(kafka_broker, topic_names):
    name = topic_names("replay-req")
    kafka_broker.create_topic(name, partitions=2)
    return name


def test_a_killed_replay_resumes_without_skipping_or_doubling(
    kafka_broker, request_topic, topic_names, qwen35_text_checkpoint, tmp_path
):
    count = 240
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(count, long=True)))
    out = tmp_path / "resumed.jsonl"
    command = [
        sys.executable, "-m", "d3stream", "replay",
        "--from-topic", request_topic, "--replay-id", "resume", "--out", str(out), "--json",
        "--model", str(qwen35_text_checkpoint), "--verify", "none",
        "--bootstrap-servers", kafka_broker.bootstrap_servers, "--group-id", topic_names("g"),
        "--commit-interval-ms", "100", "--metrics-port", "",
    ]
    environment = dict(os.environ, PYTHONPATH=str(REPO))
    first = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < 40):
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    written_before = len(read_jsonl(out)) if out.exists() else 0
    assert 0 < written_before < count, "the replay should have been killed midway"

    second = subprocess.run(command, env=environment, capture_output=True, timeout=300)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    summary = json.loads(second.stdout.decode().strip().splitlines()[-1])
    ids = [a["id"] for a in read_jsonl(out)]
    assert sorted(set(ids)) == [f"r{n:04d}" for n in range(count)]
    assert len(ids) == count, "a request was written twice"
    assert summary["replayed"] < count  # the second run did not start over
