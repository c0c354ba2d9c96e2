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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from .events import HEADERS

log = structlog.get_logger(__name__)

PUBLISH_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


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

    async def start(self) -> None:
        self.producer = self._factory(None)
        await self.producer.start()

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def publish(self, record: Outgoing) -> None:
        await send_with_retries(self.producer, record, self.metrics, self._enqueue)

    async def deliver(self, partition: Any, offset: int, records: list[Outgoing], epoch: int | None = None) -> None:
        for record in records:
            await send_with_retries(self.producer, record, self.metrics, self._enqueue)
        self.tracker.done(partition, offset, epoch)

    async def flush(self, partitions: Sequence[Any] | None = None) -> None:
        from aiokafka.errors import KafkaError

        offsets = self.tracker.committable(partitions)
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as exc:  # a rebalance in progress: the next owner starts from the last commit
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
            await asyncio.gather(
                *(self._commit_partition(partition, point)
                  for partition, point in self.tracker.committable(partitions).items())
            )

    async def _commit_partition(self, partition: Any, point: int) -> None:
        from aiokafka.errors import KafkaError, ProducerFenced

        pending = self._pending.get(partition, {})
        ready = sorted(offset for offset in pending if offset < point)
        started = time.perf_counter()
        try:
            producer = await self._producer(partition)
            await producer.begin_transaction()
            try:
                sends: list[asyncio.Future] = []
                try:
                    for offset in ready:
                        for record in pending[offset]:
                            sends.append(
                                await producer.send(record.topic, value=record.value, key=record.key, headers=HEADERS)
                            )
                finally:
                    for sent in sends:  # when one fails (fenced: all of them do) the rest are read here
                        sent.add_done_callback(_retrieved)
                failed = [r for r in await asyncio.gather(*sends, return_exceptions=True) if isinstance(r, BaseException)]
                if failed:
                    raise failed[0]
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
            return
        except KafkaError as exc:
            # A broker restart or timeout: start over with a fresh producer next time; nothing was committed.
            log.warning("transaction failed; will retry", partition=str(partition), error=f"{type(exc).__name__}: {exc}")
            await self._discard(partition)
            return
        for offset in ready:
            pending.pop(offset, None)
        self.tracker.committed({partition: point})
        self._counted_commit()
        log.debug("committed", partition=str(partition), offset=point, answers=len(ready),
                  ms=round((time.perf_counter() - started) * 1e3, 1))

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
    producer: Any, record: Outgoing, metrics: Any = None, enqueue: asyncio.Lock | None = None
) -> None:
    """Publish and wait for the acknowledgement, retrying with backoff through broker outages. With
    ``enqueue``, records enter the producer's buffer one caller at a time (acknowledgements are awaited
    side by side)."""
    from aiokafka.errors import KafkaError

    for attempt, pause in enumerate((*PUBLISH_BACKOFF_S, None)):
        try:
            if enqueue is None:
                await producer.send_and_wait(record.topic, value=record.value, key=record.key, headers=HEADERS)
            else:
                async with enqueue:
                    acknowledged = await producer.send(record.topic, value=record.value, key=record.key,
                                                       headers=HEADERS)
                await acknowledged
            return
        except KafkaError as exc:
            if pause is None:
                raise
            log.warning("publish failed; retrying", topic=record.topic, attempt=attempt + 1, error=str(exc))
            if metrics is not None:
                metrics.count_publish_retry(record.topic)
            await asyncio.sleep(pause)
