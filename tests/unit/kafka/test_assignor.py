"""The sticky assignor (d3stream/kafka/assignor.py) without a broker: a join or a leave moves only what it must,
every partition goes to exactly one member, and shares differ by one at most."""

from __future__ import annotations

from types import SimpleNamespace

from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.structs import TopicPartition

from d3stream.kafka.assignor import StickyAssignor, sticky_assignment

PARTITIONS = [TopicPartition("requests", n) for n in range(12)]


def _checked(chosen: dict[str, list[TopicPartition]], partitions: list[TopicPartition]) -> dict[str, list[TopicPartition]]:
    given = [partition for mine in chosen.values() for partition in mine]
    assert sorted(given) == sorted(partitions), "a partition given twice, or to no one"
    sizes = [len(mine) for mine in chosen.values()]
    assert max(sizes) - min(sizes) <= 1, chosen
    return chosen


def _owned(chosen: dict[str, list[TopicPartition]], generation: int) -> dict[str, tuple[int, list[TopicPartition]]]:
    return {member: (generation, mine) for member, mine in chosen.items()}


def test_a_member_joining_takes_only_its_share_from_the_others() -> None:
    four = _checked(sticky_assignment(PARTITIONS, {m: (-1, []) for m in "abcd"}), PARTITIONS)
    five = _checked(sticky_assignment(PARTITIONS, {**_owned(four, 1), "e": (-1, [])}), PARTITIONS)
    moved = [p for member in "abcd" for p in four[member] if p not in five[member]]
    assert len(moved) == len(five["e"]) == 2, (four, five)  # round robin moved most of them


def test_a_member_leaving_hands_only_its_own_partitions_on() -> None:
    four = _checked(sticky_assignment(PARTITIONS, {m: (-1, []) for m in "abcd"}), PARTITIONS)
    three = _checked(sticky_assignment(PARTITIONS, {m: owned for m, owned in _owned(four, 1).items() if m != "d"}),
                     PARTITIONS)
    for member in "abc":
        assert set(four[member]) <= set(three[member])


def test_the_newest_claim_wins_and_unknown_partitions_are_not_given() -> None:
    stale = (3, PARTITIONS[:6] + [TopicPartition("requests", 99)])  # missed a rebalance; 99 no longer exists
    current = (4, PARTITIONS[3:6])
    chosen = _checked(sticky_assignment(PARTITIONS, {"a": stale, "b": current}), PARTITIONS)
    assert set(PARTITIONS[3:6]) <= set(chosen["b"]) and set(PARTITIONS[:3]) <= set(chosen["a"])


def test_the_assignor_round_trips_what_a_member_owns_through_its_join_metadata() -> None:
    cluster = SimpleNamespace(partitions_for_topic=lambda topic: set(range(12)) if topic == "requests" else None)
    generations = iter([1, 2])
    assignors = {member: StickyAssignor(generation=lambda: next(generations, 3)) for member in "ab"}
    first = assignors["a"].assign(cluster, {m: a.metadata(["requests"]) for m, a in assignors.items()})  # type: ignore[arg-type]
    for member, assignment in first.items():
        assignors[member].on_assignment(ConsumerProtocolMemberAssignment.decode(assignment.encode()))
    assignors["c"] = StickyAssignor()
    second = assignors["a"].assign(cluster, {m: a.metadata(["requests"]) for m, a in assignors.items()})  # type: ignore[arg-type]
    kept = {member: set(first[member].partitions()) & set(second[member].partitions()) for member in "ab"}
    assert [len(kept[m]) for m in "ab"] == [4, 4] and len(second["c"].partitions()) == 4


def test_members_that_subscribe_differently_get_round_robin() -> None:
    cluster = SimpleNamespace(partitions_for_topic=lambda topic: {0, 1})
    a, b = StickyAssignor(), StickyAssignor()
    chosen = a.assign(cluster, {"a": a.metadata(["x"]), "b": b.metadata(["x", "y"])})  # type: ignore[arg-type]
    assert sorted(p for m in chosen.values() for p in m.partitions()) == [("x", 0), ("x", 1), ("y", 0), ("y", 1)]


def test_new_members_get_some_of_each_request_topic() -> None:
    partitions = [TopicPartition(topic, n) for topic in ("high", "low") for n in range(4)]
    chosen = _checked(sticky_assignment(partitions, {m: (-1, []) for m in "ab"}), partitions)
    for mine in chosen.values():
        assert {p.topic for p in mine} == {"high", "low"}, chosen
