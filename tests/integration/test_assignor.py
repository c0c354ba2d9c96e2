"""The serve group's sticky assignor (kafka/assignor.py) on the real broker: a group of d3stream members settles
on one generation (aiokafka sends a JoinGroup per offered protocol, which rebalanced a group offering two for
ever), and a member of an older version offering aiokafka's round robin joins the same group."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

from d3stream.kafka.consume import group_consumer, group_generation
from tests.support.stream_helpers import run

pytestmark = pytest.mark.timeout(120)


async def _settled(consumers: list[AIOKafkaConsumer], partitions: int, what: str) -> None:
    """Poll every member until their assignments cover the topic's partitions, each once."""
    for _ in range(600):
        await asyncio.gather(*(consumer.getmany(timeout_ms=50) for consumer in consumers))
        owned = [tp for consumer in consumers for tp in consumer.assignment()]
        if len(owned) == partitions and len(set(owned)) == partitions and all(c.assignment() for c in consumers):
            return
    raise AssertionError(f"{what}: never settled; owned {[sorted(c.assignment()) for c in consumers]}")


@contextlib.asynccontextmanager
async def _members(topic: str, *consumers: AIOKafkaConsumer) -> AsyncIterator[None]:
    """The consumers subscribed to ``topic`` and started, in order; all stopped at the end."""
    try:
        for consumer in consumers:
            consumer.subscribe([topic])
            await consumer.start()
        yield
    finally:
        for consumer in consumers:
            await consumer.stop()


async def _poll_for(consumers: list[AIOKafkaConsumer], seconds: float) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.gather(*(consumer.getmany(timeout_ms=100) for consumer in consumers))


def test_members_settle_on_one_generation_and_a_leave_hands_on_only_the_leavers_partitions(stack):
    settings = stack.settings(session_timeout_ms=6000)

    async def scenario() -> None:
        members = [group_consumer(settings.connection, settings.delivery, client_suffix=f"-{n}") for n in range(3)]
        async with _members(stack.requests, *members):
            await _settled(members, 4, "three members")
            generation = group_generation(members[0])
            # Longer than the heartbeat (3 s) twice: a group that rebalances for ever moves on in that time.
            await _poll_for(members, 8)
            assert {group_generation(member) for member in members} == {generation}
            held = [set(member.assignment()) for member in members]
            leaving = min(range(3), key=lambda n: (len(held[n]), n))  # one with a single partition
            await members[leaving].stop()
            staying = [member for n, member in enumerate(members) if n != leaving]
            await _settled(staying, 4, "the two left")
            for n, member in enumerate(members):
                if n != leaving:
                    assert held[n] <= set(member.assignment()), f"member {n} lost partitions of its own"

    run(scenario())


def test_a_member_offering_round_robin_joins_the_same_group(stack):
    settings = stack.settings(session_timeout_ms=6000)

    async def scenario() -> None:
        ours = group_consumer(settings.connection, settings.delivery)
        older = AIOKafkaConsumer(bootstrap_servers=stack.broker.bootstrap_servers, group_id=settings.delivery.group_id,
                                 enable_auto_commit=False, session_timeout_ms=6000,
                                 partition_assignment_strategy=(RoundRobinPartitionAssignor,))
        async with _members(stack.requests, ours, older):
            await _settled([ours, older], 4, "a d3stream member and one offering round robin")
            generation = group_generation(ours)
            await _poll_for([ours, older], 8)
            assert group_generation(ours) == generation, "the mixed group kept rebalancing"
            assert len(ours.assignment()) == len(older.assignment()) == 2

    run(scenario())
