"""Answers published as record batches built by the worker (publishing.RecordBatches) land where aiokafka's own
``send`` would put them, each once, with their headers; records that cannot go in a batch still go, one by one.

On the real broker: the same keyed records are published once through ``RecordBatches`` and once through
``AIOKafkaProducer.send``, and read back from both topics.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer

from d3stream.kafka.publishing import Outgoing, RecordBatches
from tests.support.stream_helpers import read_all, run


def test_batched_records_land_on_the_partitions_send_would_choose(kafka_broker, topic_names):
    batched, sent = topic_names("batched"), topic_names("sent")
    for topic in (batched, sent):
        kafka_broker.create_topic(topic, 4)
    headers = [("content-type", b"application/json"), ("d3stream-schema", b"2")]
    # Keyed answers of several sizes, one too large for a batch of its own (it goes through send), one without
    # a key (placed by the partitioner at random, through send).
    records = [Outgoing(batched, f"request-{n}".encode(), b"x" * (50 + 37 * n % 900), headers=headers)
               for n in range(600)]
    records.append(Outgoing(batched, b"large", b"y" * 12_000, headers=headers))
    records.append(Outgoing(batched, None, b"no key", headers=headers))

    async def publish() -> list[tuple[int, BaseException]]:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers, acks="all",
                                    enable_idempotence=True, linger_ms=2)
        await producer.start()
        try:
            await producer.partitions_for(batched)  # known metadata: each write queues its records at once
            batches = RecordBatches(producer)
            # Two writes at once, as two passes' answers are: each waits for its own records only.
            first, second = await asyncio.gather(batches.send(records[:300]), batches.send(records[300:]))
            for record in records[:-1]:
                await producer.send(sent, record.value, key=record.key, headers=record.headers)
            await producer.flush()
            return first + second
        finally:
            await producer.stop()

    assert run(publish()) == []
    got = run(read_all(kafka_broker.bootstrap_servers, batched, 4))
    want = run(read_all(kafka_broker.bootstrap_servers, sent, 4))
    assert sorted((r.key or b"", r.value) for r in got) == sorted((r.key or b"", r.value) for r in records)
    assert all(list(r.headers) == headers for r in got)
    placed = {r.key: r.partition for r in got if r.key is not None}
    assert placed == {r.key: r.partition for r in want}
    # Within a partition, batched records keep the order they were handed over in.
    for partition in range(4):
        keys = [r.key for r in sorted(got, key=lambda r: r.offset) if r.partition == partition and r.key != b"large"
                and r.key]
        assert keys == [r.key for r in records[:600] if placed[r.key] == partition]


SMALL_LIMIT = 30_000  # max.message.bytes of the answer topic below: about 28 answers of 1 KB a batch


class _SmallTopic:
    """A worker's answer sink (``KafkaTopics``) over a fresh answer topic that takes ``SMALL_LIMIT`` bytes a
    batch, and 200 answers of 1 KB for one partition, each noting when it is replaced as too large."""

    def __init__(self, kafka_broker, topic_names, name: str):
        from d3stream.kafka.limits import Limits
        from d3stream.kafka.sinks import KafkaTopics
        from d3stream.settings import Settings

        self.broker = kafka_broker
        self.topic, letters, provenance = topic_names(name), topic_names("letters"), topic_names("provenance")
        kafka_broker.create_topic(self.topic, 1, {"max.message.bytes": str(SMALL_LIMIT)})
        for other in (letters, provenance):
            kafka_broker.create_topic(other, 1)
        settings = Settings.from_flat(bootstrap_servers=kafka_broker.bootstrap_servers, answer_topic=self.topic,
                                      dead_letter_topic=letters, provenance_topic=provenance, compression="none",
                                      metrics_port=None, create_topics=False)
        self.limits = Limits(max_request_size=settings.delivery.max_request_size, compression=None)
        self.sink = KafkaTopics(settings.connection, settings.delivery, settings.models, self.limits)
        self.replaced: list[bytes] = []
        self.records = [self.answer(b"%06d" % n, 1_000) for n in range(200)]

    def answer(self, name: bytes, size: int) -> Outgoing:
        def too_large(cause: str) -> Outgoing:
            self.replaced.append(name)
            return Outgoing(self.topic, b"one key", b"replaced")

        return Outgoing(self.topic, b"one key", name + b"a" * size, replacement=too_large)

    def publish(self, *, read_limits: bool) -> list[bytes]:
        """Write every record at once, as a pass's answers are; the values on the topic in order."""

        async def write() -> None:
            if read_limits:  # as a worker's start-up reads them, before the producer
                self.limits.topics = await self.sink.read_limits()
            await self.sink.start()
            try:
                await self.sink.write(self.records)
            finally:
                await self.sink.stop()

        run(write())
        got = run(read_all(self.broker.bootstrap_servers, self.topic, 1))
        return [record.value for record in sorted(got, key=lambda record: record.offset)]


def test_records_that_each_fit_a_small_topic_limit_are_never_batched_past_it(kafka_broker, topic_names):
    """The worker's producer batches answers (producer_batch_bytes, 128 KiB by default) but never past the
    topic's limit, which the broker would refuse as a whole, every answer in it replaced as too large."""
    topic = _SmallTopic(kafka_broker, topic_names, "small-limit")
    assert topic.publish(read_limits=True) == [record.value for record in topic.records]
    assert topic.replaced == []


def test_answers_of_a_batch_refused_as_too_large_are_tried_alone_before_any_is_replaced(kafka_broker, topic_names):
    """The worker believes the topic takes 1 MB (a limit lowered since it read them, or one it may not read) and
    batches the answers up to 128 KiB; the broker refuses those batches. Each answer then goes in a batch of its
    own, fits, and lands as written; only one too large even alone is replaced."""
    topic = _SmallTopic(kafka_broker, topic_names, "lowered")
    topic.records.append(topic.answer(b"large", 40_000))
    got = topic.publish(read_limits=False)
    assert topic.replaced == [b"large"]
    assert sorted(got) == sorted([record.value for record in topic.records[:200]] + [b"replaced"])
