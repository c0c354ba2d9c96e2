"""Keeping what a rebalance hands back (``rebalance_keep_partitions``, kafka/consume.py) without a broker: the two
ways ``bench fleet --keep`` found a worker answering the same records twice, both committed (docs/SCALEOUT.md), and
where it keeps nothing (at least once).

* A partition newly assigned beside a kept one is read from aiokafka's own position (the committed offset it
  read) as soon as the assignment is made; the callback then awaits the group's commits of the kept ones, and
  the new partition's settling seeks back to the committed offset. It must be paused for that whole time.
* Between a revocation and the next assignment aiokafka still returns records of a held partition; a kept one
  is sought back to where it was held, so they must not be taken meanwhile.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from d3stream.kafka.consume import ConsumeLoop, _Holdover, _Rebalance
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.partitions import PartitionState

KEPT, NEW = TopicPartition("requests", 0), TopicPartition("requests", 1)


class Consumer:
    """What the rebalance listener asks of the consumer: its generation, positions and pauses."""

    def __init__(self, generation: int):
        self._coordinator = SimpleNamespace(generation=generation)
        self.paused: set[TopicPartition] = set()
        self.sought: dict[TopicPartition, int] = {}

    def assignment(self) -> set[TopicPartition]:
        return {KEPT, NEW}

    def pause(self, *partitions: TopicPartition) -> None:
        self.paused.update(partitions)

    def resume(self, *partitions: TopicPartition) -> None:
        self.paused.difference_update(partitions)

    def seek(self, partition: TopicPartition, offset: int) -> None:
        self.sought[partition] = offset


def test_a_partition_assigned_beside_a_kept_one_is_not_read_before_it_has_settled() -> None:
    async def scenario() -> None:
        consumer = Consumer(generation=4)
        tracker = OffsetTracker("partition")
        tracker.add_all(KEPT, [0, 1, 2, 3, 4])
        tracker.hold([KEPT])
        paused_while_the_commits_are_read: set[TopicPartition] = set()
        settling: list[TopicPartition] = []

        async def still_ours(partitions: list[TopicPartition]) -> list[TopicPartition]:
            await asyncio.sleep(0)  # the consume loop reads meanwhile
            paused_while_the_commits_are_read.update(consumer.paused)
            return partitions

        async def assigned(*args: Any) -> None:
            return None

        loop: Any = SimpleNamespace(
            consumer=consumer, tracker=tracker, works=tracker.works, assignment=None, joined=False,
            holdover=_Holdover(3, {KEPT: 5}, {KEPT: PartitionState(KEPT, consumer)}, False),  # type: ignore[arg-type]
            commits=SimpleNamespace(settles_assignments=True), still_ours=still_ours,
            begin_settling=settling.extend, read=SimpleNamespace(assigned=assigned),
            rebalance_settled=lambda: None, metrics=SimpleNamespace(count_rebalance=lambda *a, **k: None))
        await _Rebalance(loop).on_partitions_assigned([KEPT, NEW])

        assert NEW in paused_while_the_commits_are_read, "read from aiokafka's position before it settled"
        assert consumer.sought == {KEPT: 5}, "the kept partition goes on from where it was held"
        assert settling == [NEW] and not tracker.held(KEPT)

    asyncio.run(scenario())


def test_records_of_a_held_partition_are_not_taken_until_the_assignment_says_it_stays() -> None:
    tracker = OffsetTracker("partition")
    tracker.add_all(KEPT, [0, 1])
    tracker.hold([KEPT])
    loop: Any = SimpleNamespace(
        assignment=SimpleNamespace(is_settling=lambda partition: False), tracker=tracker,
        read=SimpleNamespace(accept=lambda record: True), consumer=Consumer(generation=4))
    records = [SimpleNamespace(offset=offset, key=b"k") for offset in (2, 3)]

    fetched = ConsumeLoop._take(loop, {KEPT: records})  # type: ignore[arg-type]
    assert fetched.records == [], "taken while held: a kept partition reads them again from where it was held"

    tracker.release([KEPT])
    assert [record.offset for record in ConsumeLoop._take(loop, {KEPT: records}).records] == [2, 3]  # type: ignore[arg-type]


class PositionedConsumer(Consumer):
    """A consumer that knows where it read each partition to (aiokafka's assignment state)."""

    def __init__(self, generation: int, positions: dict[TopicPartition, int]):
        super().__init__(generation)
        states = {partition: SimpleNamespace(position=position, has_valid_position=True)
                  for partition, position in positions.items()}
        assignment = SimpleNamespace(tps=set(positions), state_value=states.__getitem__)
        self._subscription = SimpleNamespace(subscription=SimpleNamespace(assignment=assignment))


@pytest.mark.parametrize("fences_moved_work", [True, False], ids=["exactly_once", "at_least_once"])
def test_a_revocation_keeps_without_a_drain_only_where_moved_work_is_fenced(fences_moved_work: bool) -> None:
    """In exactly once a revoked partition is held as it is, its work in hand (its next owner fences whatever
    this worker still had). In at least once that work would be published after the partition moved and answered
    again by the next owner, so the revocation drains and lets every partition go, the setting on or not."""
    async def scenario() -> tuple[list[float], Any]:
        consumer = PositionedConsumer(generation=4, positions={KEPT: 5, NEW: 9})
        tracker = OffsetTracker("partition")
        for partition in (KEPT, NEW):
            tracker.add_all(partition, [0, 1])
        drains: list[float] = []
        let_go: list[TopicPartition] = []

        async def drain(seconds: float, partitions: list[TopicPartition]) -> None:
            drains.append(seconds)

        async def flush(partitions: list[TopicPartition]) -> None:
            return None

        async def guarded(step: Any) -> None:
            await step

        async def letting_go(partitions: list[TopicPartition], deadline: float) -> int:
            let_go.extend(partitions)
            return 0

        async def stop_settling(partitions: list[TopicPartition]) -> None:
            return None

        assignment = SimpleNamespace(settling=lambda: [], stop_settling=stop_settling, end=lambda partitions: None,
                                     state=lambda partition: None, backpressure=False)
        loop: Any = SimpleNamespace(
            consumer=consumer, tracker=tracker, assignment=assignment, holdover=None, rebalance_began=None,
            lifecycle=SimpleNamespace(rebalance_keep_partitions=True, rebalance_drain_s=5.0),
            delivery=SimpleNamespace(rebalance_timeout_ms=30_000), drain=drain, guarded=guarded,
            commits=SimpleNamespace(fences_moved_work=fences_moved_work, flush=flush), let_go=letting_go)
        await _Rebalance(loop).on_partitions_revoked([KEPT, NEW])
        return drains, (loop.holdover, let_go)

    drains, (holdover, let_go) = asyncio.run(scenario())
    if fences_moved_work:
        assert drains == [] and let_go == [], "exactly once drained or let go what it could keep"
        assert holdover.positions == {KEPT: 5, NEW: 9}
    else:
        assert drains == [5.0], "at least once did not drain before its partitions could move"
        assert holdover is None and set(let_go) == {KEPT, NEW}
