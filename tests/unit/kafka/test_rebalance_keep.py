"""Keeping what a rebalance hands back (``rebalance_keep_partitions``, kafka/consume.py) without a broker: the two
ways ``bench fleet --keep`` found a worker answering the same records twice, both committed (docs/SCALEOUT.md).

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
