"""Which consumed offsets may be committed: per partition, the first offset whose request is not answered.

Requests of one partition finish out of order (a text request overtakes a video); an offset may be committed
only when it and every earlier offset of its partition are answered. ``OffsetTracker`` keeps, per assigned
partition, the offsets in flight in read order, the commit point, and how long it has stood still (for the
stall gauges and readiness). It also numbers each assignment of a partition (its *epoch*), so that work begun
before a revocation is never committed after the partition comes back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition


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
        self._partitions: dict[TopicPartition, _Progress] = {}
        self._epochs = 0

    def add(self, partition: TopicPartition, offset: int) -> int:
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

    def owns(self, partition: TopicPartition, epoch: int | None = None) -> bool:
        """Whether the partition is (still) assigned, and with ``epoch``, in that same assignment: work
        begun before a revocation must not be committed after the partition comes back."""
        progress = self._partitions.get(partition)
        return progress is not None and (epoch is None or progress.epoch == epoch)

    def done(self, partition: TopicPartition, offset: int, epoch: int | None = None) -> None:
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

    def in_flight(self, partitions: Sequence[TopicPartition] | None = None) -> int:
        chosen = self._partitions if partitions is None else {p: self._partitions.get(p) for p in partitions}
        return sum(len(p.index) for p in chosen.values() if p is not None)

    def committable(self, partitions: Sequence[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Next offset to read, per partition whose commit point moved since the last commit."""
        result = {}
        for partition, progress in self._partitions.items():
            if partitions is not None and partition not in partitions:
                continue
            point = progress.entries[0][0] if progress.entries else progress.last + 1
            if point > 0 and point != progress.committed:
                result[partition] = point
        return result

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        now = time.monotonic()
        for partition, offset in offsets.items():
            if partition in self._partitions:
                self._partitions[partition].committed = offset
                self._partitions[partition].moved_at = now

    def commit_base(self, partition: TopicPartition) -> int | None:
        """The partition's committed offset as far as this worker knows: its last commit, else where it began
        reading in this assignment (None: nothing read yet)."""
        progress = self._partitions.get(partition)
        if progress is None:
            return None
        return progress.committed if progress.committed is not None else progress.first

    def stall(self, partition: TopicPartition, now: float | None = None) -> tuple[float, float]:
        """(age of the oldest unanswered request, seconds the commit point has not moved while work waited)."""
        progress = self._partitions.get(partition)
        if progress is None or not progress.waiting():
            return 0.0, 0.0
        now = time.monotonic() if now is None else now
        oldest = now - min(progress.added_at.values()) if progress.added_at else 0.0
        return oldest, now - progress.moved_at

    def forget(self, partitions: Sequence[TopicPartition]) -> None:
        for partition in partitions:
            self._partitions.pop(partition, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)
