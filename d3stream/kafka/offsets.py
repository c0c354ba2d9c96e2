"""Which consumed offsets are done, which answers may leave, and what a commit says about both.

Requests of one partition finish out of order (a text request overtakes a video). Kafka commits one offset per
partition: the *commit point*, the first offset not yet answered. ``OffsetTracker`` keeps, per assigned
partition, the offsets in flight in read order, the commit point, how long it has stood still (for the stall
gauges and readiness), and each assignment's number (its *epoch*), so that work begun before a revocation is
never committed after the partition comes back.

Out-of-order completion (the ``ordering`` setting; Confluent's Parallel Consumer is the model). An answer
may leave as soon as it is ready, before the offsets below it are answered, when the ordering allows it:

* ``key`` (the default): unless an earlier offset with the same record key is still unanswered, so answers to
  one key leave in their offset order and other keys pass them;
* ``none``: always;
* ``partition``: only below the commit point (every earlier offset answered), as before out-of-order existed.

The commit then carries, beside the commit point, the offsets beyond it whose answers are out, as a bitset in
the offset commit's metadata string (:func:`encode_done`). A worker that takes the partition over (after a
crash, a rebalance, a restart) reads that metadata (:meth:`OffsetTracker.inherit`) and skips those offsets, so
their answers are neither lost (they committed with the metadata, in one transaction under ``exactly_once``)
nor repeated. The metadata is bounded by the broker's ``offset.metadata.max.bytes`` (4 KB by default): a
partition whose read offsets reach past the commit point by as many offsets as its bitset can hold is not
read further (:meth:`OffsetTracker.window_full`) until the commit point moves.

A partition's ``Progress`` is a part of its ``PartitionWork`` (partitions.py). The tracker holds the
``Partitions`` registry of the worker, which the assignment and the commit policy share, so everything about
one partition is in one object.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Collection, Iterable, MutableMapping, Sequence

from aiokafka.structs import TopicPartition

from d3stream.kafka.partitions import Partitions, Progress
from d3stream.settings import Ordering

# The metadata of a commit with done offsets beyond its point: this prefix, then the base64 of a bitset whose
# bit i (least significant first in each byte) says whether offset point + 1 + i is done.
DONE_PREFIX = "d3stream-done/1:"
DEFAULT_METADATA_BYTES = 4096  # Kafka's offset.metadata.max.bytes default


def window_offsets(metadata_bytes: int) -> int:
    """How many offsets past the commit point a commit's metadata of ``metadata_bytes`` can speak for."""
    return max(0, (metadata_bytes - len(DONE_PREFIX)) // 4 * 3 * 8)


def encode_done(point: int, done: Iterable[int]) -> str:
    """The commit metadata for ``done`` offsets beyond ``point`` ("" for none)."""
    beyond = sorted(offset - point - 1 for offset in done if offset > point)
    if not beyond:
        return ""
    bits = bytearray(beyond[-1] // 8 + 1)
    for index in beyond:
        bits[index // 8] |= 1 << (index % 8)
    return DONE_PREFIX + base64.b64encode(bytes(bits)).decode("ascii")


def decode_done(point: int, metadata: str | None) -> set[int]:
    """The done offsets beyond ``point`` a commit's metadata names (none for metadata not written here)."""
    if not metadata or not metadata.startswith(DONE_PREFIX):
        return set()
    try:
        bits = base64.b64decode(metadata[len(DONE_PREFIX):], validate=True)
    except ValueError:
        return set()
    return {point + 1 + 8 * position + bit for position, byte in enumerate(bits) for bit in range(8)
            if byte >> bit & 1}


class OffsetTracker:
    """Per partition: which offsets are in flight, the commit point, and the done offsets beyond it.

    ``ordering`` says which answers may leave before the commit point reaches them; with ``record_done`` the
    commits carry the done offsets beyond their point in their metadata (live serving; a replay commits the
    point alone). ``metadata_bytes`` bounds that metadata.
    """

    def __init__(self, ordering: Ordering = "partition", *, record_done: bool = False,
                 metadata_bytes: int = DEFAULT_METADATA_BYTES, works: Partitions | None = None) -> None:
        self.ordering = ordering
        self.record_done = record_done
        self.window = window_offsets(metadata_bytes) if record_done else None
        # Every partition's work (partitions.py), shared with the assignment and the commit policy: the tracker
        # keeps each one's progress in it.
        self.works = works if works is not None else Partitions()
        self._partitions: MutableMapping[TopicPartition, Progress] = self.works.view("progress")
        self._epochs = 0

    def _progress(self, partition: TopicPartition) -> Progress:
        progress = self._partitions.get(partition)
        if progress is None:
            self._epochs += 1
            progress = self._partitions[partition] = Progress(epoch=self._epochs)
        return progress

    def inherit(self, partition: TopicPartition, committed: int | None, metadata: str | None) -> None:
        """The partition's commit as this worker found it on assignment: offsets its metadata names as done are
        skipped when read (``add_all``) and named again in this worker's commits until the point passes them."""
        if committed is None:
            return
        progress = self._progress(partition)
        # The group's commit as found: the last one this worker knows of until it commits itself (a rebalance
        # that hands the partition back checks the group still holds it: consume.py).
        progress.found = (committed, metadata or "")
        if self.record_done:
            progress.inherited = decode_done(committed, metadata)

    def add(self, partition: TopicPartition, offset: int, key: bytes | None = None) -> int:
        """Track an offset read from ``partition``; returns the assignment epoch its work belongs to."""
        epoch, _ = self.add_all(partition, [offset], [key])
        return epoch

    def add_all(self, partition: TopicPartition, offsets: Sequence[int],
                keys: Sequence[bytes | None] | None = None) -> tuple[int, set[int]]:
        """Track offsets read from ``partition`` (in read order); returns the assignment epoch their work belongs
        to, and those of them an earlier owner answered already (done at once: not to be served again)."""
        progress = self._progress(partition)
        if not offsets:
            return progress.epoch, set()
        now = time.monotonic()
        if not progress.waiting():
            progress.moved_at = now  # a stall is counted from when work arrived
        if progress.first is None:
            progress.first = offsets[0]
        progress.read.extend(offsets)
        answered = progress.inherited.intersection(offsets)
        for index, offset in enumerate(offsets):
            progress.keys[offset] = keys[index] if keys is not None else None
            if offset not in answered:
                progress.unanswered[offset] = now
        progress.last = max(progress.last, max(offsets))
        self._advance(progress)
        return progress.epoch, answered

    def owns(self, partition: TopicPartition, epoch: int | None = None) -> bool:
        """Whether the partition is (still) assigned, and with ``epoch``, in that same assignment: work
        begun before a revocation must not be committed after the partition comes back."""
        progress = self._partitions.get(partition)
        return progress is not None and (epoch is None or progress.epoch == epoch)

    def done(self, partition: TopicPartition, offset: int, epoch: int | None = None) -> None:
        if not self.owns(partition, epoch):
            return  # revoked meanwhile: not ours to commit any more
        progress = self._partitions[partition]
        if progress.unanswered.pop(offset, None) is None:
            return
        self._advance(progress)

    @staticmethod
    def _advance(progress: Progress) -> None:
        read = progress.read
        while read and read[0] not in progress.unanswered:
            progress.keys.pop(read.popleft(), None)
        point = progress.point()
        if progress.inherited and min(progress.inherited) < point:
            progress.inherited = {offset for offset in progress.inherited if offset >= point}

    def in_flight(self, partitions: Sequence[TopicPartition] | None = None) -> int:
        chosen = self._partitions if partitions is None else {p: self._partitions.get(p) for p in partitions}
        return sum(len(p.unanswered) for p in chosen.values() if p is not None)

    def point(self, partition: TopicPartition) -> int:
        """The partition's commit point: its first offset not answered."""
        return self._partitions[partition].point()

    def may_leave(self, partition: TopicPartition, offsets: Collection[int]) -> list[int]:
        """Of these answered offsets, in offset order, those whose answers the ordering lets leave now."""
        progress = self._partitions.get(partition)
        if progress is None:
            return []
        point = progress.point()
        ordered = sorted(offsets)
        if self.ordering == "none":
            return ordered
        if self.ordering == "partition" or not progress.unanswered:
            return [offset for offset in ordered if offset < point]
        first_unanswered: dict[bytes, int] = {}  # per key, its first offset still unanswered
        for offset in progress.unanswered:
            key = progress.keys.get(offset)
            if key is not None and offset < first_unanswered.get(key, offset + 1):
                first_unanswered[key] = offset
        allowed = []
        for offset in ordered:
            key = progress.keys.get(offset)
            # A record without a key has no order to keep but the partition's.
            blocker = point if key is None else first_unanswered.get(key, offset + 1)
            if offset < point or offset < blocker:
                allowed.append(offset)
        return allowed

    def commit_offsets(self, partitions: Sequence[TopicPartition] | None = None, *,
                       held: dict[TopicPartition, Collection[int]] | None = None,
                       changed_only: bool = True) -> dict[TopicPartition, tuple[int, str]]:
        """(commit point, metadata) per partition to commit: the point, and with ``record_done`` the done offsets
        beyond it whose answers are out (all done ones but ``held``'s). Only those that changed since the last
        commit, with ``changed_only``."""
        result = {}
        for partition, progress in self._partitions.items():
            if partitions is None and progress.held:
                continue
            if partitions is not None and partition not in partitions:
                continue
            if progress.first is None:
                continue  # nothing read in this assignment: the group's commit stands as it is
            point = progress.point()
            metadata = ""
            if self.record_done:
                kept = held.get(partition, ()) if held else ()
                done = [offset for offset in progress.read if offset not in progress.unanswered
                        and offset not in kept]
                metadata = encode_done(point, [*done, *progress.inherited])
            # Offset 0 is worth committing only with done offsets beyond it (nothing was read before it).
            if (point > 0 or metadata) and (not changed_only or point != progress.committed
                                            or metadata != progress.committed_metadata):
                result[partition] = (point, metadata)
        return result

    def committable(self, partitions: Sequence[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Next offset to read, per partition whose commit point moved since the last commit."""
        return {partition: point for partition, (point, _) in self.commit_offsets(partitions).items()
                if point != self._partitions[partition].committed}

    def committed(self, offsets: dict[TopicPartition, int] | dict[TopicPartition, tuple[int, str]]) -> None:
        now = time.monotonic()
        for partition, value in offsets.items():
            progress = self._partitions.get(partition)
            if progress is None:
                continue
            point, metadata = value if isinstance(value, tuple) else (value, "")
            if point != progress.committed:
                progress.moved_at = now
            progress.committed, progress.committed_metadata = point, metadata

    def read_limit(self, partition: TopicPartition, first: int) -> int | None:
        """The last offset of the partition that may be read now (None: no limit), ``first`` being the first
        offset of a fetch: as far past the commit point as a commit's metadata can speak for."""
        if self.window is None:
            return None
        progress = self._partitions.get(partition)
        point = progress.point() if progress is not None and progress.last >= 0 else first
        return point + self.window

    def window_full(self, partition: TopicPartition) -> bool:
        """Whether the partition's read offsets reach as far past its commit point as a commit's metadata can
        speak for: it must not be read further until the point moves."""
        progress = self._partitions.get(partition)
        if self.window is None or progress is None:
            return False
        return progress.last - progress.point() >= self.window

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

    def last_commit(self, partition: TopicPartition) -> tuple[int, str] | None:
        """The partition's last commit this worker knows of (point, metadata): its own last one, else the one
        it found on assignment; None for a partition never committed."""
        progress = self._partitions.get(partition)
        if progress is None:
            return None
        if progress.committed is not None:
            return progress.committed, progress.committed_metadata
        return progress.found

    def forget(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop the partitions' progress: work read before is never committed (a later read starts an epoch)."""
        for partition in partitions:
            self._partitions.pop(partition, None)

    def hold(self, partitions: Iterable[TopicPartition]) -> None:
        """Leave ``partitions`` out of the periodic commit (a rebalance revoked them; they may come back)."""
        for partition in partitions:
            if (progress := self._partitions.get(partition)) is not None:
                progress.held = True

    def held(self, partition: TopicPartition) -> bool:
        """Whether a rebalance holds the partition (revoked, kept until the assignment says whether it stays)."""
        progress = self._partitions.get(partition)
        return progress is not None and progress.held

    def release(self, partitions: Iterable[TopicPartition]) -> None:
        """``partitions`` came back: the periodic commit covers them again."""
        for partition in partitions:
            if (progress := self._partitions.get(partition)) is not None:
                progress.held = False

    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)

    def committing(self) -> list[TopicPartition]:
        """The partitions the periodic commit covers: every tracked one but those a rebalance holds."""
        return [partition for partition, progress in self._partitions.items() if not progress.held]
