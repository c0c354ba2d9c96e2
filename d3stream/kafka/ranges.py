"""A fixed range of a topic as a read policy: what a replay reads, and when it is done.

``RangeRead`` is the other ``consume.ReadPolicy`` beside the live one (``consume.LiveRead``): the range's
[start, end) offsets per partition are fixed when it starts (``resolve_bounds``: by offsets or by timestamps,
all partitions or some), each partition starts at the later of its range start and the group's commit, and
the read is finished once every partition's position reached its end and nothing is in flight.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer


@dataclass
class ReplayRange:
    """What to replay: a topic, optionally some partitions, and where to start and stop."""

    topic: str
    partitions: list[int] | None = None
    start_offset: int | None = None
    end_offset: int | None = None  # exclusive
    start_time: int | None = None  # epoch milliseconds, inclusive
    end_time: int | None = None  # epoch milliseconds, exclusive


async def resolve_bounds(consumer: AIOKafkaConsumer, plan: ReplayRange) -> dict[TopicPartition, tuple[int, int]]:
    """[start, end) offsets of every partition of the range, fixed when the replay starts."""
    known = consumer.partitions_for_topic(plan.topic)
    if not known:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - a fresh client knows no topics yet
        known = consumer.partitions_for_topic(plan.topic)
    if not known:
        raise ValueError(f"topic {plan.topic!r} does not exist (setting: --from-topic)")
    chosen = sorted(known) if plan.partitions is None else sorted(set(plan.partitions) & set(known))
    if plan.partitions is not None and len(chosen) != len(set(plan.partitions)):
        missing = sorted(set(plan.partitions) - set(known))
        raise ValueError(f"topic {plan.topic!r} has no partition(s) {missing} (setting: --partitions)")
    partitions = [TopicPartition(plan.topic, number) for number in chosen]
    firsts = await consumer.beginning_offsets(partitions)
    lasts = await consumer.end_offsets(partitions)

    async def by_time(moment: int | None, fallback: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        if moment is None:
            return fallback
        found = await consumer.offsets_for_times({p: moment for p in partitions})
        return {p: (found[p].offset if found.get(p) is not None else lasts[p]) for p in partitions}

    starts = await by_time(plan.start_time, firsts)
    ends = await by_time(plan.end_time, lasts)
    bounds = {}
    for partition in partitions:
        start = max(starts[partition], plan.start_offset or 0, firsts[partition])
        end = min(ends[partition], lasts[partition] if plan.end_offset is None else plan.end_offset)
        bounds[partition] = (start, max(start, end))
    return bounds


def written_sources(path: Path) -> set[tuple[str, int, int]]:
    """(topic, partition, offset) of every answer a replay file already holds."""
    sources: set[tuple[str, int, int]] = set()
    if not path.is_file():
        return sources
    with open(path, "rb") as handle:
        for line in handle:
            try:
                source = json.loads(line)["source"]
                sources.add((source["topic"], int(source["partition"]), int(source["offset"])))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash: that request is answered again
    return sources


class RangeRead:
    """A replay's read policy: a fixed range of one topic (from the replay group's commits on), finished once
    every partition's position reached the range's end and nothing is in flight.

    On resume into a file, records whose answers the file already holds are skipped, so the file gets each
    request once even though the group's commit may lag the file by a flush interval."""

    def __init__(self, plan: ReplayRange, *, out_file: Path | None = None,
                 on_partition_read: Callable[[TopicPartition], None] | None = None):
        self.plan = plan
        self.bounds: dict[TopicPartition, tuple[int, int]] = {}
        self._skip = written_sources(out_file) if out_file else set()
        self._positions_done: set[TopicPartition] = set()
        self._on_partition_read = on_partition_read

    async def subscribe(self, consumer: AIOKafkaConsumer, listener: ConsumerRebalanceListener) -> bool:
        self.bounds = await resolve_bounds(consumer, self.plan)
        if self.plan.partitions is None:
            consumer.subscribe([self.plan.topic], listener=listener)
            return False
        partitions = list(self.bounds)
        consumer.assign(partitions)
        await self.assigned(consumer, partitions, [])
        return True

    async def assigned(self, consumer: AIOKafkaConsumer, partitions: Sequence[TopicPartition],
                       settling: Sequence[TopicPartition]) -> None:
        for partition in partitions:
            # A settling partition (exactly_once) is positioned once settled, through start_position; a
            # committed offset read here could predate the previous owner's last transaction.
            if partition not in settling:
                committed = await consumer.committed(partition)
                consumer.seek(partition, self.start_position(partition, committed))
            self._positions_done.discard(partition)

    def start_position(self, partition: TopicPartition, committed: int | None) -> int:
        start, _ = self.bounds.get(partition, (0, 0))
        return max(start, committed or 0)

    def accept(self, record: ConsumerRecord) -> bool:
        start, end = self.bounds.get(TopicPartition(record.topic, record.partition), (0, 0))
        return start <= record.offset < end and (record.topic, record.partition, record.offset) not in self._skip

    async def finished(self, consumer: AIOKafkaConsumer, in_flight: int) -> bool:
        assignment = consumer.assignment()
        if not assignment:
            return False
        for partition in assignment:
            if partition in self._positions_done:
                continue
            _, end = self.bounds.get(partition, (0, 0))
            if await consumer.position(partition) >= end:
                self._positions_done.add(partition)
                consumer.pause(partition)
                if self._on_partition_read is not None:
                    self._on_partition_read(partition)
        return all(p in self._positions_done for p in assignment) and in_flight == 0
