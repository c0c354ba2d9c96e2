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
    read: deque[int] = field(default_factory=deque)  # offsets in read order, from the first unanswered one on
    unanswered: dict[int, float] = field(default_factory=dict)  # offset -> when it was read (monotonic)
    last: int = -1
    committed: int | None = None
    epoch: int = 0  # which assignment of the partition this progress belongs to
    first: int | None = None  # the first offset read in this assignment (where the group's commit stood)
    moved_at: float = 0.0  # monotonic time the commit point last moved, or work arrived after none waited

    def waiting(self) -> bool:
        """Whether work of this partition is not committed yet (unanswered, or answered but uncommitted)."""
        return bool(self.unanswered) or (self.last >= 0 and self.committed != self.last + 1)


class OffsetTracker:
    """Per partition: which offsets are in flight, and the first offset not yet answered."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Progress] = {}
        self._epochs = 0

    def add(self, partition: TopicPartition, offset: int) -> int:
        """Track an offset read from ``partition``; returns the assignment epoch its work belongs to."""
        return self.add_all(partition, [offset])

    def add_all(self, partition: TopicPartition, offsets: Sequence[int]) -> int:
        """Track offsets read from ``partition`` (in read order); returns the assignment epoch their work
        belongs to."""
        progress = self._partitions.get(partition)
        if progress is None:
            self._epochs += 1
            progress = self._partitions[partition] = _Progress(epoch=self._epochs)
        if not offsets:
            return progress.epoch
        now = time.monotonic()
        if not progress.waiting():
            progress.moved_at = now  # a stall is counted from when work arrived
        if progress.first is None:
            progress.first = offsets[0]
        progress.read.extend(offsets)
        progress.unanswered.update(dict.fromkeys(offsets, now))
        progress.last = max(progress.last, max(offsets))
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
        unanswered = progress.unanswered
        if unanswered.pop(offset, None) is None:
            return
        read = progress.read
        while read and read[0] not in unanswered:
            read.popleft()

    def in_flight(self, partitions: Sequence[TopicPartition] | None = None) -> int:
        chosen = self._partitions if partitions is None else {p: self._partitions.get(p) for p in partitions}
        return sum(len(p.unanswered) for p in chosen.values() if p is not None)

    def committable(self, partitions: Sequence[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Next offset to read, per partition whose commit point moved since the last commit."""
        result = {}
        for partition, progress in self._partitions.items():
            if partitions is not None and partition not in partitions:
                continue
            point = progress.read[0] if progress.read else progress.last + 1
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
        oldest = now - min(progress.unanswered.values()) if progress.unanswered else 0.0
        return oldest, now - progress.moved_at

    def forget(self, partitions: Sequence[TopicPartition]) -> None:
        for partition in partitions:
            self._partitions.pop(partition, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)
