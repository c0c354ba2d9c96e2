"""Reading answers: a subscription that hands each answer to the caller once, and a plain topic reader.

:class:`AnswerSubscription` is what a downstream system runs. It reads the answer topic in a consumer
group, read_committed and typed, drops repeats by ``answer_id`` within a bounded window (an
``at_least_once`` worker repeats answers after a crash; the repeats share the ``answer_id``), and commits
an answer's offset only after the caller's loop body has finished with it, that is when the loop asks for
the next answer. So processing is at least once on the subscriber's side: an answer whose loop body did not
finish (an exception, a crash, a ``break``) is delivered again to the group's next reader.

:func:`consume_answers` is the reader for people and tests: every committed record of a topic from its
start, as JSON objects, with no group and no commits (``d3stream consume``).

Both take a ``registry`` (``d3stream_client.registry.RegistryFormat``, the ``[registry]`` extra) to read
records framed by a Schema Registry (Avro, JSON Schema) beside plain JSON ones, so a topic whose worker
switched formats reads whole. Without one nothing of the registry is imported.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from d3stream_client.connection import start_client, without
from d3stream_client.contract import Answer, decode_answer

if TYPE_CHECKING:  # imported for its type only: the registry code needs the [registry] extra
    from d3stream_client.registry import RegistryFormat

DEDUPE_WINDOW = 100_000  # answer ids remembered; repeats come within seconds of their first, after a worker restart


class RecentIds:
    """The last ``size`` ids seen, oldest forgotten first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"dedupe_window must be at least 1, got {size}")
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first_time(self, identifier: str) -> bool:
        """True the first time ``identifier`` is seen within the window."""
        if identifier in self._ids:
            self._ids.move_to_end(identifier)
            return False
        self._ids[identifier] = None
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return True


