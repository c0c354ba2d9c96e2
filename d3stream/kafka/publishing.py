"""Publishing a record to Kafka, and what to do when that fails.

Publish and commit errors fall in three classes (``classify``), whatever the delivery mode:

* *retriable* (a broker restart, a leader election, a timeout): retried with bounded backoff and counted
  (``d3stream_publish_retries``); a plain publish gives up after ``PUBLISH_BACKOFF_S`` (``WorkerFatal``),
  a partition's transaction is retried with backoff up to ``MAX_TXN_BACKOFF_S`` (commits.py).
* *record-fatal* (the broker or the producer refuses one record as too large): that record is replaced
  by its ``Outgoing.replacement`` (an answer becomes an ``answer_too_large`` error answer under the same
  id, a dead letter loses its raw bytes) and the replacement is published instead.
* *worker-fatal* (no permission, a fenced idempotent producer, a topic that does not exist, a record
  whose replacement is refused too): ``WorkerFatal`` naming the topic and the cause; the worker stops
  without committing past the record and exits non-zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Literal, Protocol

import structlog
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import RecordMetadata
from murmurhash2 import murmurhash2

from d3stream.core.outgoing import Outgoing
from d3stream.kafka.limits import WorkerFatal

if TYPE_CHECKING:
    from aiokafka.producer.message_accumulator import BatchBuilder

    from d3stream.kafka.connection import AIOKafkaProducer
    from d3stream.ops.metrics import Metrics

log = structlog.get_logger(__name__)

PUBLISH_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# exactly_once: the longest wait between retries of a partition's failing transaction.
MAX_TXN_BACKOFF_S = 10.0

ErrorClass = Literal["retriable", "record", "worker"]


def classify(exc: BaseException, *, transactional: bool) -> ErrorClass:
    """Which of the three classes a publish or commit error is in (see the module's docstring)."""
    from aiokafka import errors

    if isinstance(exc, (errors.MessageSizeTooLargeError, errors.RecordTooLargeError,
                        errors.RecordListTooLargeError)):
        return "record"
    if isinstance(exc, (errors.TopicAuthorizationFailedError, errors.GroupAuthorizationFailedError,
                        errors.ClusterAuthorizationFailedError, errors.TransactionalIdAuthorizationFailed,
                        errors.InvalidTopicError, errors.UnsupportedVersionError)):
        return "worker"
    if not transactional and isinstance(exc, errors.ProducerFenced):
        return "worker"  # exactly_once handles fencing per partition (the partition moved)
    return "retriable"


def transaction_backoff_s(failures: int) -> float:
    """How long to wait after ``failures`` retriable transaction failures in a row: twice as long each time,
    up to ``MAX_TXN_BACKOFF_S``."""
    return float(min(MAX_TXN_BACKOFF_S, PUBLISH_BACKOFF_S[0] * 2 ** (failures - 1)))


def breaks_the_producer(exc: BaseException) -> bool:
    """Whether an idempotent producer must be replaced before it can send again: a batch the broker refused
    (too large) still took its sequence numbers, so every later batch of that partition is out of order."""
    from aiokafka import errors

    return isinstance(exc, (errors.OutOfOrderSequenceNumber, errors.InvalidProducerEpoch,
                            errors.MessageSizeTooLargeError, errors.RecordListTooLargeError))


def fatal(record: Outgoing | None, exc: BaseException, what: str = "publishing") -> WorkerFatal:
    """The worker-fatal error for ``exc``, naming the topic and the cause."""
    topic = f" to topic {record.topic!r}" if record is not None else ""
    hint = {
        "TopicAuthorizationFailedError": "grant this worker's principal Write (and Describe) on the topic",
        "GroupAuthorizationFailedError": "grant this worker's principal Read on the consumer group (group_id)",
        "TransactionalIdAuthorizationFailed": "grant Write on the transactional ids "
                                              "(transactional_id_prefix), or use delivery=at_least_once",
        "ClusterAuthorizationFailedError": "grant IdempotentWrite on the cluster",
        "MessageSizeTooLargeError": "not even the smallest replacement fits: raise the topic's max.message.bytes",
        "RecordTooLargeError": "not even the smallest replacement fits: raise max_request_size",
    }.get(type(exc).__name__, "see the cause")
    return WorkerFatal(f"{what}{topic} failed and cannot succeed by retrying: {type(exc).__name__}: {exc}; {hint}")


def replaced(record: Outgoing, exc: BaseException) -> Outgoing:
    """The record-fatal path: the smaller record to publish instead of ``record``, or WorkerFatal."""
    if record.replacement is None:
        raise fatal(record, exc) from exc
    log.warning("record refused as too large; publishing its replacement", topic=record.topic,
                error=f"{type(exc).__name__}: {exc}")
    substitute = record.replacement(f"{type(exc).__name__}: {exc}")
    substitute.replacement = None  # a refused replacement is worker-fatal, not replaced again
    return substitute


@dataclass(eq=False, slots=True)
class _Waiting:
    """One ``RecordBatches.send`` call: its records not acknowledged yet, and those that failed."""

    future: asyncio.Future[list[tuple[int, BaseException]]]
    remaining: int
    failed: list[tuple[int, BaseException]] = field(default_factory=list)

    def settle(self, index: int, error: BaseException | None) -> None:
        if error is not None:
            self.failed.append((index, error))
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.failed)


