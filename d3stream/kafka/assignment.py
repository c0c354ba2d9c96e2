"""What one rebalance gave this worker: its partitions, why each is paused, which are still settling.

A partition may be held back for several reasons at once (``PauseReason``): backpressure (the work in flight
is at a limit), a tenant's quota (a request of the partition waits for its tenant), the read window (the
partition was read as far past its commit point as a commit's metadata can name) and settling (newly
assigned, not yet positioned at its stable committed offset). Each ``PartitionState`` keeps the set of its
reasons: the first reason pauses the partition in the consumer, and only the last one going resumes it, so
no path that lets one reason go has to ask after the others. (aiokafka's ``TopicPartitionState`` and Quix
Streams' ``PartitionBuffer.pause()`` are the models.) A partition's ``PartitionState`` is a part of its
``PartitionWork`` (partitions.py), beside its progress and transactions.

An ``Assignment`` is made by the rebalance listener when partitions are assigned and ended when they are
revoked (consume.py); the consume loop and the callbacks act on the one current. A new assignment starts
unpaused, as aiokafka's own partition states do (it makes fresh ones on every assignment).

Which assignment a record was read in, for telling a late completion from work of the current one, is not
the assignment object's business but the ``OffsetTracker``'s epoch (offsets.py): a partition whose producer
was fenced is forgotten by the tracker and gets a new epoch without any rebalance, and work read before that
must not be committed after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition

from d3stream.kafka.partitions import Partitions, PartitionState, PauseReason

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer


class Assignment:
    """The partitions of one assignment and their states; whether backpressure is on; what was revoked."""

    def __init__(self, consumer: AIOKafkaConsumer, partitions: Iterable[TopicPartition] = (),
                 generation: int | None = None, *, works: Partitions | None = None):
        self.consumer = consumer
        self.generation = generation  # the group generation that gave it (None: assigned by hand, or none yet)
        # Each partition's pause state is a part of its work (partitions.py); a new assignment starts them afresh.
        self.states: MutableMapping[TopicPartition, PartitionState] = (
            works if works is not None else Partitions()).view("pauses")
        self.states.clear()
        for partition in partitions:
            self.state(partition)
        self.backpressure = False  # on until the work in flight drains (consume.py)
        self.revoked: list[TopicPartition] = []  # what its end took away
        self.ended = False

    def state(self, partition: TopicPartition) -> PartitionState:
        """The partition's state (a partition the consumer holds without a listener call: made on first use)."""
        state = self.states.get(partition)
        if state is None:
            state = self.states[partition] = PartitionState(partition, self.consumer)
        return state

    def carry(self, previous: PartitionState) -> None:
        """A partition kept through a rebalance (consume.py): it stays held for the reasons it was, but settling
        (aiokafka made a fresh, unpaused state for it)."""
        state = self.state(previous.partition)
        for reason in previous.reasons - {PauseReason.SETTLING}:
            state.pause(reason)

    def paused_for(self, reason: PauseReason) -> set[TopicPartition]:
        """The partitions ``reason`` holds."""
        return {partition for partition, state in self.states.items() if reason in state.reasons}

    def pause(self, partitions: Iterable[TopicPartition], reason: PauseReason) -> list[TopicPartition]:
        """Hold ``partitions`` for ``reason``; those it did not hold before."""
        return [partition for partition in partitions if self.state(partition).pause(reason)]

    def resume(self, partitions: Iterable[TopicPartition], reason: PauseReason) -> list[TopicPartition]:
        """Let ``reason`` go for ``partitions``; those it held."""
        return [partition for partition in partitions
                if (state := self.states.get(partition)) is not None and state.resume(reason)]

    # ---------------------------------------------------------------------------------- settling

    def settling(self) -> dict[TopicPartition, asyncio.Task[None]]:
        """The partitions still settling, and the task settling each."""
        return {partition: state.settling for partition, state in self.states.items() if state.settling is not None}

    def is_settling(self, partition: TopicPartition) -> bool:
        state = self.states.get(partition)
        return state is not None and state.settling is not None

    def begin_settling(self, partitions: list[TopicPartition],
                       settle: Callable[[list[TopicPartition]], Coroutine[Any, Any, None]]) -> None:
        """Hold ``partitions`` paused while one task runs ``settle`` on them."""
        if not partitions:
            return
        self.pause(partitions, PauseReason.SETTLING)
        task = asyncio.create_task(settle(partitions))
        for partition in partitions:
            self.state(partition).settling = task

    def skipped_while_settling(self, partition: TopicPartition, offset: int) -> None:
        """A record of a settling partition was fetched anyway: the partition is read from there at the latest."""
        state = self.state(partition)
        state.skipped = offset if state.skipped is None else min(state.skipped, offset)

    def take_skipped(self, partition: TopicPartition) -> int | None:
        """The first offset fetched (and dropped) while the partition settled, if any; forgotten here."""
        state = self.states.get(partition)
        if state is None:
            return None
        skipped, state.skipped = state.skipped, None
        return skipped

    def settled(self, partitions: Iterable[TopicPartition], task: asyncio.Task[None] | None) -> list[TopicPartition]:
        """``task`` finished settling ``partitions``: those it still settled are read again (unless another
        reason holds them); returns them."""
        settled = [partition for partition in partitions
                   if (state := self.states.get(partition)) is not None and state.settling is task]
        for partition in settled:
            self.states[partition].settling = None
        self.resume(settled, PauseReason.SETTLING)
        return settled

    async def stop_settling(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Cancel the settling of ``partitions`` (or all) and wait until it has stopped."""
        chosen = list(self.states) if partitions is None else partitions
        tasks = set()
        for partition in chosen:
            state = self.states.get(partition)
            if state is None:
                continue
            if state.settling is not None:
                tasks.add(state.settling)
            state.settling, state.skipped = None, None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # ----------------------------------------------------------------------------------- the end

    def end(self, revoked: Iterable[TopicPartition]) -> None:
        """The rebalance took ``revoked`` away: their states go, and backpressure is off (the next assignment
        starts unpaused)."""
        self.revoked = list(revoked)
        for partition in self.revoked:
            self.states.pop(partition, None)
        self.backpressure = False
        self.resume(list(self.states), PauseReason.BACKPRESSURE)  # aiokafka revokes all: normally none is left
        self.ended = True
