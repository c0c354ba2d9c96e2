"""The Kafka layer's state objects without a broker: a partition's pause reasons (d3stream/kafka/partitions.py, kept
by assignment.py) and a partition's transaction states (partitions.py, moved by commits.py); the broker scenarios are in
tests/test_delivery.py, tests/test_quotas.py and tests/test_ordering.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, ProducerFenced
from aiokafka.structs import TopicPartition

from d3stream.kafka import commits
from d3stream.kafka.assignment import Assignment
from d3stream.kafka.commits import Answered, CommitInTransaction
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.partitions import IllegalTxnTransition, PartitionTransactions, PauseReason, TxnState

P0, P1 = TopicPartition("requests", 0), TopicPartition("requests", 1)


class FakeConsumer:
    def __init__(self, assigned: set[TopicPartition]):
        self.assigned = assigned
        self.paused: set[TopicPartition] = set()
        self.calls: list[tuple[str, TopicPartition]] = []

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused.update(partitions)
        self.calls += [("pause", p) for p in partitions]

    def resume(self, *partitions: TopicPartition) -> None:
        self.paused.difference_update(partitions)
        self.calls += [("resume", p) for p in partitions]


def test_a_partition_is_paused_on_its_first_reason_and_resumed_when_none_is_left():
    consumer = FakeConsumer({P0, P1})
    assignment = Assignment(consumer, [P0, P1])  # type: ignore[arg-type]
    assert assignment.pause([P0, P1], PauseReason.QUOTA) == [P0, P1]
    assert assignment.pause([P0], PauseReason.WINDOW) == [P0]
    assert assignment.pause([P0], PauseReason.WINDOW) == []  # held already: nothing new
    assert consumer.calls == [("pause", P0), ("pause", P1)]  # once per partition, on its first reason
    assert assignment.resume([P0, P1], PauseReason.QUOTA) == [P0, P1]
    assert consumer.paused == {P0}, "the window still holds P0"
    assert assignment.paused_for(PauseReason.WINDOW) == {P0}
    assignment.resume([P0], PauseReason.WINDOW)
    assert consumer.paused == set()
    assert assignment.resume([P0], PauseReason.WINDOW) == []  # no reason to let go: the consumer is not asked


def test_settling_holds_partitions_until_settled_and_the_end_of_an_assignment_lets_backpressure_go():
    async def scenario() -> None:
        consumer = FakeConsumer({P0, P1})
        assignment = Assignment(consumer, [P0, P1], generation=3)  # type: ignore[arg-type]
        release = asyncio.Event()

        async def settle(partitions: list[TopicPartition]) -> None:
            await release.wait()
            assignment.settled(partitions, asyncio.current_task())

        assignment.begin_settling([P0, P1], settle)
        assignment.pause([P1], PauseReason.BACKPRESSURE)
        assignment.skipped_while_settling(P0, 12)
        assignment.skipped_while_settling(P0, 10)
        assert set(assignment.settling()) == {P0, P1} and assignment.is_settling(P0)
        assert assignment.take_skipped(P0) == 10 and assignment.take_skipped(P0) is None
        release.set()
        await asyncio.gather(*set(assignment.settling().values()))
        assert not assignment.settling() and consumer.paused == {P1}, "backpressure still holds P1"
        assignment.end([P0, P1])
        assert assignment.ended and assignment.revoked == [P0, P1] and not assignment.backpressure

    asyncio.run(scenario())


class FakeProducer:
    fail: list[BaseException] = []

    def __init__(self, partition: TopicPartition):
        self.in_transaction = False
        self.stopped = False
        self._txn_manager = self

    def is_in_transaction(self) -> bool:
        return self.in_transaction

    async def start(self) -> None:
        await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.stopped = True

    async def begin_transaction(self) -> None:
        self.in_transaction = True

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        if FakeProducer.fail:
            raise FakeProducer.fail.pop(0)

    async def commit_transaction(self) -> None:
        self.in_transaction = False

    async def abort_transaction(self) -> None:
        self.in_transaction = False


class FakeBatches:
    def __init__(self, producer: Any):
        self.producer = producer

    async def send(self, records: Sequence[Any]) -> list[tuple[int, BaseException]]:
        return []


def test_a_partitions_transactions_move_along_their_states(monkeypatch):
    monkeypatch.setattr(commits, "RecordBatches", FakeBatches)

    async def scenario() -> None:
        tracker = OffsetTracker("partition")
        policy = CommitInTransaction(producer_factory=FakeProducer, consumer=None, tracker=tracker, group_id="g")
        await policy.assigned([P0])
        txns = policy._partitions[P0]  # noqa: SLF001
        assert txns.state is TxnState.READY and P0 in policy.producers
        epoch, _ = tracker.add_all(P0, [0, 1, 2])
        await policy.deliver([Answered(P0, 0, [], epoch)])
        await policy.flush()
        assert policy.commits == 1 and txns.state is TxnState.READY

        FakeProducer.fail = [KafkaTimeoutError()]  # retriable: the producer goes, the partition backs off
        await policy.deliver([Answered(P0, 1, [], epoch)])
        await policy.flush()
        assert txns.state is TxnState.RETRY_WAIT and txns.failures == 1 and policy.aborts == 1
        await policy.flush()
        assert txns.state is TxnState.RETRY_WAIT and policy.commits == 1, "the periodic flush waits"
        await policy.flush([P0])  # a named flush (revocation, shutdown) tries at once
        assert txns.state is TxnState.READY and txns.failures == 0 and policy.commits == 2

        FakeProducer.fail = [ProducerFenced()]  # another worker owns it now: closed, forgotten
        await policy.deliver([Answered(P0, 2, [], epoch)])
        await policy.flush()
        assert txns.state is TxnState.CLOSED and P0 not in policy.producers and not tracker.owns(P0)

        starting = asyncio.create_task(policy.assigned([P1]))  # revoked while its producer starts
        await asyncio.sleep(0)
        late = policy._partitions[P1]  # noqa: SLF001
        assert late.state is TxnState.CREATING
        await policy.revoked([P1])
        await starting
        assert late.state is TxnState.CLOSED and not policy.producers

    asyncio.run(scenario())


class GatedProducer(FakeProducer):
    """A producer whose transaction waits at its offsets until the test opens the gate."""

    gate: asyncio.Event

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        await GatedProducer.gate.wait()
        if self.stopped:
            raise RuntimeError("stopped in the middle of its transaction")


def test_a_revoked_partitions_producer_is_stopped_only_once_its_commit_in_flight_has_ended(monkeypatch):
    """bench fleet --keep found a periodic commit in flight for a partition the rebalance then let go: its
    producer was stopped under it, the commit waited for ever holding the policy's lock, and no later commit of
    the worker ever finished. The revocation waits for the transaction instead."""
    monkeypatch.setattr(commits, "RecordBatches", FakeBatches)

    async def scenario() -> None:
        GatedProducer.gate = asyncio.Event()
        tracker = OffsetTracker("partition")
        policy = CommitInTransaction(producer_factory=GatedProducer, consumer=None, tracker=tracker, group_id="g")
        await policy.assigned([P0])
        producer = policy.producers[P0]
        epoch, _ = tracker.add_all(P0, [0])
        await policy.deliver([Answered(P0, 0, [], epoch)])
        committing = asyncio.create_task(policy.flush())
        await asyncio.sleep(0.05)
        assert producer.in_transaction, "the commit is in flight"
        revoking = asyncio.create_task(policy.revoked([P0]))
        await asyncio.sleep(0.05)
        assert not producer.stopped, "stopped in the middle of the commit's transaction"
        GatedProducer.gate.set()
        await asyncio.wait_for(committing, 5)
        await asyncio.wait_for(revoking, 5)
        assert policy.commits == 1 and producer.stopped and not policy.producers

    asyncio.run(scenario())


def test_an_illegal_transaction_transition_raises():
    txns = PartitionTransactions(P0)
    with pytest.raises(IllegalTxnTransition):
        txns.to(TxnState.IN_TRANSACTION)  # no producer yet
    txns.close()
    with pytest.raises(IllegalTxnTransition):
        txns.to(TxnState.CREATING)  # closed for good


def test_a_partitions_progress_pauses_and_transactions_are_one_object_that_ends_in_one_call(monkeypatch):
    """The tracker, the assignment and the transactional policy keep their parts of a partition in its one
    PartitionWork: a partition taken over again (fenced, then settled) keeps being that object, and a
    revocation ends all of it: not read, not paused, no producer, nothing of it committed later."""
    monkeypatch.setattr(commits, "RecordBatches", FakeBatches)

    async def scenario() -> None:
        consumer = FakeConsumer({P0, P1})
        tracker = OffsetTracker("partition")
        assignment = Assignment(consumer, [P0, P1], works=tracker.works)  # type: ignore[arg-type]
        policy = CommitInTransaction(producer_factory=FakeProducer, consumer=None, tracker=tracker, group_id="g")
        await policy.assigned([P0, P1])
        epoch, _ = tracker.add_all(P0, [0, 1])
        assignment.pause([P0], PauseReason.QUOTA)
        work = tracker.works.get(P0)
        assert work is not None and work.progress is not None and work.transactions is not None
        assert work.pauses is not None and PauseReason.QUOTA in work.pauses.reasons
        producer = work.transactions.producer
        assert isinstance(producer, FakeProducer)

        await policy.revoked([P0])  # the policy's part: its producer stopped
        tracker.works.end(P0)  # and the rest, in one call
        assert tracker.works.get(P0) is None and not tracker.owns(P0, epoch) and producer.stopped
        assert assignment.paused_for(PauseReason.QUOTA) == set() and P0 not in policy.producers
        await policy.deliver([Answered(P0, 0, [], epoch)])
        assert tracker.commit_offsets() == {}, "a late answer of the revoked partition is never committed"
        assert tracker.works.get(P1) is not None, "the other partition's work is untouched"

    asyncio.run(scenario())
