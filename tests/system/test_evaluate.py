"""Live evaluation (``d3stream evaluate``) in worker processes on the real broker: two workers with one SIGKILLed
and restarted mid-stream lose and double nothing; a label topic whose partition count does not match the
answer topic's is refused, naming the fix.

The answers here are answer events as the worker publishes them (the contract's ``Answer``), written by the
test: the evaluator's input is the answer topic, and its tests need no model.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.jobs.evaluate import EvaluateSetupError, EvaluateTopics, prepare_topics
from tests.support.evaluate_events import (
    answer_event,
    evaluate_settings,
    events_until,
    keyed,
    label_event,
    read_events,
)

pytestmark = pytest.mark.timeout(300)


async def _logged(path: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(encoding="utf-8"):
        assert time.monotonic() < deadline, f"{path.name}: no {text!r} within {timeout_s:g} s"
        await asyncio.sleep(0.2)


def test_two_workers_one_killed_and_restarted_mid_stream_lose_and_double_nothing(
        kafka_broker: Any, topic_names: Any, tmp_path: Path) -> None:
    settings = evaluate_settings(kafka_broker, topic_names, session_timeout_ms=6000, topic_partitions=4)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(8)
    ids = [f"k-{n:04d}" for n in range(600)]
    answers = [answer_event(i, rng) for i in ids]
    labels = [label_event(i, rng) for i in ids]
    env = {**os.environ, "D3STREAM_BOOTSTRAP_SERVERS": servers, "D3STREAM_ANSWER_TOPIC": settings.delivery.answer_topic,
           "D3STREAM_LABEL_TOPIC": settings.evaluation.label_topic, "D3STREAM_EVALUATION_TOPIC": settings.evaluation.evaluation_topic,
           "D3STREAM_LABEL_DEAD_LETTER_TOPIC": settings.evaluation.label_dead_letter_topic,
           "D3STREAM_EVALUATE_STATE_TOPIC": settings.evaluation.evaluate_state_topic,
           "D3STREAM_EVALUATE_GROUP_ID": settings.evaluation.evaluate_group_id,
           "D3STREAM_EVALUATE_STATE_DIR": settings.evaluation.evaluate_state_dir,
           "D3STREAM_TRANSACTIONAL_ID_PREFIX": settings.delivery.transactional_id_prefix, "D3STREAM_TOPIC_PARTITIONS": "4",
           "D3STREAM_SESSION_TIMEOUT_MS": "6000", "D3STREAM_METRICS_PORT": "0", "D3STREAM_LOG_FORMAT": "json"}

    def start(name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        return subprocess.Popen([sys.executable, "-m", "d3stream", "evaluate"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    async def scenario() -> list[dict[str, Any]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        first, second = start("w1"), start("w2")
        try:
            for name in ("w1", "w2"):  # both in the group, each with partitions of its own
                await _logged(tmp_path / f"{name}.log", "evaluating partition")
            # Both workers evaluating (labels trail their answers, so each partition has answers waiting) ...
            await produce(servers, settings.delivery.answer_topic, keyed(answers[:200]))
            await produce(servers, settings.evaluation.label_topic, keyed(labels[:150]))
            await events_until(servers, settings.evaluation.evaluation_topic, 150)
            # ... then one is killed with records in flight; the other takes its partitions over.
            await produce(servers, settings.delivery.answer_topic, keyed(answers[200:400]))
            await produce(servers, settings.evaluation.label_topic, keyed(labels[150:300]))
            first.send_signal(signal.SIGKILL)
            first.wait()
            await produce(servers, settings.delivery.answer_topic, keyed(answers[400:]))
            await produce(servers, settings.evaluation.label_topic, keyed(labels[300:450]))
            first = start("w1")  # and comes back: a second rebalance
            await asyncio.sleep(2.0)
            await produce(servers, settings.evaluation.label_topic, keyed(labels[450:] + labels[:30]))  # some again
            found = await events_until(servers, settings.evaluation.evaluation_topic, 600, timeout_s=120)
            await asyncio.sleep(1.0)
            return await read_events(servers, settings.evaluation.evaluation_topic) if len(found) >= 600 else found
        finally:
            for process in (first, second):
                process.send_signal(signal.SIGTERM)
            for process in (first, second):
                process.wait(timeout=60)

    evaluations = asyncio.run(scenario())
    counts = collections.Counter(e["id"] for e in evaluations)
    assert sorted(counts) == ids, f"missing: {sorted(set(ids) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"doubled: {[i for i, c in counts.items() if c > 1][:10]}"
    logs = [(tmp_path / f"{name}.log").read_text(encoding="utf-8") for name in ("w1", "w2")]
    assert all("evaluating partition" in text for text in logs), "both workers took partitions"
    adopted = [json.loads(line) for text in logs for line in text.splitlines() if '"evaluating partition"' in line]
    # The killed worker's files were not closed: the other restored its partitions from the changelog.
    assert any(a["mode"] == "restore" and a["records"] > 0 and a["waiting"] > 0 for a in adopted), adopted
    # At the rebalance the kill made, the survivor held its units, files open and state in hand, for the
    # assignment to keep those it handed back (rebalance_keep_partitions; aiokafka's assignor may as well hand it
    # others: then those were closed cleanly, and a file closed cleanly is brought up to date from the changelog's
    # tail when its unit comes back: tests/integration/test_evaluate.py). A unit still opening is not held.
    revoked = [json.loads(line) for line in logs[1].splitlines() if '"partitions revoked"' in line]
    assert any(r["held"] > 0 for r in revoked), revoked


def test_a_label_topic_with_another_partition_count_is_refused_naming_the_fix(
        kafka_broker: Any, topic_names: Any) -> None:
    settings = evaluate_settings(kafka_broker, topic_names)

    async def scenario() -> str:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=settings.connection.bootstrap_servers)
        await admin.start()
        await admin.create_topics([NewTopic(settings.delivery.answer_topic, 3, 1), NewTopic(settings.evaluation.label_topic, 2, 1)])
        await admin.close()
        with pytest.raises(EvaluateSetupError) as refused:
            await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        return str(refused.value)

    message = asyncio.run(scenario())
    assert f"'{settings.evaluation.label_topic}' has 2 partitions" in message and "--alter --partitions 3" in message
