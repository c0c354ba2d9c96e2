"""``d3stream compare`` reading one side from a Kafka topic range on the session's broker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from d3stream.dev.infra import KafkaBroker
from d3stream.jobs.compare import (
    SourceError,
    compare,
    load_answers,
)
from tests.support.compare_answers import (
    A_RECORDS,
    B_RECORDS,
    event,
    noul,
)


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
