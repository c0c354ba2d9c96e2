"""The commit policy by unit (d3stream/kafka/units.py) without a broker: a unit's records and the offsets of all
its topics' partitions leave in one transaction, after which its state is kept; a failed transaction sends
the state back and has the unit's partitions settled again (its next state not clean when it was fenced); a
revocation closes it clean. The broker scenarios are tests/integration/test_evaluate.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    ProducerFenced,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.structs import TopicPartition

from d3stream.kafka import units
from d3stream.kafka.commits import Answered
from d3stream.kafka.limits import WorkerFatal
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.units import CommitUnitsInTransaction

ANSWERS, LABELS = TopicPartition("answers", 0), TopicPartition("labels", 0)


class Producer:
    fail: list[BaseException] = []

    def __init__(self, number: int):
        self.number = number
        self.in_transaction = False
        self.stopped = False
        self.committed: list[dict[TopicPartition, Any]] = []
        self._txn_manager = self

    def is_in_transaction(self) -> bool:
        return self.in_transaction

    starts: list[BaseException | None] = []  # what each start does: an error raised, or None: started

    async def start(self) -> None:
        if Producer.starts and (error := Producer.starts.pop(0)) is not None:
            raise error

    async def stop(self) -> None:
        self.stopped = True

    async def begin_transaction(self) -> None:
        self.in_transaction = True

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        if Producer.fail:
            raise Producer.fail.pop(0)
        self.pending = dict(offsets)

    async def commit_transaction(self) -> None:
        self.in_transaction = False
        self.committed.append(self.pending)

    async def abort_transaction(self) -> None:
        self.in_transaction = False


class Batches:
    def __init__(self, producer: Any):
        self.sent: list[Any] = []

    async def send(self, records: Sequence[Any]) -> list[tuple[int, BaseException]]:
        self.sent += records
        return []


class State:
    """A job's state of one unit: what it took since the last commit, what it kept, how it ended."""

    def __init__(self) -> None:
        self.taken: list[str] = []
        self.kept: list[str] = []
        self.closed: bool | None = None  # clean or not, once closed

    def outgoing(self) -> list[Any]:
        return [("out", change) for change in self.taken]

    def committed(self) -> None:
        self.kept += self.taken
        self.taken = []

    def rolled_back(self) -> None:
        self.taken = []

    async def close(self, *, clean: bool) -> None:
        self.closed = clean


def _policy(opened: list[State]) -> tuple[CommitUnitsInTransaction, OffsetTracker, list[TopicPartition]]:
    tracker = OffsetTracker("partition")
    settled_again: list[TopicPartition] = []

    async def open_state(number: int) -> State:
        opened.append(State())
        return opened[-1]

    policy = CommitUnitsInTransaction(producer_factory=Producer, open_state=open_state, lock=asyncio.Lock(),
                                      consumer=None, tracker=tracker, group_id="g")
    policy.on_fenced = settled_again.append
    return policy, tracker, settled_again


async def _take(policy: CommitUnitsInTransaction, tracker: OffsetTracker, state: State, change: str,
                offset: int) -> None:
    """A handler's step: a record of each topic read, taken into the unit's state, its offsets done."""
    answered = []
    for partition in (ANSWERS, LABELS):
        epoch, _ = tracker.add_all(partition, [offset])
        answered.append(Answered(partition, offset, [], epoch))
    state.taken.append(change)
    await policy.deliver(answered)


def test_a_units_records_and_the_offsets_of_all_its_partitions_commit_in_one_transaction(monkeypatch):
    monkeypatch.setattr(units, "RecordBatches", Batches)
    opened: list[State] = []

    async def scenario() -> None:
        policy, tracker, _ = _policy(opened)
        await policy.assigned([ANSWERS, LABELS])  # one unit for both topics' partition 0
        assert list(policy.units) == [0] and len(opened) == 1
        state = opened[0]
        await _take(policy, tracker, state, "joined-1", 0)
        await policy.flush()
        unit_producer = policy.units[0].producer
        assert unit_producer.committed == [{ANSWERS: (1, ""), LABELS: (1, "")}]
        assert policy.units[0].batches.sent == [("out", "joined-1")]  # type: ignore[attr-defined]
        assert state.kept == ["joined-1"] and policy.commits == 1
        await policy.revoked([ANSWERS, LABELS])
        assert state.closed is True and unit_producer.stopped and not policy.units

    asyncio.run(scenario())


def test_a_failed_transaction_sends_the_state_back_and_the_units_partitions_are_settled_again(monkeypatch):
    monkeypatch.setattr(units, "RecordBatches", Batches)
    opened: list[State] = []

    async def scenario() -> None:
        policy, tracker, settled_again = _policy(opened)
        await policy.assigned([ANSWERS, LABELS])
        first = opened[0]
        await _take(policy, tracker, first, "joined-1", 0)
        Producer.fail = [KafkaTimeoutError()]  # retriable: nothing committed; read again from the commit
        await policy.flush()
        assert first.kept == [] and first.taken == [] and first.closed is True, "rolled back, closed clean"
        assert sorted(settled_again) == sorted([ANSWERS, LABELS]) and not tracker.owns(ANSWERS)
        assert not policy.units and policy.aborts == 1
        await policy.assigned([ANSWERS, LABELS])  # the loop settles them again: a new producer, a new state
        second = opened[1]
        await _take(policy, tracker, second, "joined-1", 0)
        Producer.fail = [ProducerFenced()]  # another worker owns the unit: its state file cannot be trusted
        await policy.flush()
        assert second.closed is False and second.kept == [] and not policy.units

    asyncio.run(scenario())


def test_a_unit_that_cannot_open_is_tried_again_and_one_refused_for_good_stops_the_worker(monkeypatch):
    """The broker away while a unit opens: its partitions stay unread while it is tried again, with backoff,
    until it opens; a transactional id the worker may not use is worker-fatal, naming the cause."""
    monkeypatch.setattr(units, "RecordBatches", Batches)
    opened: list[State] = []

    async def scenario() -> None:
        policy, _, _ = _policy(opened)
        Producer.starts = [KafkaConnectionError(), None]
        await policy.assigned([ANSWERS, LABELS])
        assert list(policy.units) == [0] and len(opened) == 1 and not Producer.starts
        Producer.starts = [TransactionalIdAuthorizationFailed()]
        with pytest.raises(WorkerFatal, match="transactional ids"):
            await policy.assigned([TopicPartition("answers", 1)])
        assert list(policy.units) == [0]

    asyncio.run(scenario())
