"""A sticky partition assignor: at a rebalance, each member keeps the partitions it owns, up to its fair share.

aiokafka has only the eager rebalance protocol and, for assignors, round robin and range, which lay the
partitions out afresh at every join or leave: with four workers a fifth joining moves most partitions, not a
fifth of them (``bench fleet``: a member kept about 1 of its 3-4). A worker keeps what a rebalance hands back
(``rebalance_keep_partitions``, consume.py), so what the assignor hands back is what a rebalance does not cost.

Each member says in its JoinGroup user data which partitions it owns and in which generation it got them
(:class:`StickyAssignor` keeps that per consumer: one object per consumer, not aiokafka's class-level state).
The leader then, for members with the same subscription:

1. gives each partition to the member that claims it in the newest generation (a member that missed a
   rebalance may still claim what another owns now);
2. works out each member's share, ``floor`` or ``ceil`` of partitions over members, the larger ones going to
   the members that keep the most (fewest moves);
3. lets each member keep its claims up to its share, and deals out the rest to the members below theirs.

A group whose members subscribe to different topics gets round robin.

**It is offered under the name ``roundrobin``, as the only protocol.** aiokafka (0.14) sends one JoinGroup per
offered protocol within a join (the send sits inside its loop over the assignors: aio-libs/aiokafka#1168),
and the second, whose protocol list differs from the first, makes the broker start another rebalance: with
two protocols offered, a group of two rebalanced every few seconds for ever. One protocol avoids that; its
name keeps a group rolling from a version without this assignor (which offers aiokafka's round robin) on
one protocol the broker accepts. The assignment is the leader's either way, and any assignment that gives
every partition to one member is correct: an old leader lays the partitions out round robin (it ignores the
user data), a new one keeps what each member owns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition

if TYPE_CHECKING:
    from aiokafka.cluster import ClusterMetadata

__all__ = ["StickyAssignor", "sticky_assignment"]

Claims = dict[TopicPartition, tuple[int, str]]  # partition -> (generation, member) of its newest claim


class StickyAssignor:
    """One consumer's sticky assignor (aiokafka calls ``metadata``, ``assign`` and ``on_assignment`` on it)."""

    name = "roundrobin"  # the one protocol offered, under round robin's name: see the module's docstring
    version = 0

    def __init__(self, generation: Callable[[], int | None] = lambda: None):
        """``generation``: the group generation the consumer is in now (read when an assignment arrives)."""
        self.generation = generation
        self._owned: list[TopicPartition] = []
        self._owned_in = -1

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        owned = {topic: sorted(p.partition for p in self._owned if p.topic == topic)
                 for topic in sorted({p.topic for p in self._owned})}
        user_data = json.dumps({"generation": self._owned_in, "owned": owned}).encode()
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics), user_data)

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self._owned = [TopicPartition(topic, partition) for topic, partitions in assignment.assignment
                       for partition in partitions]
        generation = self.generation()
        self._owned_in = generation if generation is not None and generation >= 0 else self._owned_in + 1

    def assign(self, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]) -> dict[str, ConsumerProtocolMemberAssignment]:
        subscriptions = {tuple(sorted(metadata.subscription)) for metadata in members.values()}
        if len(subscriptions) != 1:
            return RoundRobinPartitionAssignor.assign(cluster, members)
        (topics,) = subscriptions
        partitions = [TopicPartition(topic, partition) for topic in topics
                      for partition in sorted(cluster.partitions_for_topic(topic) or ())]
        owned = {member: _owned(metadata.user_data) for member, metadata in members.items()}
        chosen = sticky_assignment(partitions, owned)
        return {member: ConsumerProtocolMemberAssignment(
                    self.version, [(topic, [p.partition for p in mine if p.topic == topic]) for topic in topics], b"")
                for member, mine in chosen.items()}


def _owned(user_data: bytes | None) -> tuple[int, list[TopicPartition]]:
    """(generation, partitions) a member says it owns; nothing for data it cannot read (another assignor's)."""
    try:
        said = json.loads(user_data or b"{}")
        return int(said.get("generation", -1)), [TopicPartition(topic, int(partition))
                                                 for topic, numbers in dict(said.get("owned", {})).items()
                                                 for partition in numbers]
    except (ValueError, TypeError, AttributeError):
        return -1, []


def sticky_assignment(partitions: list[TopicPartition],
                      owned: Mapping[str, tuple[int, list[TopicPartition]]]) -> dict[str, list[TopicPartition]]:
    """Each member's partitions: what it owned, up to its fair share, and its part of the rest (see the module)."""
    members = sorted(owned)
    if not members:
        return {}
    existing = set(partitions)
    claims: Claims = {}
    for member in members:
        generation, mine = owned[member]
        for partition in mine:
            if partition in existing and (partition not in claims or generation > claims[partition][0]):
                claims[partition] = (generation, member)
    claimed: dict[str, list[TopicPartition]] = {member: [] for member in members}
    for partition in partitions:
        if partition in claims:
            claimed[claims[partition][1]].append(partition)
    floor, extra = divmod(len(partitions), len(members))
    by_claims = sorted(members, key=lambda member: (-len(claimed[member]), member))
    share = {member: floor + (1 if rank < extra else 0) for rank, member in enumerate(by_claims)}
    chosen = {member: claimed[member][:share[member]] for member in members}
    taken = {partition for mine in chosen.values() for partition in mine}
    # The rest dealt out one at a time, in topic and partition order, to the members below their share in
    # turn: with several request topics each member gets some of each, as round robin gave (a busy topic
    # does not land on one worker).
    rest = [partition for partition in partitions if partition not in taken]
    wanting = [member for member in members if len(chosen[member]) < share[member]]
    turn = 0
    for partition in rest:
        member = wanting[turn % len(wanting)]
        chosen[member].append(partition)
        if len(chosen[member]) >= share[member]:
            wanting.remove(member)  # the next member in turn is now at this index
        else:
            turn += 1
    return {member: sorted(mine) for member, mine in chosen.items()}
