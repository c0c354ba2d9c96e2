"""What this worker keeps for one assigned partition, in one object: ``PartitionWork``.

A partition's progress (``Progress``: which offsets are read, answered and committed, in which assignment), why
it is paused and its settling (``PartitionState``: a set of ``PauseReason``), and under exactly_once its
transactions (``PartitionTransactions``: its producer, the answers waiting for its next transaction, its
retries, moved along ``TxnState`` by a transition table) are the parts of one ``PartitionWork``. The offset
tracker (offsets.py), the assignment (assignment.py) and the transactional commit policy (commits.py) each
read and change their part, and keep it nowhere else: they share one ``Partitions`` registry (the tracker's),
and each sees it as a mapping of its own part (``Partitions.view``). So a partition's state is in one place,
``Partitions.end`` is where what is left of a revoked partition goes, and a partition kept through a rebalance
keeps its one object. (Quix Streams' ``StreamPartition`` and aiokafka's ``TopicPartitionState`` are the
models.)
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import ItemsView, Iterator, MutableMapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from aiokafka.structs import TopicPartition

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer, AIOKafkaProducer
    from d3stream.kafka.publishing import Outgoing, RecordBatches


@dataclass
class Progress:
    """What is read, answered and committed of one partition in one assignment (offsets.OffsetTracker)."""

    read: deque[int] = field(default_factory=deque)  # offsets in read order, from the first unanswered one on
    unanswered: dict[int, float] = field(default_factory=dict)  # offset -> when it was read (monotonic)
    keys: dict[int, bytes | None] = field(default_factory=dict)  # offset in ``read`` -> its record's key
    inherited: set[int] = field(default_factory=set)  # done by an earlier owner (its commit's metadata)
    last: int = -1
    committed: int | None = None
    committed_metadata: str = ""
    found: tuple[int, str] | None = None  # the group's commit as found on assignment (point, metadata)
    epoch: int = 0  # which assignment of the partition this progress belongs to
    first: int | None = None  # the first offset read in this assignment (where the group's commit stood)
    moved_at: float = 0.0  # monotonic time the commit point last moved, or work arrived after none waited
    # Revoked, and still held until the next assignment says whether it stays (consume.py): the periodic commit
    # leaves it out meanwhile; a commit that names it still commits.
    held: bool = False

    def waiting(self) -> bool:
        """Whether work of this partition is not committed yet (unanswered, or answered but uncommitted)."""
        return bool(self.unanswered) or (self.last >= 0 and self.committed != self.last + 1)

    def point(self) -> int:
        return self.read[0] if self.read else self.last + 1



class PauseReason(enum.Enum):
    """Why a partition is not read now."""

    BACKPRESSURE = "backpressure"  # it holds its share of the work in flight, which is at a limit
    QUOTA = "quota"  # a request of it waits for its tenant's quota (quotas.py)
    WINDOW = "window"  # read as far past its commit point as a commit's metadata can name (offsets.py)
    SETTLING = "settling"  # newly assigned, not yet read from its stable committed offset


@dataclass(eq=False)
class PartitionState:
    """One assigned partition: why it is paused (it is read while no reason holds) and its settling."""

    partition: TopicPartition
    consumer: AIOKafkaConsumer
    reasons: set[PauseReason] = field(default_factory=set)
    settling: asyncio.Task[None] | None = None  # positioning it at its stable committed offset
    skipped: int | None = None  # the first offset of a record fetched while settling (read again once settled)

    def pause(self, reason: PauseReason) -> bool:
        """Hold the partition for ``reason`` (paused in the consumer on its first reason); whether it is new."""
        if reason in self.reasons:
            return False
        if not self.reasons:
            self.consumer.pause(self.partition)
        self.reasons.add(reason)
        return True

    def resume(self, reason: PauseReason) -> bool:
        """Let ``reason`` go (resumed in the consumer once no reason is left); whether it held the partition."""
        if reason not in self.reasons:
            return False
        self.reasons.discard(reason)
        if not self.reasons and self.partition in self.consumer.assignment():
            self.consumer.resume(self.partition)
        return True



class TxnState(enum.Enum):
    """Where one input partition's transactions stand (``PartitionTransactions``)."""

    IDLE = "idle"  # no producer: none made yet, or the last one dropped after a failed transaction
    CREATING = "creating"  # its producer is starting (init_transactions: fences any older one of the partition)
    READY = "ready"  # a started producer, no transaction open
    IN_TRANSACTION = "in_transaction"  # a transaction is open: records sent, the offset and the commit to come
    RETRY_WAIT = "retry_wait"  # a retriable failure: no producer, the next periodic attempt waits for retry_at
    CLOSED = "closed"  # revoked, fenced or stopped: its producer stopped, its answers dropped; never reopened


# The moves a partition's transactions may make; any other raises (as aiokafka's own TransactionState does).
_TRANSITIONS: dict[TxnState, frozenset[TxnState]] = {
    TxnState.IDLE: frozenset({TxnState.CREATING, TxnState.RETRY_WAIT, TxnState.CLOSED}),
    TxnState.CREATING: frozenset({TxnState.READY, TxnState.IDLE, TxnState.CLOSED}),
    TxnState.READY: frozenset({TxnState.IN_TRANSACTION, TxnState.IDLE, TxnState.CLOSED}),
    TxnState.IN_TRANSACTION: frozenset({TxnState.READY, TxnState.CLOSED}),
    TxnState.RETRY_WAIT: frozenset({TxnState.CREATING, TxnState.CLOSED}),
    TxnState.CLOSED: frozenset(),
}


