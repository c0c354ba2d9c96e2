"""Sinks: where answers go. A set of Kafka topics, or a JSON-lines file.

A sink writes records and says when they are durable; it knows nothing of offsets. When a consumed offset
may be committed is the commit policy's business (commits.py), which pairs with a sink to make a delivery
mode. ``KafkaTopics`` also hands out the transactional producers the ``exactly_once`` policy commits with, so
every producer of a worker is configured in one place.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

import structlog
from aiokafka.structs import TopicPartition

from d3stream.core.outgoing import Outgoing
from d3stream.core.shadow import shadow_topic
from d3stream.kafka.connection import client_options, kafka_admin, kafka_producer
from d3stream.kafka.limits import Limits, read_topic_limits
from d3stream.kafka.publishing import (
    RecordBatches,
    breaks_the_producer,
    classify,
    quietly_stop,
    send_with_retries,
)
from d3stream.ops.metrics import Metrics
from d3stream.settings import ConnectionSettings, DeliverySettings, ModelSettings

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaProducer

log = structlog.get_logger(__name__)


class Sink(Protocol):
    """Where answers (and dead letters, and the provenance record) go."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def topics(self) -> list[tuple[str, dict[str, str]]]:
        """The Kafka topics it writes to, with the configuration each needs when created (none: a file)."""
        ...

    async def read_limits(self) -> dict[str, int]:
        """The message limit of each topic it writes to (empty: records of any size fit)."""
        ...

    async def write(self, records: Sequence[Outgoing]) -> None:
        """Write ``records``; returns once they are acknowledged (a file: written; durable at ``flush``)."""
        ...

    async def flush(self) -> None:
        """Make everything written durable (Kafka: acknowledged already; a file: fsync)."""
        ...

    async def publish_provenance(self, record: Outgoing) -> None:
        """The model's provenance record, outside any transaction (a file sink has nowhere to put it)."""
        ...


# Rounds of sending again what a refused batch failed: its records alone, then what a broken producer failed
# meanwhile (a concurrent write's batches). Beyond, the slow path decides.
RESENDS = 2


def _send_again(record: Outgoing, error: BaseException) -> bool:
    """Whether a failed record is sent again in a batch: refused as too large in a batch it shared (then alone,
    marked here), or failed by a producer that a refusal left out of step."""
    if classify(error, transactional=False) == "record":
        if record.alone:
            return False  # refused alone: its replacement is the slow path's
        record.alone = True
        return True
    return breaks_the_producer(error)