# (record, the call it belongs to, its index in that call's records)
class Publishable(Protocol):
    """What ``RecordBatches`` publishes: an ``Outgoing`` record, or any record with these fields (the
    evaluator's changelog records, whose value None is a deletion)."""

    @property
    def topic(self) -> str: ...

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...

    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...


_Queued = tuple[Publishable, _Waiting, int]


class RecordBatches:
    """Records handed to one aiokafka producer as record batches built here, not one ``send`` per record.

    ``AIOKafkaProducer.send`` costs about 20 µs of the event loop per record (a coroutine, the partitioner,
    the accumulator, a future per record and its callbacks once acknowledged): with a cheap model that was
    the largest single cost of a worker. Here records are partitioned as ``send`` would partition them (the
    producer's partitioner over the topic's partitions), appended to batches with aiokafka's own batch builder
    (``create_batch``, compressed as configured, transactional on a transactional producer) and handed over
    with ``send_batch``: one future per batch, about 5 µs per record.

    aiokafka's sender takes one batch per partition into each produce request, and ``send_batch`` waits until
    the partition's previous batch was taken. So each partition has a queue and one pump: records queue while
    their partition's previous batch waits, and the next batch carries all of them (as ``send`` fills the
    batch that waits). Records without a key, larger than half a batch, or for a topic whose partitions are
    not known yet go through ``send`` one by one, as before; a record marked ``alone`` (refused as too large in
    a batch it shared: the broker judges a whole batch) gets a batch of its own. A failed batch fails each of
    its records with the batch's error; the caller decides what each failure means (``classify``), and may
    retry a record alone.
    """

    def __init__(self, producer: AIOKafkaProducer):
        self.producer = producer
        self._partitioner = getattr(producer, "_partitioner", None)
        # Records over half a batch go alone, through ``send`` (which refuses one over max_request_size itself).
        self._alone_over = getattr(getattr(producer, "_message_accumulator", None), "_batch_size", 16_384) // 2
        self._queues: dict[tuple[str, int], list[_Queued]] = {}
        self._pumps: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, records: Sequence[Publishable]) -> list[tuple[int, BaseException]]:
        """Publish ``records`` and wait until every one is acknowledged or failed; the failures, as (index in
        ``records``, error), in no particular order (empty: all were acknowledged)."""
        from aiokafka.errors import KafkaError

        if not records:
            return []
        loop = asyncio.get_running_loop()
        waiting = _Waiting(loop.create_future(), len(records))
        alone: list[tuple[int, asyncio.Future[RecordMetadata]]] = []
        placement = await self._placement({record.topic for record in records})
        limit = self._alone_over
        for index, record in enumerate(records):
            partitions = placement.get(record.topic)
            if (record.key is None or partitions is None
                    or (len(record.value or b"") + len(record.key) > limit and not getattr(record, "alone", False))):
                try:
                    alone.append((index, await self.producer.send(record.topic, value=record.value, key=record.key,
                                                                  headers=record.headers)))
                except KafkaError as exc:
                    waiting.settle(index, exc)
                continue
            partition = self._partition(record.key, partitions)
            place = (record.topic, partition)
            queue = self._queues.get(place)
            if queue is None:
                queue = self._queues[place] = []
            queue.append((record, waiting, index))
            if place not in self._pumps:
                self._pumps.add(place)
                task = loop.create_task(self._pump(place))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        for index, future in alone:
            future.add_done_callback(partial(_settle_one, waiting, index))
        return await waiting.future

    async def _placement(self, topics: set[str]) -> dict[str, tuple[list[int], list[int]]]:
        """Each topic's partitions and those with a leader now (what the partitioner chooses from); a topic
        whose metadata is not known yet is looked up once, and left out if it still is not."""
        cluster = self.producer.client.cluster
        placement = {}
        for topic in topics:
            every = cluster.partitions_for_topic(topic)
            if not every:
                try:
                    await self.producer.partitions_for(topic)
                except Exception:  # noqa: BLE001 - then its records go one by one, and fail there if they must
                    continue
                every = cluster.partitions_for_topic(topic)
                if not every:
                    continue
            placement[topic] = (list(every), list(cluster.available_partitions_for_topic(topic)))
        return placement

    def _partition(self, key: bytes, partitions: tuple[list[int], list[int]]) -> int:
        every, available = partitions
        if self._partitioner is None or isinstance(self._partitioner, DefaultPartitioner):
            # What DefaultPartitioner does with a key (``murmur2``, without the call in between).
            return every[(murmurhash2(key, KAFKA_MURMUR2_SEED) & 0x7FFFFFFF) % len(every)]
        return int(self._partitioner(key, every, available))

    async def _pump(self, place: tuple[str, int]) -> None:
        """Send whatever queued for one partition, a batch at a time, until its queue is empty."""
        topic, partition = place
        queue = self._queues[place]
        try:
            while queue:
                taken = queue[:]
                queue.clear()
                await self._send_batches(topic, partition, taken)
        finally:
            # Only a cancellation (the worker stopping) leaves records queued: they fail, none waits forever.
            _settle_all(queue, asyncio.CancelledError())
            queue.clear()
            self._pumps.discard(place)
            self._queues.pop(place, None)

    async def _send_batches(self, topic: str, partition: int, taken: list[_Queued]) -> None:
        batches: list[tuple[BatchBuilder, list[_Queued]]] = []
        try:
            builder, members = self.producer.create_batch(), list[_Queued]()
            for queued in taken:
                record = queued[0]
                # Refused in a shared batch before: a batch of its own, in its place in the partition's order.
                alone = getattr(record, "alone", False)
                if alone and members:
                    batches.append((builder, members))
                    builder, members = self.producer.create_batch(), list[_Queued]()
                if builder.append(key=record.key, value=record.value, timestamp=None, headers=record.headers) is None:
                    batches.append((builder, members))
                    builder, members = self.producer.create_batch(), list[_Queued]()
                    builder.append(key=record.key, value=record.value, timestamp=None, headers=record.headers)
                members.append(queued)
                if alone:
                    batches.append((builder, members))
                    builder, members = self.producer.create_batch(), list[_Queued]()
            if members:
                batches.append((builder, members))
        except Exception as exc:  # noqa: BLE001 - nothing was handed over: each record fails, none waits forever
            log.exception("records could not be put in a batch", topic=topic, partition=partition)
            _settle_all(taken, exc)
            return
        except BaseException:
            _settle_all(taken, asyncio.CancelledError())
            raise
        for number, (builder, members) in enumerate(batches):
            builder.close()
            try:
                delivered = await self.producer.send_batch(builder, topic, partition=partition)
            except Exception as exc:  # noqa: BLE001 - this batch and the ones after it fail, each record its own
                for _, rest in batches[number:]:
                    _settle_all(rest, exc)
                return
            delivered.add_done_callback(partial(_settle_batch, members))