class _CommitOnRevoke(ConsumerRebalanceListener):
    """Commits what the caller has finished with before a partition moves to another reader."""

    def __init__(self, subscription: AnswerSubscription) -> None:
        self.subscription = subscription

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.subscription.commit_finished(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


class AnswerSubscription:
    """``async for answer in subscription``: typed answers of one topic, each once, committed when done.

    Use it as ``async with`` (or call ``aclose``) so the consumer leaves its group and the last finished
    offsets are committed. With a ``registry``, a framed answer that cannot be read (an unknown schema id) is
    skipped and counted like any record that is not an answer; when the registry does not answer, the loop
    gets its error and the record stays first in line, uncommitted, for the next ``__anext__``.
    """

    def __init__(self, bootstrap_servers: str, topic: str, group_id: str, *, dedupe_window: int = DEDUPE_WINDOW,
                 commit_interval_s: float = 1.0, auto_offset_reset: str = "earliest",
                 registry: RegistryFormat | None = None, **options: Any) -> None:
        self.topic = topic
        self.registry = registry
        self.recent = RecentIds(dedupe_window)
        self.commit_interval_s = commit_interval_s
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers, group_id=group_id, enable_auto_commit=False,
            isolation_level="read_committed", auto_offset_reset=auto_offset_reset,
            **without(options, "group_id", "enable_auto_commit", "isolation_level", "bootstrap_servers"))
        self._buffer: deque[tuple[TopicPartition, int, bytes | None]] = deque()
        self._handed: tuple[TopicPartition, int] | None = None  # the answer the caller's loop body has now
        self._finished: dict[TopicPartition, int] = {}  # next offset to commit, per partition
        self._last_commit = time.monotonic()
        self._started = False
        self.repeats = 0  # answers dropped as repeats of one already handed on
        self.undecodable = 0  # records of the topic that were not answers (skipped, committed)

    async def start(self) -> None:
        if not self._started:
            self.consumer.subscribe([self.topic], listener=_CommitOnRevoke(self))
            await start_client(self.consumer)
            self._started = True

    async def aclose(self) -> None:
        """Commit what the caller finished with and leave the group (the answer in hand is not finished)."""
        if self._started:
            self._started = False
            try:
                await self.commit_finished()
            finally:
                await self.consumer.stop()

    async def __aenter__(self) -> AnswerSubscription:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AnswerSubscription:
        return self

    async def __anext__(self) -> Answer:
        await self.start()
        if self._handed is not None:  # the loop asks for the next answer: its body is done with the last one
            partition, offset = self._handed
            self._finished[partition] = offset + 1
            self._handed = None
        while True:
            if time.monotonic() - self._last_commit >= self.commit_interval_s:
                await self.commit_finished()
            if not self._buffer:
                await self._fill()
                continue
            partition, offset, value = self._buffer.popleft()
            try:
                answer = await self._answer(value)
            except BaseException:  # the registry did not answer (or the loop was cancelled): read it again next
                self._buffer.appendleft((partition, offset, value))
                raise
            repeat = answer is not None and not self.recent.first_time(answer.answer_id or answer.id)
            if answer is None or repeat:
                self.repeats += repeat
                self._finished[partition] = offset + 1  # nothing for the caller to do with it
                continue
            self._handed = (partition, offset)
            return answer

    async def commit_finished(self, only: set[TopicPartition] | None = None) -> None:
        """Commit the offsets after the answers the caller has finished with (of ``only`` those partitions)."""
        self._last_commit = time.monotonic()
        owned = self.consumer.assignment()
        offsets = {tp: offset for tp, offset in self._finished.items()
                   if tp in owned and (only is None or tp in only)}
        for tp in offsets:
            del self._finished[tp]
        if only is not None:  # their records may be read by another member now: drop what this one still holds
            self._buffer = deque(item for item in self._buffer if item[0] not in only)
        if offsets:
            await self.consumer.commit(offsets)

    async def _fill(self) -> None:
        batches = await self.consumer.getmany(timeout_ms=500)
        for partition, records in batches.items():
            self._buffer.extend((partition, record.offset, record.value) for record in records)

    async def _answer(self, value: bytes | None) -> Answer | None:
        if self.registry is not None and value is not None:
            from d3stream_client.registry import UnreadableRecord

            try:
                value = await self.registry.document(value)
            except UnreadableRecord:
                self.undecodable += 1
                return None
        try:
            return decode_answer(value or b"")
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.undecodable += 1
            return None


async def consume_answers(
    bootstrap_servers: str,
    topic: str,
    *,
    expected: int | None = None,
    timeout_s: float = 60.0,
    idle_s: float | None = None,
    security: dict[str, Any] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    stop: Callable[[], bool] | None = None,
    registry: RegistryFormat | None = None,
) -> list[dict[str, Any]]:
    """Committed records of ``topic`` from the beginning as JSON objects, until ``expected`` distinct ids are
    seen, ``stop()`` says so, ``idle_s`` passes without a new record, or ``timeout_s`` passes. With a
    ``registry``, framed records are decoded with their writer schemas (``UnreadableRecord`` for one that
    cannot be, as a record that is not JSON raises too)."""
    consumer = AIOKafkaConsumer(topic, **{
        "bootstrap_servers": bootstrap_servers,
        "group_id": None,
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        "isolation_level": "read_committed",
        **(security or {}),
    })
    await start_client(consumer)
    answers: list[dict[str, Any]] = []
    seen: set[Any] = set()
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            if expected is not None and len(seen) >= expected:
                break
            if stop is not None and stop():
                break
            if idle_s is not None and time.monotonic() - last > idle_s:
                break
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    value = record.value or b"null"
                    answer = json.loads(value if registry is None else await registry.document(value))
                    answers.append(answer)
                    seen.add(answer.get("id") if isinstance(answer, dict) else None)
                    last = time.monotonic()
                    if on_record:
                        on_record(answer)
    finally:
        await consumer.stop()
    return answers
