"""Out-of-order completion in the offset tracker: which answers may leave, what a commit's metadata says, and
what a worker taking a partition over skips, and how long a partition has waited for a commit
(d3stream/kafka/offsets.py; the broker scenarios are in tests/integration/test_ordering.py and
tests/system/test_ordering.py)."""

from __future__ import annotations

import random

import pytest
from aiokafka.structs import TopicPartition

from d3stream.kafka.offsets import (
    DEFAULT_METADATA_BYTES,
    OffsetTracker,
    decode_done,
    encode_done,
    window_offsets,
)

P = TopicPartition("requests", 0)


def test_done_offsets_round_trip_through_the_metadata_and_a_full_window_fits_the_broker_limit():
    rng = random.Random(7)
    window = window_offsets(DEFAULT_METADATA_BYTES)
    assert window == 24_480, "docs/DELIVERY.md says how many pending offsets fit"
    for _ in range(50):
        point = rng.randrange(0, 10**9)
        done = {point + 1 + rng.randrange(window) for _ in range(rng.randrange(1, 500))}
        assert decode_done(point, encode_done(point, done)) == done
    every = encode_done(0, range(1, window + 1))  # the worst case: every offset of the window done
    assert len(every.encode()) <= DEFAULT_METADATA_BYTES
    assert encode_done(5, []) == "" and encode_done(5, [3, 5]) == "", "only offsets beyond the point count"
    assert decode_done(5, "") == set() and decode_done(5, "written by another tool") == set()


def _tracker(ordering: str, keys: list[bytes | None]) -> OffsetTracker:
    tracker = OffsetTracker(ordering, record_done=True)
    tracker.add_all(P, list(range(len(keys))), keys)
    return tracker


