"""Commit policies: when a consumed offset is committed, and the delivery modes they make with a sink.

An offset is committed only together with, or after, the answers for it and for every earlier offset of its
partition; the answered offsets beyond it travel in the commit's metadata (``offsets.OffsetTracker``). Two
policies do that:

* ``CommitInTransaction`` (delivery ``exactly_once``, the default): consume-transform-produce in Kafka
  transactions. Answers (and dead letters) wait in memory until the ordering lets them leave (the ``ordering``
  setting: once no earlier request with their key is unanswered, by default); then one transaction publishes
  them and commits the partition's offset with the metadata naming them (``send_offsets_to_transaction``). Readers with ``isolation_level=read_committed`` see each answer exactly
  once, whatever crashes. Each input partition has its own transactional producer whose ``transactional.id``
  is derived from the group, topic and partition, so when a partition moves to another worker (or a restarted
  one), the new owner's producer fences the old one: a zombie's late commit fails instead of duplicating
  answers. (aiokafka has no consumer-group-generation fencing, KIP-447, so partition-scoped ids are the way.)
  Each partition's producer, its waiting answers and its retries are one ``PartitionTransactions`` whose
  ``TxnState`` moves only along a transition table (idle, creating, ready, in a transaction, waiting to retry,
  closed), a part of the partition's ``PartitionWork`` (partitions.py); revocation, fencing and the end close
  it in one place (``_close``).
  Cost: answers become visible at commit time, every ``commit_interval_ms``.
* ``CommitAfterWrite`` (delivery ``at_least_once``, and replays into a file): the sink writes each answer as
  soon as it is ready; an offset is committed once the answers for it and every earlier offset are
  acknowledged (a file: fsynced). After a crash the uncommitted requests are answered again: the duplicate
  carries the same key and the same deterministic ``answer_id``, so downstream can drop it.

A delivery mode is a registered (sink, commit policy) pair (``DELIVERY_MODES``): its entry names the
factories of both, so adding a mode touches only this table (and, for a mode the ``delivery`` setting may
name, its ``DeliveryName`` values in settings/sections.py, which a test keeps in step).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict, Unpack

import structlog
from aiokafka.structs import TopicPartition

from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.partitions import PartitionTransactions, TxnState
from d3stream.kafka.publishing import (
    Outgoing,
    RecordBatches,
    classify,
    fatal,
    quietly_stop,
    replaced,
    retrieved,
    transaction_backoff_s,
)
from d3stream.kafka.sinks import JsonLinesFile, KafkaTopics, Sink
from d3stream.ops.metrics import Metrics

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer, AIOKafkaProducer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Answered:
    """The records to publish for one consumed offset (its answer, maybe a dead letter before it)."""

    partition: TopicPartition
    offset: int
    records: list[Outgoing]
    epoch: int | None = None  # the assignment of the partition the request was read in


class CommitPolicy(Protocol):
    """When consumed offsets are committed, given the answers handed to ``deliver``."""

    # Whether a newly assigned partition must wait for ``assigned`` before it is read (consume.py settles it).
    settles_assignments: bool
    # Whether work this worker still holds for a partition that moved can never reach the answers (the new
    # owner's producer fences ours): a rebalance may then keep what it hands back without draining first
    # (rebalance_keep_partitions). Where it can (at least once), a revocation drains, or the new owner repeats it.
    fences_moved_work: bool
    commits: int
    aborts: int
    # Told of a partition still held whose commits cannot go on from where it was read (its producer was fenced,
    # or its transaction failed and its state went back): the consume loop settles it again.
    on_fenced: Callable[[TopicPartition], None] | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def deliver(self, answered: Sequence[Answered]) -> None:
        """Take the answers of these offsets; they count as done for the tracker once this returns."""
        ...

    async def flush(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        """Commit what can be committed (of ``partitions``, or all): the periodic commit, a revocation, the end."""
        ...

    async def assigned(self, partitions: Sequence[TopicPartition]) -> None: ...

    async def revoked(self, partitions: Sequence[TopicPartition]) -> None: ...


class Common(TypedDict):
    """What every commit policy is made with (``delivery_for``): the consumer whose offsets it commits, the
    tracker of what is answered, the group and the metrics."""

    consumer: AIOKafkaConsumer
    tracker: OffsetTracker
    group_id: str
    metrics: NotRequired[Metrics | None]


class _Counted:
    """What both policies share: whose offsets they commit and what they count."""

    def __init__(self, *, consumer: AIOKafkaConsumer, tracker: OffsetTracker, group_id: str,
                 metrics: Metrics | None = None):
        self.consumer = consumer
        self.tracker = tracker
        self.group_id = group_id
        self.metrics = metrics
        self.commits = 0
        self.aborts = 0
        self.on_fenced: Callable[[TopicPartition], None] | None = None

    def _counted_commit(self, ok: bool = True) -> None:
        if ok:
            self.commits += 1
        if self.metrics is not None:
            self.metrics.count_commit(ok=ok)

    async def _aborted(self, producer: AIOKafkaProducer) -> None:
        """A transaction of ``producer`` failed: counted, and aborted if it is still open (a failure to abort is
        left to the caller, which replaces or closes the producer anyway)."""
        self.aborts += 1
        if self.metrics is not None:
            self.metrics.count_transaction_abort()
        if producer._txn_manager.is_in_transaction():  # noqa: SLF001 - aiokafka has no public check
            try:
                await producer.abort_transaction()
            except Exception:  # noqa: BLE001 - the producer is replaced or closed next
                pass


class CommitAfterWrite(_Counted):
    """The sink writes each answer at once; offsets are committed behind its acknowledgements."""

    settles_assignments = False
    fences_moved_work = False  # an answer finished after its partition moved is published all the same

    def __init__(self, sink: Sink, **kwargs: Unpack[Common]):
        super().__init__(**kwargs)
        self.sink = sink

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def deliver(self, answered: Sequence[Answered]) -> None:
        await self.sink.write([record for item in answered for record in item.records])
        for item in answered:
            self.tracker.done(item.partition, item.offset, item.epoch)

    async def flush(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        from aiokafka.errors import KafkaError

        await self.sink.flush()
        # Every answer handed to deliver is written: the done offsets beyond each point go in its metadata.
        offsets = self.tracker.commit_offsets(partitions)
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

    async def assigned(self, partitions: Sequence[TopicPartition]) -> None:
        return None

    async def revoked(self, partitions: Sequence[TopicPartition]) -> None:
        return None


class _Closed(Exception):  # noqa: N818 - not an error: the step's partition went away meanwhile
    """The partition's transactions were closed (revoked, fenced, stopped) while a step of them waited."""


