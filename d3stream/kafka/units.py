"""Transactions by unit: the commit policy of a job whose work is a partition *number* across topics.

``d3stream evaluate`` joins labels with answers. Answers, shadow answers and labels are all keyed by request
id on topics with as many partitions, so partition ``p`` of each holds the same requests: ``p`` is one *unit*.
A unit's results cannot be committed topic by topic: a label read on the label topic and an answer read on
the answer topic change the same waiting entry. So each unit owns, for as long as this worker holds it:

* a transactional producer whose id names the unit: the next owner's ``init_transactions`` fences this
  worker's producer and completes or aborts its open transaction before it reads the committed offsets
  (consume.py settles a partition that way), exactly as the serve job's per-partition producers do;
* a ``UnitState`` (the job's): what the job keeps between records. Taking a record changes it; the changes,
  and the records they make (evaluations, dead letters, the changelog that backs the state), leave in the
  unit's next transaction together with the offsets of every topic's partition ``p``. The state is committed
  after the transaction commits, and rolled back when it does not.

``CommitUnitsInTransaction`` is the commit policy the one consume loop (consume.py) runs such a job with: the
loop reads, settles, pauses, commits periodically and hands partitions over at a rebalance as it does for
``serve``; only what a transaction carries differs. The job's handler takes records into a unit's state
under ``lock``, which the commits hold too: a transaction carries exactly the changes of the offsets it
commits.

A failed transaction (anything but a worker-fatal error) rolls the state back, closes the unit and asks the
loop to settle its partitions again (``on_fenced``): a new producer, the state brought up to date from its
changelog, the committed offsets read again. Nothing taken since the last commit is lost: it is read again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Unpack

import structlog
from aiokafka.structs import TopicPartition

from d3stream.kafka.commits import Answered, Common, _Counted
from d3stream.kafka.publishing import (
    Publishable,
    RecordBatches,
    classify,
    fatal,
    quietly_stop,
    transaction_backoff_s,
)

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaProducer

log = structlog.get_logger(__name__)


class UnitState(Protocol):
    """What a job keeps for one unit between records, changed as they are taken (under the policy's lock)."""

    def outgoing(self) -> list[Publishable]:
        """The records the changes since the last commit make, to leave in the next transaction (taken: the
        next call returns only what came after)."""
        ...

    def committed(self) -> None:
        """The transaction carrying ``outgoing``'s records committed: the changes are kept for good."""
        ...

    def rolled_back(self) -> None:
        """Nothing since the last commit was committed: the state goes back to what was."""
        ...

    async def close(self, *, clean: bool) -> None:
        """The unit leaves this worker. ``clean``: everything kept was committed and no one else has written its
        changelog since (a revocation, the end); else its next owner rebuilds it whole."""
        ...


@dataclass(eq=False)
class Unit:
    """One partition number held by this worker: its producer and its state."""

    number: int
    producer: AIOKafkaProducer
    batches: RecordBatches
    state: UnitState


class CommitUnitsInTransaction(_Counted):
    """Each unit's records and the offsets of its partitions commit together, in transactions fenced per unit
    (see the module's docstring)."""

    # A unit is read only once its producer has fenced the previous owner and its state is up to date.
    settles_assignments = True
    fences_moved_work = True  # a unit's new owner fences its producer here before it reads

    def __init__(self, *, producer_factory: Callable[[int], AIOKafkaProducer],
                 open_state: Callable[[int], Awaitable[UnitState]], lock: asyncio.Lock, **kwargs: Unpack[Common]):
        super().__init__(**kwargs)
        self._factory = producer_factory
        self._open_state = open_state
        self.lock = lock
        self.units: dict[int, Unit] = {}
        self._opening: dict[int, asyncio.Future[Unit]] = {}

    def state(self, number: int) -> UnitState | None:
        """The state of unit ``number`` when this worker holds it, ready to take records."""
        unit = self.units.get(number)
        return unit.state if unit is not None else None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        async with self.lock:
            for number in sorted({*self.units, *self._opening}):
                await self._let_go(number)

    async def deliver(self, answered: Sequence[Answered]) -> None:
        """The records of these offsets were taken into their unit's state: their offsets are done."""
        for item in answered:
            self.tracker.done(item.partition, item.offset, item.epoch)  # not if revoked since: not ours

    # ------------------------------------------------------------------------------------ commits

    async def flush(self, partitions: Sequence[TopicPartition] | None = None) -> None:
        async with self.lock:
            chosen = self.tracker.committing() if partitions is None else partitions
            units = [self.units[number] for number in sorted({p.partition for p in chosen}) if number in self.units]
            # Each unit has its own producer: their transactions commit side by side.
            await asyncio.gather(*(self._commit(unit) for unit in units))

    def _members(self, number: int) -> list[TopicPartition]:
        return [partition for partition in self.tracker.partitions()
                if partition.partition == number and self.tracker.owns(partition)]

    async def _commit(self, unit: Unit) -> None:
        """One transaction: the unit's records and the offsets of its partitions; on a failure the unit is
        closed and settled again (or the worker stops, on a worker-fatal error)."""
        from aiokafka.errors import KafkaError, ProducerFenced

        members = self._members(unit.number)
        offsets = self.tracker.commit_offsets(members)
        records = unit.state.outgoing()
        if not offsets and not records:
            return
        try:
            await self._transaction(unit, records, offsets)
        except ProducerFenced:
            log.info("fenced: another worker owns this unit now", unit=unit.number)
            await self._close(unit, clean=False)  # another owner writes its changelog now
            self._settle_again(members)
            return
        except KafkaError as exc:
            if classify(exc, transactional=True) == "worker":
                topics = sorted({record.topic for record in records})
                raise fatal(None, exc, f"the transaction of unit {unit.number} (topics {topics})") from exc
            log.warning("transaction failed; the unit is brought back to what was committed and read again",
                        unit=unit.number, error=f"{type(exc).__name__}: {exc}")
            await self._close(unit, clean=True)  # rolled back: its file holds what the changelog holds
            self._settle_again(members)
            return
        unit.state.committed()
        self.tracker.committed(offsets)
        self._counted_commit()

    async def _transaction(self, unit: Unit, records: list[Publishable],
                           offsets: dict[TopicPartition, tuple[int, str]]) -> None:
        producer = unit.producer
        await producer.begin_transaction()
        try:
            failures = await unit.batches.send(records)
            if failures:
                raise failures[0][1]
            if offsets:
                await producer.send_offsets_to_transaction(offsets, self.group_id)
            await producer.commit_transaction()
        except BaseException:
            await self._aborted(producer)
            raise

    def _settle_again(self, members: list[TopicPartition]) -> None:
        self.tracker.forget(members)  # what was read since the last commit is read again
        if self.on_fenced is not None:
            for partition in members:
                self.on_fenced(partition)

    # ---------------------------------------------------------------------------------- assignment

    async def assigned(self, partitions: Sequence[TopicPartition]) -> None:
        """Open the units of ``partitions`` (one per number, however many of its topics are named): a producer
        that fences the previous owner, then the state brought up to date. A unit that cannot be opened now
        (the broker away) is tried again with backoff, its partitions held unread meanwhile (the loop settles
        them only once this returns; a revocation cancels the wait); a worker-fatal error stops the worker."""
        from aiokafka.errors import KafkaError

        for number in sorted({partition.partition for partition in partitions}):
            failures = 0
            while number not in self.units:
                try:
                    await self._opened(number)
                except KafkaError as exc:  # the broker's: retried below, unless no retry can help
                    if classify(exc, transactional=True) == "worker":
                        raise fatal(None, exc, f"opening unit {number}") from exc
                    failures += 1
                    delay = transaction_backoff_s(failures)
                    log.warning("unit not opened; will retry", unit=number, attempt=failures,
                                retry_in_s=round(delay, 1), error=f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(delay)

    async def _opened(self, number: int) -> None:
        """Wait for unit ``number`` to open, starting it unless another caller has (one producer per unit: a
        second with the same transactional id would fence the first, i.e. this worker itself)."""
        opening = self._opening.get(number)
        if opening is None:
            opening = self._opening[number] = asyncio.ensure_future(self._open(number))
        try:
            await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening.get(number) is opening:
                del self._opening[number]

    async def _open(self, number: int) -> Unit:
        producer = self._factory(number)
        try:
            await producer.start()  # init_transactions: the previous owner's open transaction ends first
            state = await self._open_state(number)
        except BaseException:
            await quietly_stop(producer)
            raise
        unit = self.units[number] = Unit(number, producer, RecordBatches(producer), state)
        return unit

    async def revoked(self, partitions: Sequence[TopicPartition]) -> None:
        """Close the units of ``partitions``: their producers stopped, their states closed clean (everything
        they keep is committed: a revocation commits first, and what failed to commit is rolled back)."""
        async with self.lock:
            for number in sorted({partition.partition for partition in partitions}):
                await self._let_go(number)

    async def _let_go(self, number: int) -> None:
        opening = self._opening.pop(number, None)
        if opening is not None and not opening.done():
            opening.cancel()
            await asyncio.wait({opening})
        unit = self.units.get(number)
        if unit is not None:
            await self._close(unit, clean=True)

    async def _close(self, unit: Unit, *, clean: bool) -> None:
        if self.units.get(unit.number) is unit:
            del self.units[unit.number]
        await quietly_stop(unit.producer)
        unit.state.rolled_back()  # what was not committed is read again by the unit's next owner
        await unit.state.close(clean=clean)