@pytest.mark.parametrize(("ordering", "leaving"), [
    ("key", [1, 3, 4]),  # 2 waits behind 0 (key a); 5 (unkeyed) waits for the partition
    ("partition", []),  # nothing below the first unanswered offset
    ("none", [1, 2, 3, 4, 5]),
])
def test_which_answers_the_ordering_lets_leave(ordering, leaving):
    tracker = _tracker(ordering, [b"a", b"b", b"a", b"c", b"b", None])
    for offset in (1, 2, 3, 4, 5):
        tracker.done(P, offset)
    assert tracker.point(P) == 0
    assert tracker.may_leave(P, [5, 4, 3, 2, 1]) == leaving
    tracker.done(P, 0)
    assert tracker.may_leave(P, [1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5], "all answered: everything may leave"


def test_a_commit_names_the_done_offsets_beyond_its_point_except_those_held():
    tracker = _tracker("key", [b"a", b"b", b"a", b"c"])
    tracker.done(P, 1)
    tracker.done(P, 2)
    tracker.done(P, 3)
    # 2 is held (its key waits behind 0): its answer is not out, so the commit must not claim it.
    ((point, metadata),) = tracker.commit_offsets([P], held={P: {2}}).values()
    assert point == 0 and decode_done(0, metadata) == {1, 3}
    tracker.committed({P: (point, metadata)})
    assert tracker.commit_offsets([P], held={P: {2}}) == {}, "nothing changed since"
    tracker.done(P, 0)
    assert tracker.commit_offsets([P]) == {P: (4, "")}


def test_a_new_owner_skips_what_the_metadata_names_and_keeps_naming_it_until_the_point_passes():
    previous = _tracker("key", [b"k"] * 6)
    for offset in (2, 4, 5):
        previous.done(P, offset)
    ((point, metadata),) = previous.commit_offsets([P]).values()
    assert point == 0

    owner = OffsetTracker("key", record_done=True)
    owner.inherit(P, point, metadata)
    epoch, answered = owner.add_all(P, [0, 1, 2], [b"k"] * 3)
    assert answered == {2}, "offset 2 was answered by the previous owner"
    assert owner.in_flight() == 2
    # Offsets 4 and 5 are not read yet, and are still named, so a crash now loses no record of them.
    ((_, kept),) = owner.commit_offsets([P]).values()
    assert decode_done(0, kept) == {2, 4, 5}
    _, answered = owner.add_all(P, [3, 4, 5], [b"k"] * 3)
    assert answered == {4, 5}
    for offset in (0, 1, 3):
        owner.done(P, offset)
    assert owner.commit_offsets([P]) == {P: (6, "")}, "all passed: the plain commit point again"


def test_a_partition_read_as_far_as_the_metadata_can_speak_for_is_full():
    tracker = OffsetTracker("key", record_done=True, metadata_bytes=64)
    window = tracker.window
    assert window == window_offsets(64) == 288
    tracker.add_all(P, list(range(window)), [b"k%d" % n for n in range(window)])
    assert not tracker.window_full(P)
    tracker.add(P, window, b"last")
    assert tracker.window_full(P), "the oldest request holds the point at 0"
    tracker.done(P, 0)
    assert not tracker.window_full(P)
    for offset in range(1, window + 1):
        tracker.done(P, offset)
    ((point, metadata),) = tracker.commit_offsets([P]).values()
    assert (point, metadata) == (window + 1, "")
    assert OffsetTracker().window is None, "a replay's tracker has no window: it commits the point alone"


def test_a_replay_tracker_keeps_offset_order_and_writes_no_metadata():
    tracker = OffsetTracker()
    tracker.add_all(P, [0, 1, 2], [b"a", b"b", b"c"])
    tracker.done(P, 2)
    tracker.inherit(P, 0, encode_done(0, [1]))
    assert tracker.may_leave(P, [2]) == []
    assert tracker.commit_offsets([P]) == {}
    tracker.done(P, 0)
    assert tracker.commit_offsets([P]) == {P: (1, "")}


def test_nothing_past_the_window_may_be_read():
    tracker = OffsetTracker("key", record_done=True, metadata_bytes=64)
    assert tracker.read_limit(P, 100) == 100 + 288, "nothing read yet: the window starts at the fetch"
    tracker.add_all(P, [100, 101], [b"a", b"b"])
    tracker.done(P, 101)
    assert tracker.read_limit(P, 102) == 100 + 288, "the point stays at the oldest unanswered offset"
    assert OffsetTracker().read_limit(P, 0) is None


def test_an_inherited_partition_commits_nothing_before_it_reads():
    tracker = OffsetTracker("key", record_done=True)
    tracker.inherit(P, 500, encode_done(500, [502, 503]))
    assert tracker.commit_offsets() == {}, "committing before reading would move the group's offset back to 0"
    _, answered = tracker.add_all(P, [500, 501, 502], [b"a", b"b", b"c"])
    assert answered == {502}
    ((point, metadata),) = tracker.commit_offsets().values()
    assert point == 500 and decode_done(500, metadata) == {502, 503}


pytestmark = pytest.mark.timeout(300)


def test_the_tracker_times_a_stall_from_the_arrival_of_work_to_the_next_commit(monkeypatch):
    from d3stream.kafka import offsets

    clock = [1000.0]
    monkeypatch.setattr(offsets.time, "monotonic", lambda: clock[0])
    tracker = offsets.OffsetTracker()
    assert tracker.stall("p") == (0.0, 0.0) and tracker.commit_base("p") is None
    tracker.add("p", 10)
    clock[0] += 2
    tracker.add("p", 11)
    clock[0] += 3
    assert tracker.stall("p") == (5.0, 5.0)
    assert tracker.commit_base("p") == 10, "nothing committed yet: the group's offset is where reading began"
    tracker.done("p", 10)
    assert tracker.stall("p") == (3.0, 5.0), "the oldest unanswered one is now offset 11"
    tracker.done("p", 11)
    clock[0] += 1
    assert tracker.stall("p") == (0.0, 6.0), "answered but not committed is still waiting"
    tracker.committed(tracker.committable())
    assert tracker.stall("p") == (0.0, 0.0) and tracker.commit_base("p") == 12
    clock[0] += 100  # a quiet spell, then work: the stall counts from its arrival, not from the last commit
    tracker.add("p", 12)
    clock[0] += 1
    assert tracker.stall("p") == (1.0, 1.0)
