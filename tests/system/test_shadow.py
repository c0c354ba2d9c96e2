"""Shadow evaluation (``--shadow``) with a worker SIGKILLed mid-stream: nothing lost or repeated on either the
answer or the shadow topic."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.benchmarks.chaos import WorkerProcess, count_topic, worker_env
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    record,
    run,
)

pytestmark = pytest.mark.timeout(300)

def _requests(count: int, prefix: str) -> list[dict[str, Any]]:
    requests = []
    for n in range(count):
        state = {"ticket": n, "text": "I was charged twice, please refund me " + "now " * (n % 3)}
        questions = {"refund": Q_NOUL} if n % 2 else {"refund": Q_NOUL, "team": Q_CHOICE, "urgency": Q_SCORE}
        requests.append({"id": f"{prefix}-{n:02d}", "state": state, "questions": questions})
    return requests


def test_a_worker_killed_mid_stream_loses_and_repeats_nothing_on_either_topic(
        stack, qwen35_text_checkpoint, demo_random_checkpoint, tmp_path, capsys):
    bootstrap = stack.broker.bootstrap_servers
    shadow_topic = f"{stack.answers}.shadow"
    requests = _requests(36, "kill")
    rng = random.Random(5)
    env = worker_env({
        "bootstrap_servers": bootstrap, "request_topics": [stack.requests], "answer_topic": stack.answers,
        "dead_letter_topic": stack.dead_letters, "provenance_topic": stack.provenance, "group_id": stack.group,
        "group_instance_id": f"{stack.group}-0", "session_timeout_ms": 6000,
        "model": f"live={qwen35_text_checkpoint}", "shadow": f"candidate={demo_random_checkpoint}",
        # Commits every 3 s: the kill lands with answers (and their shadows) computed but not committed.
        "commit_interval_ms": 3000, "linger_ms": 10, "metrics_port": "", "log_format": "json",
    })
    env.pop("D3STREAM_CONFIG", None)
    worker = WorkerProcess(env, tmp_path / "worker.log")
    first, second, third = requests[:12], requests[12:24], requests[24:]

    def serving() -> int:
        return worker.log_path.read_text(errors="replace").count('"event": "serving"') if worker.log_path.exists() else 0

    async def scenario() -> tuple[int, int]:
        async with Reader(bootstrap, stack.answers) as reader:
            worker.start()
            try:
                await reader.wait(lambda: serving() >= 1 or worker.process.poll() is not None, 120, what="serving")
                await produce(bootstrap, stack.requests, [record(r) for r in first])
                await reader.wait(lambda: len(reader.counts()) > 0, 60, what="a first commit")
                await produce(bootstrap, stack.requests, [record(r) for r in second])
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                worker.kill()
                at_kill = len(reader.counts())
                worker.start()
                await produce(bootstrap, stack.requests, [record(r) for r in third])
                await reader.wait_ids({r["id"] for r in requests}, 120)
            finally:
                rc = worker.terminate(60)
            assert rc == 0, worker.log_path.read_text()[-3000:]
            return at_kill, 24

    at_kill, published = run(scenario())
    assert at_kill < published, "the kill landed after every answer was committed: it proved nothing"
    ids = collections.Counter(r["id"] for r in requests)
    for topic, model in ((stack.answers, "live"), (shadow_topic, "candidate")):
        answers = run(count_topic(bootstrap, topic))
        assert collections.Counter(a["id"] for a in answers) == ids, topic  # none lost, none twice
        assert {a["model"] for a in answers} == {model}, topic
        assert all("answers" in a for a in answers), topic
    with capsys.disabled():
        print(f"\n[shadow kill] {at_kill} of {published} requests committed when the worker was killed")