KAFKA_MURMUR2_SEED = 0x9747B28C  # the seed of Kafka's Utils.murmur2: MurmurHash2 (32-bit) otherwise as published


def murmur2(key: bytes) -> int:
    """Kafka's murmur2 hash of a record key (``org.apache.kafka.common.utils.Utils.murmur2``), the hash its
    default partitioner places keyed records by: the same value as ``aiokafka.partitioner.murmur2``
    (tests/unit/kafka/test_publishing.py compares them), computed in C by the ``murmurhash2`` package. Partitioning
    answers costs one per answer: aiokafka's, in Python, was a few percent of a worker's time, and a hand-written
    one reading the key a word at a time still 1.3 µs an answer (0.16 µs here)."""
    return murmurhash2(key, KAFKA_MURMUR2_SEED)


def _settle_one(waiting: _Waiting, index: int, future: asyncio.Future[RecordMetadata]) -> None:
    waiting.settle(index, _error_of(future))


def _settle_batch(members: list[_Queued], future: asyncio.Future[RecordMetadata]) -> None:
    _settle_all(members, _error_of(future))


def _settle_all(members: list[_Queued], error: BaseException | None) -> None:
    for _, waiting, index in members:
        waiting.settle(index, error)


def _error_of(future: asyncio.Future[RecordMetadata]) -> BaseException | None:
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception()