class IllegalTxnTransition(RuntimeError):
    """A partition's transactions were asked to move where ``_TRANSITIONS`` does not lead: a bug here."""


@dataclass(eq=False)
class PartitionTransactions:
    """One input partition's transactional producer, the answers waiting for its next transaction and its
    retries, with where they stand (``state``, moved by ``to`` along ``_TRANSITIONS`` only)."""

    partition: TopicPartition
    state: TxnState = TxnState.IDLE
    producer: AIOKafkaProducer | None = None
    batches: RecordBatches | None = None  # its producer's, made with it
    creating: asyncio.Future[AIOKafkaProducer] | None = None  # the producer's start, shared by every caller meanwhile
    pending: dict[int, list[Outgoing]] = field(default_factory=dict)  # answered offset -> records waiting
    failures: int = 0  # retriable transaction failures in a row
    retry_at: float = 0.0  # monotonic time the next periodic attempt may start

    def to(self, state: TxnState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise IllegalTxnTransition(f"transactions of {self.partition}: {self.state.value} -> {state.value}")
        self.state = state

    def after(self, state: TxnState) -> None:
        """``to``, at the end of a step that waited: closed meanwhile, they stay closed."""
        if self.state is not TxnState.CLOSED:
            self.to(state)

    def drop_producer(self) -> AIOKafkaProducer | None:
        """Let the producer go after a failed transaction (a fresh one is made for the next); returns it, for
        the caller to stop."""
        producer, self.producer, self.batches, self.creating = self.producer, None, None, None
        if self.state in (TxnState.CREATING, TxnState.READY):
            self.to(TxnState.IDLE)
        return producer

    def close(self) -> AIOKafkaProducer | None:
        """Closed for good: the waiting answers are dropped (the partition's next owner answers them); returns
        the producer, for the caller to stop (None: none, or closed already)."""
        if self.state is TxnState.CLOSED:
            return None
        producer, self.producer, self.batches, self.creating = self.producer, None, None, None
        self.pending = {}
        self.to(TxnState.CLOSED)
        return producer


@dataclass(eq=False)
class PartitionWork:
    """One partition's parts (each None until its owner makes it, and again once its owner lets it go)."""

    partition: TopicPartition
    progress: Progress | None = None  # offsets.OffsetTracker's
    pauses: PartitionState | None = None  # assignment.Assignment's
    transactions: PartitionTransactions | None = None  # commits.CommitInTransaction's

    @property
    def empty(self) -> bool:
        return self.progress is None and self.pauses is None and self.transactions is None


Part = Literal["progress", "pauses", "transactions"]
T = TypeVar("T")


class Partitions:
    """Every partition's ``PartitionWork``: made when a part of it is first set, gone when its last part is."""

    def __init__(self) -> None:
        self._works: dict[TopicPartition, PartitionWork] = {}

    def get(self, partition: TopicPartition) -> PartitionWork | None:
        return self._works.get(partition)

    def view(self, part: Part) -> PartView:
        """The partitions that have ``part``, as a mapping from partition to that part."""
        return PartView(self._works, part)

    def end(self, partition: TopicPartition) -> None:
        """What is left of a partition this worker let go: its progress and pause state (its transactions are
        closed by the commit policy first, which stops their producer)."""
        work = self._works.pop(partition, None)
        if work is not None and work.pauses is not None and work.pauses.settling is not None:
            work.pauses.settling.cancel()


class PartView(MutableMapping[TopicPartition, T], Generic[T]):
    """One part of every partition's work, as a dict of it: what a dict did before the parts were one object."""

    def __init__(self, works: dict[TopicPartition, PartitionWork], part: Part) -> None:
        self._works = works
        self._part = part
        self._of = attrgetter(part)

    def __getitem__(self, partition: TopicPartition) -> T:
        work = self._works.get(partition)
        value = self._of(work) if work is not None else None
        if value is None:
            raise KeyError(partition)
        return value

    # The tracker asks these per answer: without the exception a missing key costs in Mapping's own.
    def get(self, partition: TopicPartition, default: T | None = None) -> T | None:  # type: ignore[override]
        work = self._works.get(partition)
        value = self._of(work) if work is not None else None
        return default if value is None else value

    def items(self) -> ItemsView[TopicPartition, T]:
        return _Items(self)

    def __setitem__(self, partition: TopicPartition, value: T) -> None:
        work = self._works.get(partition)
        if work is None:
            work = self._works[partition] = PartitionWork(partition)
        setattr(work, self._part, value)

    def __delitem__(self, partition: TopicPartition) -> None:
        work = self._works.get(partition)
        if work is None or self._of(work) is None:
            raise KeyError(partition)
        setattr(work, self._part, None)
        if work.empty:
            del self._works[partition]

    def __iter__(self) -> Iterator[TopicPartition]:
        of = self._of
        return iter([partition for partition, work in self._works.items() if of(work) is not None])

    def __len__(self) -> int:
        of = self._of
        return sum(1 for work in self._works.values() if of(work) is not None)

    def __contains__(self, partition: object) -> bool:
        work = self._works.get(partition)
        return work is not None and self._of(work) is not None

    def pairs(self) -> list[tuple[TopicPartition, T]]:
        """(partition, part) of every partition that has the part, as they are now."""
        of = self._of
        return [(partition, value) for partition, work in self._works.items() if (value := of(work)) is not None]


class _Items(ItemsView[TopicPartition, T]):
    """A view's items without a lookup per key."""

    _mapping: PartView[T]

    def __iter__(self) -> Iterator[tuple[TopicPartition, T]]:
        return iter(self._mapping.pairs())