class CommitInTransaction(_Counted):
    """Answers and offsets of each partition commit together, in transactions fenced per partition (each
    partition's producer, waiting answers and retries in its ``PartitionTransactions``)."""

    # The consume loop holds a newly assigned partition until ``assigned`` returned (the previous owner's
    # last transaction is then complete) and re-reads its committed offset: see consume.py.
    settles_assignments = True
    fences_moved_work = True  # a moved partition's new owner fences its producer here before it reads

    def __init__(self, *, producer_factory: Callable[[TopicPartition], AIOKafkaProducer],
                 **kwargs: Unpack[Common]):
        super().__init__(**kwargs)
        self._factory = producer_factory
        # Each partition's transactions are a part of its work (partitions.py), beside its progress and pauses.
        self._partitions: MutableMapping[TopicPartition, PartitionTransactions] = self.tracker.works.view(
            "transactions")
        self._lock = asyncio.Lock()

    @property
    def producers(self) -> dict[TopicPartition, AIOKafkaProducer]:
        """Each partition's started transactional producer (a partition without one cannot commit yet)."""
        return {partition: txns.producer for partition, txns in self._partitions.items()
                if txns.producer is not None}

    def _transactions(self, partition: TopicPartition) -> PartitionTransactions:
        txns = self._partitions.get(partition)
        if txns is None:
            txns = self._partitions[partition] = PartitionTransactions(partition)
        return txns

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        for txns in list(self._partitions.values()):
            await self._close(txns)

    async def deliver(self, answered: Sequence[Answered]) -> None:
        for item in answered:
            if not self.tracker.owns(item.partition, item.epoch):
                continue  # revoked while this request ran: the new owner answers it, in its own transaction
            self._transactions(item.partition).pending[item.offset] = item.records
            self.tracker.done(item.partition, item.offset, item.epoch)

    async def _producer(self, txns: PartitionTransactions) -> AIOKafkaProducer:
        # One creation per partition even when a flush and the rebalance callback ask at once: a second
        # producer with the same transactional id would fence the first, i.e. this worker itself.
        if txns.state is TxnState.CLOSED:
            raise _Closed
        if txns.creating is None:
            txns.to(TxnState.CREATING)
            txns.creating = asyncio.ensure_future(self._create_producer(txns))
            txns.creating.add_done_callback(retrieved)  # a caller cancelled meanwhile (a bounded revocation) reads none
        return await asyncio.shield(txns.creating)

    async def _create_producer(self, txns: PartitionTransactions) -> AIOKafkaProducer:
        producer = self._factory(txns.partition)
        try:
            await producer.start()  # init_transactions: fences any older producer of this partition
        except BaseException:
            if txns.state is TxnState.CREATING:
                txns.creating = None  # the next caller tries again
                txns.to(TxnState.IDLE)
            raise
        if txns.state is not TxnState.CREATING:  # closed while it started
            await quietly_stop(producer)
            raise _Closed
        txns.producer, txns.batches = producer, RecordBatches(producer)
        txns.to(TxnState.READY)
        return producer

    async def flush(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        async with self._lock:
            # Each partition has its own producer: their transactions commit side by side.
            # Named partitions (a revocation, the shutdown) are tried now; the periodic flush backs off.
            plans = [plan for partition in (self.tracker.committing() if partitions is None else partitions)
                     if (plan := self._plan(partition)) is not None]
            await asyncio.gather(*(self._commit_partition(*plan, now=partitions is not None) for plan in plans))

    def _plan(self, partition: TopicPartition) -> tuple[PartitionTransactions, int, str, list[int]] | None:
        """What the partition's next transaction carries: its commit point, the metadata naming the done offsets
        beyond it whose answers are out after it, and the answered offsets whose answers leave in it (those the
        ordering lets go); None when there is nothing new to commit."""
        if not self.tracker.owns(partition):
            return None
        known = self._partitions.get(partition)
        pending = known.pending if known is not None else {}
        leaving = self.tracker.may_leave(partition, pending.keys())
        held = set(pending).difference(leaving)
        # An answer leaving moves the point past it or adds it to the metadata: it always makes a change.
        changed = self.tracker.commit_offsets([partition], held={partition: held})
        if partition not in changed:
            return None
        point, metadata = changed[partition]
        return self._transactions(partition), point, metadata, leaving

    async def _commit_partition(self, txns: PartitionTransactions, point: int, metadata: str, ready: list[int], *,
                                now: bool = False) -> None:
        """One transaction: the partition's ``ready`` answers and its offset (``point`` and ``metadata``), or what
        its failure means (fenced: the partition moved; refused records: replaced, tried again; retriable: back
        off; else fatal)."""
        from aiokafka.errors import KafkaError, ProducerFenced

        partition = txns.partition
        if txns.state is TxnState.CLOSED:
            return  # revoked since the flush planned it
        if not now and time.monotonic() < txns.retry_at:
            return  # backing off after a failed transaction
        pending = txns.pending
        started = time.perf_counter()
        refused: list[tuple[int, int, BaseException]] = []  # (offset, index, error) of records refused as too large
        try:
            await self._transaction(txns, (point, metadata), [(offset, pending[offset]) for offset in ready], refused)
        except _Closed:
            return  # revoked while it waited for its producer: the new owner commits it
        except ProducerFenced:
            # Expected for a previous owner after a rebalance: its uncommitted answers are the new owner's to give.
            log.info("fenced: another worker owns this partition now", partition=str(partition))
            await self._close(txns)
            self.tracker.forget([partition])
            if self.on_fenced is not None:
                self.on_fenced(partition)
            return
        except KafkaError as exc:
            producer = txns.drop_producer()  # a fresh producer next time; nothing was committed
            worker = not refused and classify(exc, transactional=True) == "worker"
            if not refused and not worker:  # retriable: decided before the await below lets another step in
                self._back_off(txns, exc, next((r.topic for o in ready for r in pending[o]), partition.topic))
            if producer is not None:
                await quietly_stop(producer)
            if refused:
                # Record-fatal: those records are replaced by smaller ones, and the transaction is tried again
                # at the next flush, without backoff (what it holds changed).
                for offset, index, error in refused:
                    record = pending[offset][index]
                    if record.alone:
                        pending[offset][index] = replaced(record, error)
                    else:  # refused in a shared batch (the broker judges a whole batch): tried alone first
                        record.alone = True
            elif worker:
                topics = sorted({record.topic for offset in ready for record in pending[offset]})
                raise fatal(None, exc, f"the transaction of partition {partition} (topics {topics})") from exc
            return
        txns.failures, txns.retry_at = 0, 0.0
        for offset in ready:
            pending.pop(offset, None)
        self.tracker.committed({partition: (point, metadata)})
        self._counted_commit()
        log.debug("committed", partition=str(partition), offset=point, answers=len(ready),
                  ms=round((time.perf_counter() - started) * 1e3, 1))

    async def _transaction(self, txns: PartitionTransactions, point: tuple[int, str],
                           ready: list[tuple[int, list[Outgoing]]], refused: list[tuple[int, int, BaseException]]) -> None:
        """Publish ``ready``'s records and commit ``point`` (offset and metadata) in one transaction; aborted on any
        failure, with the records refused as too large noted in ``refused`` (and the first of them raised)."""
        producer = await self._producer(txns)
        batches = txns.batches
        if txns.state is TxnState.CLOSED or batches is None:
            raise _Closed  # closed once its producer had started
        await producer.begin_transaction()
        txns.after(TxnState.IN_TRANSACTION)
        try:
            flat = [(offset, index, record) for offset, records in ready for index, record in enumerate(records)]
            failures = await batches.send([record for *_, record in flat])
            for position, error in sorted(failures, key=lambda failure: failure[0]):
                if classify(error, transactional=True) != "record":
                    raise error
                offset, index, _ = flat[position]
                refused.append((offset, index, error))
            if refused:
                raise refused[0][2]
            await producer.send_offsets_to_transaction({txns.partition: point}, self.group_id)
            await producer.commit_transaction()
        except BaseException:
            await self._aborted(producer)
            raise
        finally:
            txns.after(TxnState.READY)  # committed or aborted: no transaction open

    def _back_off(self, txns: PartitionTransactions, exc: BaseException, topic: str) -> None:
        """A retriable failure: the partition's next transaction waits, twice as long each time (bounded)."""
        txns.failures += 1
        delay = transaction_backoff_s(txns.failures)
        txns.retry_at = time.monotonic() + delay
        txns.after(TxnState.RETRY_WAIT)
        if self.metrics is not None:
            self.metrics.count_publish_retry(topic)
        log.warning("transaction failed; will retry", partition=str(txns.partition), attempt=txns.failures,
                    retry_in_s=round(delay, 1), error=f"{type(exc).__name__}: {exc}")

    async def _close(self, txns: PartitionTransactions) -> None:
        """The one cleanup of a partition's transactions (revoked, fenced, stopped): forgotten here, closed, its
        producer stopped."""
        if self._partitions.get(txns.partition) is txns:
            del self._partitions[txns.partition]
        producer = txns.close()
        if producer is not None:
            await quietly_stop(producer)

    async def assigned(self, partitions: Sequence[TopicPartition]) -> None:
        for partition in partitions:
            try:
                await self._producer(self._transactions(partition))
            except _Closed:
                pass  # revoked while its producer started
            except Exception as exc:  # noqa: BLE001 - retried lazily at the first commit
                log.warning("transactional producer not ready", partition=str(partition), error=str(exc))

    async def revoked(self, partitions: Sequence[TopicPartition]) -> None:
        # Under the lock: a producer stopped in the middle of a commit's transaction leaves that commit waiting
        # for ever, and with it every later one (the lock stays taken).
        async with self._lock:
            for partition in partitions:
                txns = self._partitions.get(partition)
                if txns is not None:
                    await self._close(txns)


# ---------------------------------------------------------------------------------------- the modes


def kafka_topics(mode: str, kafka: Callable[[], KafkaTopics], file: Path | None) -> Sink:
    """A mode's sink: the answer, dead-letter and provenance topics."""
    return kafka()


def answer_file(mode: str, kafka: Callable[[], KafkaTopics], file: Path | None) -> Sink:
    """A mode's sink: a JSON-lines file the caller names (replay --out)."""
    if file is None:
        raise ValueError(f"delivery {mode} writes answers to a file: name it (replay --out)")
    return JsonLinesFile(file)


def commit_after_write(mode: str, sink: Sink, common: Common) -> CommitPolicy:
    """A mode's commit policy: offsets behind the sink's acknowledgements."""
    return CommitAfterWrite(sink, **common)


def commit_in_transaction(mode: str, sink: Sink, common: Common) -> CommitPolicy:
    """A mode's commit policy: offsets in the answers' Kafka transaction (its sink must be Kafka topics)."""
    if not isinstance(sink, KafkaTopics):
        raise ValueError(f"delivery {mode} commits in Kafka transactions: its answers must go to a topic")
    return CommitInTransaction(producer_factory=sink.new_producer, **common)


# What makes a mode's sink (from the mode's name, a maker of Kafka topics and the caller's answer file), and
# its commit policy (from the mode's name, the sink and the consumer, tracker, group and metrics).
SinkFactory = Callable[[str, Callable[[], KafkaTopics], Path | None], Sink]
PolicyFactory = Callable[[str, Sink, Common], CommitPolicy]


@dataclass(frozen=True)
class DeliveryMode:
    """A sink and a commit policy that together keep one promise (the ``delivery`` setting names one).

    The entry is the whole definition of the mode: ``sink_for`` and ``delivery_for`` call its factories, and
    what others ask of a mode (its sink is Kafka's, it commits in transactions) is read off them."""

    name: str
    promise: str
    sink: SinkFactory
    policy: PolicyFactory

    @property
    def kafka_sink(self) -> bool:
        """Answers go to the answer topic (else to a file named by the caller)."""
        return self.sink is kafka_topics

    @property
    def transactional(self) -> bool:
        """Offsets commit in the answers' transaction: no answer is ever duplicated (what chaos holds it to)."""
        return self.policy is commit_in_transaction


DELIVERY_MODES: dict[str, DeliveryMode] = {
    mode.name: mode
    for mode in (
        DeliveryMode("exactly_once", "answers and offsets commit in one Kafka transaction", kafka_topics,
                     commit_in_transaction),
        DeliveryMode("at_least_once", "answers published at once, offsets committed behind the acknowledgements",
                     kafka_topics, commit_after_write),
        DeliveryMode("jsonl_file", "answers appended to a JSON-lines file, offsets committed after each fsync",
                     answer_file, commit_after_write),
    )
}


def delivery_for(mode: DeliveryMode, *, sink: Sink, consumer: AIOKafkaConsumer, tracker: OffsetTracker, group_id: str,
                 metrics: Metrics | None) -> CommitPolicy:
    """The commit policy of ``mode`` over ``sink`` (a transactional mode needs Kafka topics to write to)."""
    common: Common = {"consumer": consumer, "tracker": tracker, "group_id": group_id, "metrics": metrics}
    return mode.policy(mode.name, sink, common)


def sink_for(mode: DeliveryMode, *, kafka: Callable[[], KafkaTopics], file: Path | None = None) -> Sink:
    """The sink of ``mode``: Kafka topics made by ``kafka``, or the answer ``file``."""
    return mode.sink(mode.name, kafka, file)