def retrieved(future: asyncio.Future) -> None:
    """Mark a future's exception as seen (asyncio otherwise logs it as never retrieved, with a traceback)."""
    if not future.cancelled():
        future.exception()


async def quietly_stop(producer: AIOKafkaProducer) -> None:
    try:
        await producer.stop()
    except Exception as exc:  # noqa: BLE001 - stopping a broken producer must not stop the worker
        log.debug("producer stop failed", error=str(exc))


async def send_with_retries(
    producer: AIOKafkaProducer, record: Outgoing, metrics: Metrics | None = None, enqueue: asyncio.Lock | None = None,
    renew: Callable[[AIOKafkaProducer, bool], Awaitable[AIOKafkaProducer]] | None = None,
) -> Outgoing:
    """Publish and wait for the acknowledgement, retrying retriable errors with backoff through broker
    outages (``PUBLISH_BACKOFF_S``, then ``WorkerFatal``). A record refused as too large is replaced by its
    ``replacement``; worker-fatal errors raise ``WorkerFatal`` at once. With ``enqueue``, records enter the
    producer's buffer one caller at a time (acknowledgements are awaited side by side). With ``renew``, a
    producer an error left unusable is replaced (``renew(producer, broken)`` returns the one to use). Returns the
    record that was published."""
    from aiokafka.errors import KafkaError

    retries = 0
    while True:
        try:
            if enqueue is None:
                await producer.send_and_wait(record.topic, value=record.value, key=record.key, headers=record.headers)
            else:
                async with enqueue:
                    acknowledged = await producer.send(record.topic, value=record.value, key=record.key,
                                                       headers=record.headers)
                await acknowledged
            return record
        except KafkaError as exc:
            kind = classify(exc, transactional=False)
            if renew is not None:
                producer = await renew(producer, breaks_the_producer(exc))
            if kind == "record":
                record = replaced(record, exc)
                continue
            if kind == "worker":
                raise fatal(record, exc) from exc
            if retries == len(PUBLISH_BACKOFF_S):
                raise fatal(record, exc, f"publishing (retried {retries} times over "
                                         f"{sum(PUBLISH_BACKOFF_S):.0f} s)") from exc
            pause = PUBLISH_BACKOFF_S[retries]
            retries += 1
            log.warning("publish failed; retrying", topic=record.topic, attempt=retries, error=str(exc))
            if metrics is not None:
                metrics.count_publish_retry(record.topic)
            await asyncio.sleep(pause)
