"""Delivery: how answers reach the answer topic and how consumed offsets are committed.

Two modes, one interface (``deliver`` an answer for an offset, ``flush`` what can be committed):

* ``exactly_once`` (default): consume-transform-produce in Kafka transactions. Answers (and dead
  letters) wait in memory until every earlier offset of their partition is answered too; then one
  transaction publishes them and commits the partition's offset (``send_offsets_to_transaction``).
  Readers with ``isolation_level=read_committed`` see each answer exactly once, whatever crashes. Each
  input partition has its own transactional producer whose ``transactional.id`` is derived from the
  group, topic and partition, so when a partition moves to another worker (or a restarted one), the new
  owner's producer fences the old one: a zombie's late commit fails instead of duplicating answers.
  (aiokafka has no consumer-group-generation fencing, KIP-447, so partition-scoped ids are the way.)
  Cost: answers become visible at commit time, every ``commit_interval_ms``.
* ``at_least_once``: an idempotent producer publishes each answer as soon as it is ready; an offset is
  committed once the answers for it and every earlier offset are acknowledged. After a crash the
  uncommitted requests are answered again: the duplicate carries the same key and the same
  deterministic ``answer_id``, so downstream can drop it.

Publish and commit errors fall in three classes (``classify``), in both modes:

* *retriable* (a broker restart, a leader election, a timeout): retried with bounded backoff and counted
  (``d3stream_publish_retries``); at_least_once gives up after ``PUBLISH_BACKOFF_S`` and the worker exits
  non-zero, exactly_once retries the partition's transaction with backoff up to ``MAX_TXN_BACKOFF_S``.
* *record-fatal* (the broker or the producer refuses one record as too large): that record is replaced
  by its ``Outgoing.replacement`` (an answer becomes an ``answer_too_large`` error answer under the same
  id, a dead letter loses its raw bytes) and the replacement is published instead.
* *worker-fatal* (no permission, a fenced idempotent producer, a topic that does not exist, a record
  whose replacement is refused too): ``WorkerFatal`` naming the topic and the cause; the service stops
  without committing past the record and exits non-zero.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from .events import HEADERS
from .limits import WorkerFatal

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


@dataclass
class _Progress:
    entries: deque = field(default_factory=deque)  # [offset, done] in offset order
    index: dict[int, list] = field(default_factory=dict)
    last: int = -1
    committed: int | None = None
    epoch: int = 0  # which assignment of the partition this progress belongs to
    first: int | None = None  # the first offset read in this assignment (where the group's commit stood)
    moved_at: float = 0.0  # monotonic time the commit point last moved, or work arrived after none waited
    added_at: dict[int, float] = field(default_factory=dict)  # offset -> when it was read, while unanswered

    def waiting(self) -> bool:
        """Whether work of this partition is not committed yet (unanswered, or answered but uncommitted)."""
        return bool(self.entries) or (self.last >= 0 and self.committed != self.last + 1)


class OffsetTracker:
    """Per partition: which offsets are in flight, and the first offset not yet answered."""

    def __init__(self) -> None:
        self._partitions: dict[Any, _Progress] = {}
        self._epochs = 0

    def add(self, partition: Any, offset: int) -> int:
        """Track an offset read from ``partition``; returns the assignment epoch its work belongs to."""
        progress = self._partitions.get(partition)
        if progress is None:
            self._epochs += 1
            progress = self._partitions[partition] = _Progress(epoch=self._epochs)
        now = time.monotonic()
        if not progress.waiting():
            progress.moved_at = now  # a stall is counted from when work arrived
        if progress.first is None:
            progress.first = offset
        progress.added_at[offset] = now
        entry = [offset, False]
        progress.entries.append(entry)
        progress.index[offset] = entry
        progress.last = max(progress.last, offset)
        return progress.epoch

    def owns(self, partition: Any, epoch: int | None = None) -> bool:
        """Whether the partition is (still) assigned, and with ``epoch``, in that same assignment: work
        begun before a revocation must not be committed after the partition comes back."""
        progress = self._partitions.get(partition)
        return progress is not None and (epoch is None or progress.epoch == epoch)

    def done(self, partition: Any, offset: int, epoch: int | None = None) -> None:
        if not self.owns(partition, epoch):
            return  # revoked meanwhile: not ours to commit any more
        progress = self._partitions[partition]
        entry = progress.index.pop(offset, None)
        if entry is None:
            return
        progress.added_at.pop(offset, None)
        entry[1] = True
        while progress.entries and progress.entries[0][1]:
            progress.entries.popleft()

    def in_flight(self, partitions: Sequence[Any] | None = None) -> int:
        chosen = self._partitions if partitions is None else {p: self._partitions.get(p) for p in partitions}
        return sum(len(p.index) for p in chosen.values() if p is not None)

    def committable(self, partitions: Sequence[Any] | None = None) -> dict[Any, int]:
        """Next offset to read, per partition whose commit point moved since the last commit."""
        result = {}
        for partition, progress in self._partitions.items():
            if partitions is not None and partition not in partitions:
                continue
            point = progress.entries[0][0] if progress.entries else progress.last + 1
            if point > 0 and point != progress.committed:
                result[partition] = point
        return result

    def committed(self, offsets: dict[Any, int]) -> None:
        now = time.monotonic()
        for partition, offset in offsets.items():
            if partition in self._partitions:
                self._partitions[partition].committed = offset
                self._partitions[partition].moved_at = now

    def commit_base(self, partition: Any) -> int | None:
        """The partition's committed offset as far as this worker knows: its last commit, else where it began
        reading in this assignment (None: nothing read yet)."""
        progress = self._partitions.get(partition)
        if progress is None:
            return None
        return progress.committed if progress.committed is not None else progress.first

    def stall(self, partition: Any, now: float | None = None) -> tuple[float, float]:
        """(age of the oldest unanswered request, seconds the commit point has not moved while work waited)."""
        progress = self._partitions.get(partition)
        if progress is None or not progress.waiting():
            return 0.0, 0.0
        now = time.monotonic() if now is None else now
        oldest = now - min(progress.added_at.values()) if progress.added_at else 0.0
        return oldest, now - progress.moved_at

    def forget(self, partitions: Sequence[Any]) -> None:
        for partition in partitions:
            self._partitions.pop(partition, None)

    def partitions(self) -> list[Any]:
        return list(self._partitions)


@dataclass
class Outgoing:
    """A record to publish because of one consumed offset (its answer, maybe a dead letter)."""

    topic: str
    key: bytes | None
    value: bytes
    # content-type and d3stream-schema, and the request headers an answer carries back (tracing.py).
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS, repr=False)
    # What to publish instead when this record is refused as too large (the refusal's text as argument);
    # None: nothing smaller exists, and a refusal is worker-fatal.
    replacement: Callable[[str], Outgoing] | None = field(default=None, repr=False, compare=False)


def replaced(record: Outgoing, exc: BaseException) -> Outgoing:
    """The record-fatal path: the smaller record to publish instead of ``record``, or WorkerFatal."""
    if record.replacement is None:
        raise fatal(record, exc) from exc
    log.warning("record refused as too large; publishing its replacement", topic=record.topic,
                error=f"{type(exc).__name__}: {exc}")
    substitute = record.replacement(f"{type(exc).__name__}: {exc}")
    substitute.replacement = None  # a refused replacement is worker-fatal, not replaced again
    return substitute


class _Delivery:
    """What both modes share: where producers come from, whose offsets they commit, what they count."""

    def __init__(
        self, *, producer_factory: Any, consumer: Any, tracker: OffsetTracker, group_id: str, metrics: Any = None
    ):
        self._factory = producer_factory
        self.consumer = consumer
        self.tracker = tracker
        self.group_id = group_id
        self.metrics = metrics
        self.commits = 0
        self.aborts = 0

    def _counted_commit(self, ok: bool = True) -> None:
        if ok:
            self.commits += 1
        if self.metrics is not None:
            self.metrics.count_commit(ok=ok)


class AtLeastOnce(_Delivery):
    """Publish each answer at once (idempotent producer); commit offsets behind the acknowledgements."""

    mode = "at_least_once"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.producer: Any = None
        # Hands records to the producer one caller at a time. With thousands of requests answering at
        # once, each waiting in aiokafka's accumulator for room would be woken on every drain (measured:
        # 30 wake-ups per record, 5x slower); queued here, only the head of the line waits there.
        self._enqueue = asyncio.Lock()
        self._renewing = asyncio.Lock()

    async def start(self) -> None:
        self.producer = self._factory(None)
        await self.producer.start()

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def publish(self, record: Outgoing) -> None:
        await send_with_retries(self.producer, record, self.metrics, self._enqueue, renew=self._renew)

    async def deliver(self, partition: Any, offset: int, records: list[Outgoing], epoch: int | None = None) -> None:
        for record in records:
            await send_with_retries(self.producer, record, self.metrics, self._enqueue, renew=self._renew)
        self.tracker.done(partition, offset, epoch)

    async def _renew(self, failed: Any, broken: bool) -> Any:
        """The producer to send with after ``failed`` failed: with ``broken``, a fresh idempotent producer
        (new producer id, sequences from zero) in its place, which callers that saw the same failure share;
        else the current one (which a caller of the old one needs after a replacement)."""
        async with self._renewing:
            if broken and self.producer is failed:
                log.warning("replacing the producer (its sequence numbers are out of step with the broker)")
                fresh = self._factory(None)
                await fresh.start()
                self.producer = fresh
                asyncio.ensure_future(_quietly_stop(failed))  # its remaining sends fail and are retried
            return self.producer

    async def flush(self, partitions: Sequence[Any] | None = None) -> None:
        from aiokafka.errors import KafkaError

        offsets = self.tracker.committable(partitions)
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:  # a rebalance in progress: the next owner starts from the last commit
            if classify(exc, transactional=False) == "worker":
                raise fatal(None, exc, f"committing offsets of group {self.group_id!r}") from exc
            log.warning("commit failed", error=f"{type(exc).__name__}: {exc}")
            self._counted_commit(ok=False)
            return
        self.tracker.committed(offsets)
        self._counted_commit()

    async def assigned(self, partitions: Sequence[Any]) -> None:
        return None

    async def revoked(self, partitions: Sequence[Any]) -> None:
        return None


class ExactlyOnce(_Delivery):
    """Answers and offsets of each partition commit together, in transactions fenced per partition."""

    mode = "exactly_once"
    # The service holds a newly assigned partition until ``assigned`` returned (the previous owner's
    # last transaction is then complete) and re-reads its committed offset: see service.py.
    settles_assignments = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._producers: dict[Any, Any] = {}
        self._pending: dict[Any, dict[int, list[Outgoing]]] = {}
        self._plain: Any = None  # for records outside any partition's transaction (provenance)
        self._lock = asyncio.Lock()
        self._creating: dict[Any, asyncio.Future] = {}
        # Retriable transaction failures in a row, and when the partition's next attempt may start.
        self._failures: dict[Any, int] = {}
        self._retry_at: dict[Any, float] = {}

    async def start(self) -> None:
        self._plain = self._factory(None)
        await self._plain.start()

    async def stop(self) -> None:
        for producer in list(self._producers.values()):
            await _quietly_stop(producer)
        self._producers.clear()
        if self._plain is not None:
            await self._plain.stop()

    async def publish(self, record: Outgoing) -> None:
        await send_with_retries(self._plain, record, self.metrics)

    async def deliver(self, partition: Any, offset: int, records: list[Outgoing], epoch: int | None = None) -> None:
        if not self.tracker.owns(partition, epoch):
            return  # revoked while this request ran: the new owner answers it, in its own transaction
        self._pending.setdefault(partition, {})[offset] = records
        self.tracker.done(partition, offset, epoch)

    async def _producer(self, partition: Any) -> Any:
        # One creation per partition even when a flush and the rebalance callback ask at once: a second
        # producer with the same transactional id would fence the first, i.e. this worker itself.
        creating = self._creating.get(partition)
        if creating is None:
            creating = self._creating[partition] = asyncio.ensure_future(self._create_producer(partition))
            creating.add_done_callback(_retrieved)  # a caller cancelled meanwhile (a bounded revocation) reads none
        try:
            return await asyncio.shield(creating)
        except BaseException:
            if self._creating.get(partition) is creating and creating.done():
                self._creating.pop(partition, None)
            raise

    async def _create_producer(self, partition: Any) -> Any:
        producer = self._factory(partition)
        await producer.start()  # init_transactions: fences any older producer of this partition
        self._producers[partition] = producer
        return producer

    async def flush(self, partitions: Sequence[Any] | None = None) -> None:
        async with self._lock:
            # Each partition has its own producer: their transactions commit side by side.
            # Named partitions (a revocation, the shutdown) are tried now; the periodic flush backs off.
            await asyncio.gather(
                *(self._commit_partition(partition, point, now=partitions is not None)
                  for partition, point in self.tracker.committable(partitions).items())
            )

    async def _commit_partition(self, partition: Any, point: int, *, now: bool = False) -> None:
        from aiokafka.errors import KafkaError, ProducerFenced

        if not now and time.monotonic() < self._retry_at.get(partition, 0.0):
            return  # backing off after a failed transaction
        pending = self._pending.get(partition, {})
        ready = sorted(offset for offset in pending if offset < point)
        started = time.perf_counter()
        refused: list[tuple[int, int, BaseException]] = []  # (offset, index, error) of records refused as too large
        try:
            producer = await self._producer(partition)
            await producer.begin_transaction()
            try:
                sends = []
                try:
                    for offset in ready:
                        for index, record in enumerate(pending[offset]):
                            sends.append((offset, index, await self._send(producer, record, offset, index, refused)))
                finally:
                    for *_, sent in sends:  # when one fails (fenced: all of them do) the rest are read here
                        if sent is not None:
                            sent.add_done_callback(_retrieved)
                results = await asyncio.gather(*(send for *_, send in sends if send is not None),
                                               return_exceptions=True)
                for (offset, index, _), result in zip((s for s in sends if s[2] is not None), results, strict=True):
                    if isinstance(result, BaseException):
                        if classify(result, transactional=True) != "record":
                            raise result
                        refused.append((offset, index, result))
                if refused:
                    raise refused[0][2]
                await producer.send_offsets_to_transaction({partition: point}, self.group_id)
                await producer.commit_transaction()
            except BaseException:
                self.aborts += 1
                if self.metrics is not None:
                    self.metrics.count_transaction_abort()
                if producer._txn_manager.is_in_transaction():  # noqa: SLF001 - aiokafka has no public check
                    try:
                        await producer.abort_transaction()
                    except Exception:  # noqa: BLE001 - the producer is replaced below anyway
                        pass
                raise
        except ProducerFenced:
            # Expected for a previous owner after a rebalance: its uncommitted answers are the new owner's to give.
            log.info("fenced: another worker owns this partition now", partition=str(partition))
            await self._discard(partition)
            self.tracker.forget([partition])
            self._pending.pop(partition, None)
            self._failures.pop(partition, None)
            self._retry_at.pop(partition, None)
            return
        except KafkaError as exc:
            await self._discard(partition)  # a fresh producer next time; nothing was committed
            if refused:
                # Record-fatal: those records are replaced by smaller ones, and the transaction is tried again
                # at the next flush, without backoff (what it holds changed).
                for offset, index, error in refused:
                    pending[offset][index] = replaced(pending[offset][index], error)
                return
            if classify(exc, transactional=True) == "worker":
                topics = sorted({record.topic for offset in ready for record in pending[offset]})
                raise fatal(None, exc, f"the transaction of partition {partition} (topics {topics})") from exc
            self._back_off(partition, exc, next((r.topic for o in ready for r in pending[o]), partition.topic))
            return
        self._failures.pop(partition, None)
        self._retry_at.pop(partition, None)
        for offset in ready:
            pending.pop(offset, None)
        self.tracker.committed({partition: point})
        self._counted_commit()
        log.debug("committed", partition=str(partition), offset=point, answers=len(ready),
                  ms=round((time.perf_counter() - started) * 1e3, 1))

    @staticmethod
    async def _send(producer: Any, record: Outgoing, offset: int, index: int,
                    refused: list[tuple[int, int, BaseException]]) -> Any:
        """Enqueue one record; a record the producer refuses itself (over max_request_size) is noted in
        ``refused`` (None returned) instead of ending the loop, so every refused record is replaced at once."""
        from aiokafka.errors import KafkaError

        try:
            return await producer.send(record.topic, value=record.value, key=record.key, headers=record.headers)
        except KafkaError as exc:
            if classify(exc, transactional=True) != "record":
                raise
            refused.append((offset, index, exc))
            return None

    def _back_off(self, partition: Any, exc: BaseException, topic: str) -> None:
        """A retriable failure: the partition's next transaction waits, twice as long each time (bounded)."""
        failures = self._failures[partition] = self._failures.get(partition, 0) + 1
        delay = min(MAX_TXN_BACKOFF_S, PUBLISH_BACKOFF_S[0] * 2 ** (failures - 1))
        self._retry_at[partition] = time.monotonic() + delay
        if self.metrics is not None:
            self.metrics.count_publish_retry(topic)
        log.warning("transaction failed; will retry", partition=str(partition), attempt=failures,
                    retry_in_s=round(delay, 1), error=f"{type(exc).__name__}: {exc}")

    async def _discard(self, partition: Any) -> None:
        self._creating.pop(partition, None)
        producer = self._producers.pop(partition, None)
        if producer is not None:
            await _quietly_stop(producer)

    async def assigned(self, partitions: Sequence[Any]) -> None:
        for partition in partitions:
            try:
                await self._producer(partition)
            except Exception as exc:  # noqa: BLE001 - retried lazily at the first commit
                log.warning("transactional producer not ready", partition=str(partition), error=str(exc))

    async def revoked(self, partitions: Sequence[Any]) -> None:
        for partition in partitions:
            self._pending.pop(partition, None)
            await self._discard(partition)


def _retrieved(future: asyncio.Future) -> None:
    """Mark a future's exception as seen (asyncio otherwise logs it as never retrieved, with a traceback)."""
    if not future.cancelled():
        future.exception()


async def _quietly_stop(producer: Any) -> None:
    try:
        await producer.stop()
    except Exception as exc:  # noqa: BLE001 - stopping a broken producer must not stop the worker
        log.debug("producer stop failed", error=str(exc))


async def send_with_retries(
    producer: Any, record: Outgoing, metrics: Any = None, enqueue: asyncio.Lock | None = None,
    renew: Callable[[Any, bool], Awaitable[Any]] | None = None,
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