class KafkaTopics:
    """Answers, dead letters and the provenance record on their Kafka topics, through an idempotent producer
    (``acks=all``); transactional producers per input partition for the ``exactly_once`` commit policy."""

    def __init__(self, connection: ConnectionSettings, delivery: DeliverySettings, models: ModelSettings,
                 limits: Limits, metrics: Metrics | None = None):
        self.connection = connection
        self.delivery = delivery
        self.models = models  # whether there is a shadow, and its topic
        self.limits = limits
        self.metrics = metrics
        self.producer: AIOKafkaProducer | None = None
        # Hands records to the producer one caller at a time. With thousands of requests answering at
        # once, each waiting in aiokafka's accumulator for room would be woken on every drain (measured:
        # 30 wake-ups per record, 5x slower); queued here, only the head of the line waits there.
        self._enqueue = asyncio.Lock()
        self._renewing = asyncio.Lock()
        self._batched: RecordBatches | None = None  # of the current producer

    def new_producer(self, partition: TopicPartition | None = None) -> AIOKafkaProducer:
        """A producer with this worker's settings; for an input ``partition``, transactional with an id derived
        from the group, topic and partition (so the partition's next owner fences this one)."""
        delivery = self.delivery
        options: dict[str, object] = {}
        if partition is not None:
            options["transactional_id"] = (
                f"{delivery.transactional_id_prefix}-{delivery.group_id}-{partition.topic}-{partition.partition}"
            )
        return kafka_producer(self.connection,
            client_id=self.connection.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=2,
            max_batch_size=self.limits.batch_bytes(delivery.producer_batch_bytes),
            max_request_size=delivery.max_request_size,
            compression_type=self.limits.compression,
            **options,
        )

    def topics(self) -> list[tuple[str, dict[str, str]]]:
        delivery = self.delivery
        # With a shadow model, its answers' topic (shadow.py).
        shadow: list[tuple[str, dict[str, str]]] = (
            [(shadow_topic(self.models, delivery), {})] if self.models.shadow else []
        )
        return [(delivery.answer_topic, {}), *shadow, (delivery.dead_letter_topic, {}),
                (delivery.provenance_topic, {"cleanup.policy": "compact"})]

    async def start(self) -> None:
        self.producer = self.new_producer()
        await self.producer.start()

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def read_limits(self) -> dict[str, int]:
        return await read_topic_limits(
            client_options(self.connection, "admin", client_id=self.connection.client_id),
            [name for name, _ in self.topics()],
            create_topics=self.delivery.create_topics,
        )

    async def write(self, records: Sequence[Outgoing]) -> None:
        """Hand every record to the producer in batches (``publishing.RecordBatches``), then wait for the
        acknowledgements. A batch the broker refused as too large may hold records that each fit: they are sent
        again each in a batch of its own (``Outgoing.alone``), on a fresh producer (the refusal left the old
        one's sequence numbers out of step, failing its later batches too, which are sent again with them).
        What still fails goes the slow way, alone (``send_with_retries``: backoff, a fresh producer when the
        failure broke it, replacement of a record refused as too large)."""
        failed = await self._batches().send(records)
        for _ in range(RESENDS):
            again = [index for index, error in failed if _send_again(records[index], error)]
            if not again:
                break
            if any(breaks_the_producer(error) for _, error in failed):
                await self._renew(self._producer(), True)
            resent = await self._batches().send([records[index] for index in again])
            taken = set(again)
            failed = [failure for failure in failed if failure[0] not in taken]
            failed += [(again[position], error) for position, error in resent]
        if failed:
            await asyncio.gather(*(self._publish(records[index]) for index, _ in failed))

    async def _publish(self, record: Outgoing) -> None:
        await send_with_retries(self._producer(), record, self.metrics, self._enqueue, renew=self._renew)

    async def flush(self) -> None:
        return None  # every write waited for its acknowledgement

    async def publish_provenance(self, record: Outgoing) -> None:
        await send_with_retries(self._producer(), record, self.metrics)

    def _batches(self) -> RecordBatches:
        producer = self._producer()
        if self._batched is None or self._batched.producer is not producer:
            self._batched = RecordBatches(producer)  # the producer was renewed: batches of the new one
        return self._batched

    def _producer(self) -> AIOKafkaProducer:
        if self.producer is None:
            raise RuntimeError("the Kafka sink is not started")
        return self.producer

    async def _renew(self, failed: AIOKafkaProducer, broken: bool) -> AIOKafkaProducer:
        """The producer to send with after ``failed`` failed: with ``broken``, a fresh idempotent producer
        (new producer id, sequences from zero) in its place, which callers that saw the same failure share;
        else the current one (which a caller of the old one needs after a replacement)."""
        async with self._renewing:
            if broken and self.producer is failed:
                log.warning("replacing the producer (its sequence numbers are out of step with the broker)")
                fresh = self.new_producer()
                await fresh.start()
                self.producer = fresh
                asyncio.ensure_future(quietly_stop(failed))  # its remaining sends fail and are retried
            return self.producer


class JsonLinesFile:
    """Answers appended to a JSON-lines file, one per line; durable at ``flush`` (fsync). Dead letters, shadow
    answers and the provenance record are not kept: the file holds answers only, and each answer carries its
    provenance."""

    def __init__(self, path: Path):
        self.path = path
        self._handle: IO[bytes] | None = None

    def topics(self) -> list[tuple[str, dict[str, str]]]:
        return []

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "ab")  # noqa: SIM115 - held for the sink's lifetime

    async def stop(self) -> None:
        if self._handle is not None:
            await self.flush()
            self._handle.close()
            self._handle = None

    async def read_limits(self) -> dict[str, int]:
        return {}

    async def write(self, records: Sequence[Outgoing]) -> None:
        handle = self._file()
        for record in records:
            if record.kind == "answer":
                handle.write(record.value + b"\n")

    async def flush(self) -> None:
        handle = self._file()
        handle.flush()
        os.fsync(handle.fileno())

    async def publish_provenance(self, record: Outgoing) -> None:
        return None

    def _file(self) -> IO[bytes]:
        if self._handle is None:
            raise RuntimeError(f"the answer file {self.path} is not open")
        return self._handle


async def ensure_topics(connection: ConnectionSettings, delivery: DeliverySettings, sink: Sink) -> None:
    """Create the request topics and the sink's topics that do not exist yet (``create_topics``), each with
    ``topic_partitions`` partitions and the sink's topic configs."""
    from aiokafka.admin.new_topic import NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = kafka_admin(connection, client_id=connection.client_id)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        partitions = {name: delivery.topic_partitions for name in delivery.request_topics}
        configs: dict[str, dict[str, str]] = {}
        for name, config in sink.topics():
            # A compacted topic (provenance) holds one record per model: one partition is enough.
            partitions[name] = 1 if config.get("cleanup.policy") == "compact" else delivery.topic_partitions
            configs[name] = config
        for name, count in partitions.items():
            if name in existing:
                continue
            try:
                await admin.create_topics([NewTopic(name, count, 1, topic_configs=configs.get(name, {}))])
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()
