"""Nothing unwritable is retried forever, with real ``d3stream serve`` processes on the real broker:

* A ``d3stream serve`` SIGKILLed right after it committed an answer too large for the answer topic: after a
  restart nothing is lost or answered twice (exactly_once).
* An answer topic that does not exist, with ``create_topics`` off: ``d3stream serve`` exits non-zero (3)
  and says which topic.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess
import sys
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.benchmarks.chaos import WorkerProcess, count_topic, worker_env
from d3stream.cli.serve import WORKER_FATAL_EXIT
from tests.support.stream_helpers import Q_NOUL, Reader, record, run

pytestmark = pytest.mark.timeout(300)

# These requests are larger than max_request_bytes allows by default (a request that large is refused
# unread, tests/integration/test_limits.py); the workers here raise it so that the answer and dead-letter limits are met.
RAISED_REQUEST_BYTES = 2_000_000
# The largest value the tests' producer sends (its max_request_size is 1,048,576, with the record's framing).
MAX_REQUEST_VALUE = 1_048_400


def echoing(request_id: str, size: int, *, compressible: bool = False) -> dict[str, Any]:
    """A request of ``size`` bytes whose answer is larger: its metadata comes back with the answer, plus the
    answers and the provenance. (Many questions of many options amplify more, but take minutes on a CPU.)
    Random metadata stays over the limit when compressed; repetitive metadata compresses to almost nothing."""
    request = {"id": request_id, "state": "echo", "questions": {"a": Q_NOUL, "b": Q_NOUL}, "metadata": {"blob": ""}}
    room = size - len(json.dumps(request))
    blob = "abcdefgh" * (room // 8 + 1) if compressible else base64.b64encode(hashlib.shake_256(
        request_id.encode()).digest(room)).decode()
    request["metadata"]["blob"] = blob[:room]
    return request


def small(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "state": "after the poison", "questions": {"seen": Q_NOUL}}


def one_partition(stack) -> None:
    """Requests on a single partition: the records after the poison are the ones it would have halted."""
    stack.requests = stack.unique("req1")
    stack.broker.create_topic(stack.requests, 1)


def serve_env(stack, checkpoint, **overrides: Any) -> dict[str, str]:
    settings: dict[str, Any] = {
        "bootstrap_servers": stack.broker.bootstrap_servers, "request_topics": [stack.requests],
        "answer_topic": stack.answers, "dead_letter_topic": stack.dead_letters,
        "provenance_topic": stack.provenance, "group_id": stack.group,
        "group_instance_id": f"{stack.group}-0", "session_timeout_ms": 6000, "model": str(checkpoint),
        "commit_interval_ms": 100, "linger_ms": 10, "max_request_bytes": RAISED_REQUEST_BYTES,
        "metrics_port": "", "log_format": "json",
        "s3_endpoint_url": stack.store.endpoint_url, "media_allowlist": [stack.bucket],
    }
    settings.update(overrides)
    env = worker_env(settings)
    env.pop("D3STREAM_CONFIG", None)
    return env


def test_a_kill_right_after_an_answer_too_large_loses_and_doubles_nothing(stack, qwen35_text_checkpoint, tmp_path):
    one_partition(stack)
    worker = WorkerProcess(serve_env(stack, qwen35_text_checkpoint, compression="none", delivery="exactly_once"),
                           tmp_path / "worker.log")
    bootstrap = stack.broker.bootstrap_servers

    async def scenario() -> None:
        async with Reader(bootstrap, stack.answers) as reader:
            worker.start()
            try:
                await produce(bootstrap, stack.requests, [record(echoing("huge", MAX_REQUEST_VALUE)),
                                                          record(small("a"))])
                await reader.wait(lambda: "huge" in reader.counts() or worker.process.poll() is not None, 120,
                                  what="the answer_too_large answer")
                worker.kill()  # right after the commit that carried it (and maybe "a")
                await produce(bootstrap, stack.requests, [record(small("b"))])
                worker.start()
                await reader.wait_ids(["huge", "a", "b"], 120)
            finally:
                assert worker.terminate() == 0, worker.log_path.read_text()[-3000:]

    run(scenario())
    answers = run(count_topic(bootstrap, stack.answers))
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer["id"]] = counts.get(answer["id"], 0) + 1
    assert counts == {"huge": 1, "a": 1, "b": 1}
    assert next(a for a in answers if a["id"] == "huge")["error"]["code"] == "answer_too_large"


def test_serve_exits_non_zero_naming_a_missing_answer_topic(stack, qwen35_text_checkpoint):
    missing = stack.unique("no-such-answers")
    env = serve_env(stack, qwen35_text_checkpoint, answer_topic=missing, create_topics="false")
    done = subprocess.run([sys.executable, "-m", "d3stream", "serve"], env=env, capture_output=True, text=True,
                          timeout=240, stdin=subprocess.DEVNULL)
    assert done.returncode == WORKER_FATAL_EXIT, done.stderr[-3000:]
    assert missing in done.stderr and "create_topics" in done.stderr, done.stderr[-3000:]
    # And it created nothing on the way out.
    assert missing not in asyncio.run(_topics(stack.broker.bootstrap_servers))


async def _topics(bootstrap: str) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()
