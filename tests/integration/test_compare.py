"""``d3stream compare`` reading one side from a Kafka topic range on the session's broker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from d3stream.dev.infra import KafkaBroker
from d3stream.jobs.compare import (
    SourceError,
    compare,
    load_answers,
)


def choice(probabilities: dict[str, float], confidence: float, pick: str | None = None) -> dict[str, Any]:
    pick = pick or max(probabilities, key=lambda k: probabilities[k])
    return {"type": "choice", "choice": pick, "probabilities": probabilities, "confidence": confidence}


def noul(p: float, p_false: float) -> dict[str, Any]:
    return {"type": "noul", "noul": p, "probabilities": {"false": p_false, "true": p}}


def score(levels: list[float], value: float, confidence: float) -> dict[str, Any]:
    return {"type": "score", "score": value, "probabilities": {str(i): p for i, p in enumerate(levels)},
            "confidence": confidence, "legend": {str(i): f"level {i}" for i in range(len(levels))}}


def event(request_id: str, answers: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "source": {"topic": "d3.requests", "partition": 0, "offset": 0},
            "model": "m", "answers": answers, "usage": {"input_tokens": 10, "output_tokens": 0}}


def refusal(request_id: str, code: str = "media_missing") -> dict[str, Any]:
    return {"id": request_id, "source": {"topic": "d3.requests", "partition": 0, "offset": 0},
            "error": {"code": code, "message": "no such object"}}


QUESTION_ERROR = {"type": "choice", "error": "max_length_exceeded", "message": "too long"}

# Six joined questions (r1: team, refund, urgency; r2: team, refund; r3: urgency); r2.team differs.
# |Δp| per option: r1.team .1 .1 0, r1.refund .2 .2, r1.urgency 0 .1 .1, r2.team .3 .3 0, r2.refund .1 .1,
# r3.urgency .1 .1 0: 16 options summing to 1.8.
A_RECORDS = [
    event("r1", {
        "team": choice({"billing": 0.7, "tech": 0.2, "sales": 0.1}, 0.5),
        "refund": noul(0.8, 0.2),
        "urgency": score([0.1, 0.3, 0.6], 1.5, 0.4),
    }),
    event("r2", {
        "team": choice({"billing": 0.6, "tech": 0.3, "sales": 0.1}, 0.3),
        "refund": noul(0.3, 0.7),
        "photo": choice({"yes": 0.9, "no": 0.1}, 0.8),
    }),
    event("r3", {"urgency": score([0.5, 0.3, 0.2], 0.7, 0.2)}),
    event("r4", {"refund": noul(0.9, 0.1)}),
    refusal("r7"),
]
B_RECORDS = [
    event("r1", {"team": choice({"billing": 0.1, "tech": 0.8, "sales": 0.1}, 0.9)}),  # replaced below
    event("r2", {
        "team": choice({"billing": 0.3, "tech": 0.6, "sales": 0.1}, 0.3),
        "refund": noul(0.4, 0.6),
        "photo": QUESTION_ERROR,
    }),
    event("r3", {"urgency": score([0.6, 0.2, 0.2], 0.6, 0.3), "extra": noul(0.5, 0.5)}),
    event("r1", {
        "team": choice({"billing": 0.6, "tech": 0.3, "sales": 0.1}, 0.4),
        "refund": noul(0.6, 0.4),
        "urgency": score([0.1, 0.4, 0.5], 1.4, 0.35),
    }),
    event("r5", {"refund": noul(0.2, 0.8)}),
    refusal("r6", "invalid_request"),
    event("r7", {"team": choice({"billing": 0.5, "tech": 0.5}, 0.0), "refund": noul(0.5, 0.5)}),
]
LABELS = [
    {"id": "r1", "question": "team", "answer": "billing"},
    {"id": "r1", "question": "refund", "answer": True},
    {"id": "r1", "question": "urgency", "answer": 2},
    {"id": "r2", "question": "team", "answer": "tech"},
    {"id": "r2", "question": "refund", "answer": False},
    {"id": "r3", "question": "urgency", "answer": 0},
    {"id": "r9", "question": "team", "answer": "billing"},  # no such request: unmatched
]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "a": write_jsonl(tmp_path / "a.jsonl", A_RECORDS),
        "b": write_jsonl(tmp_path / "b.jsonl", B_RECORDS),
        "labels": write_jsonl(tmp_path / "labels.jsonl", LABELS),
    }


def test_kafka_topic_range_against_file(
    kafka_broker: KafkaBroker, topic_names: Callable[[str], str], files: dict[str, Path]
) -> None:
    """Answers published to a topic (keyed, read committed) compare with the file they came from."""
    from aiokafka import AIOKafkaProducer

    spread, single = topic_names("answers"), topic_names("answers-one")
    kafka_broker.create_topic(spread, partitions=3)
    kafka_broker.create_topic(single, partitions=1)
    late = [event("r8", {"refund": noul(0.1, 0.9)}), event("r9", {"refund": noul(0.2, 0.8)})]

    async def publish() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers, acks="all",
                                    enable_idempotence=True)
        await producer.start()
        try:
            for topic, records in ((spread, B_RECORDS), (single, A_RECORDS + late)):
                for record in records:
                    await producer.send_and_wait(topic, json.dumps(record).encode(), key=record["id"].encode())
            await producer.send_and_wait(single, b"not json", key=b"junk")  # offset 7
        finally:
            await producer.stop()
        # read_committed: a committed transaction's record is read, an aborted one's is not
        transactional = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers,
                                         transactional_id=f"{single}-tx")
        await transactional.start()
        try:
            for request_id, commit in (("r10", True), ("r11", False)):
                await transactional.begin_transaction()
                await transactional.send_and_wait(single, json.dumps(event(request_id, {})).encode(),
                                                  key=request_id.encode())
                await (transactional.commit_transaction() if commit else transactional.abort_transaction())
        finally:
            await transactional.stop()

    asyncio.run(publish())
    servers = kafka_broker.bootstrap_servers

    from_topic = load_answers(f"kafka:{spread}", bootstrap_servers=servers, timeout_s=30)
    assert from_topic.duplicates == 1 and set(from_topic) == {"r1", "r2", "r3", "r5", "r6", "r7"}
    by_topic = compare(load_answers(files["a"]), from_topic).headline()
    by_file = compare(load_answers(files["a"]), load_answers(files["b"])).headline()
    assert by_topic == by_file

    first = load_answers(f"kafka:{single}@0-{len(A_RECORDS)}", bootstrap_servers=servers, timeout_s=30)
    assert list(first) == [r["id"] for r in A_RECORDS]
    assert compare(first, load_answers(files["b"])).headline() == by_file
    everything = load_answers(f"kafka:{single}", bootstrap_servers=servers, timeout_s=30)
    assert set(everything) == {"r1", "r2", "r3", "r4", "r7", "r8", "r9", "r10"} and everything.invalid == 1
    tail = load_answers(f"kafka:{single}@{len(A_RECORDS)}", bootstrap_servers=servers, timeout_s=30)
    assert list(tail) == ["r8", "r9", "r10"] and tail.invalid == 1
    assert load_answers(f"kafka:{single}@100-", bootstrap_servers=servers, timeout_s=30) == {}
    with pytest.raises(SourceError, match="no topic"):
        load_answers(f"kafka:{single}-missing", bootstrap_servers=servers, timeout_s=30)
