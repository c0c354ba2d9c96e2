"""Request-reply over Kafka: publish a request and wait for its one answer.

Answers are keyed by request id, so each lands on the answer partition murmur2 of the id chooses
(``connection.partition_for``). :class:`AnswerWaiter` keeps one consumer per process with no consumer
group, assigned only the answer partitions that asks are waiting on, read_committed. An ask starts
reading its partition (from its end) before the request is published, so its answer cannot be missed,
and matches answers by id and by the request record they name in ``source``, so an answer to an older
request with the same id never resolves it. An answer repeated by an ``at_least_once`` worker finds the
ask already resolved and is ignored. Thousands of concurrent asks share the one consumer.

With a ``registry`` (``d3stream_client.registry.RegistryFormat``), answers framed by a Schema Registry are
read with their writer schemas, plain JSON ones as before; a registry that does not answer is waited out, since
the answer an ask waits for may be the record at hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from d3stream_client.connection import partition_for, start_client, without
from d3stream_client.contract import Answer, decode_answer
from d3stream_client.publisher import Published

if TYPE_CHECKING:  # imported for its type only: the registry code needs the [registry] extra
    from d3stream_client.registry import RegistryFormat

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long one read waits for answers before the assignment may change (an ask for a new partition waits
# at most this long to be let in).
POLL_MS = 100
# The longest wait between tries while the Schema Registry does not answer.
REGISTRY_BACKOFF_MAX_S = 5.0


class AskTimeout(TimeoutError):
    """No answer arrived in time. ``published`` says where the request is; the message says what is known
    of the worker group's progress on it."""

    def __init__(self, message: str, published: Published | None) -> None:
        super().__init__(message)
        self.published = published


@dataclass
class _Ask:
    """One waiting ask: its answer's future, and the request record an answer must name."""

    future: asyncio.Future[Answer]
    source: Published | None = None
    early: list[Answer] = field(default_factory=list)  # answers read before the publish reported its offset

    def offer(self, answer: Answer) -> None:
        if self.future.done():
            return  # answered already: this is a repeat
        if self.source is None:
            self.early.append(answer)
            return
        named = answer.source
        if (named.topic, named.partition, named.offset) == (self.source.topic, self.source.partition,
                                                            self.source.offset):
            self.future.set_result(answer)

    def landed(self, published: Published) -> None:
        self.source = published
        early, self.early = self.early, []
        for answer in early:
            self.offer(answer)


class AnswerWaiter:
    """The one consumer of the answer topic that all asks of a process share."""

    def __init__(self, bootstrap_servers: str, answer_topic: str, *, partitions: Callable[[str], Awaitable[int]],
                 worker_group: str = "d3stream", registry: RegistryFormat | None = None, **options: Any) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.answer_topic = answer_topic
        self.worker_group = worker_group
        self.registry = registry
        self.options = without(options, "group_id", "enable_auto_commit", "isolation_level", "bootstrap_servers")
        self._partitions = partitions  # the answer topic's partition count, from the caller's metadata
        self._answer_partitions: int | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._reading = asyncio.Lock()  # held by each read, and by a change of the assignment between reads
        # Partitions read from a known position: assigned *and* sought to their end. An ask may publish only
        # once its partition is in here; assigned alone, the position might still land after its answer.
        self._positioned: set[TopicPartition] = set()
        self._waiting: dict[str, list[_Ask]] = {}
        self.undecodable = 0  # records of the answer topic that were not answers

    async def ask(self, request_id: str, publish: Callable[[], Awaitable[Published]], timeout: float) -> Answer:
        """Read the request's answer partition, then ``publish()`` it, then wait for its answer."""
        await self._read_partition(await self.answer_partition(request_id))
        pending = _Ask(asyncio.get_running_loop().create_future())
        self._waiting.setdefault(request_id, []).append(pending)
        try:
            pending.landed(await publish())
            async with asyncio.timeout(timeout):
                return await pending.future
        except TimeoutError:
            raise AskTimeout(await self._explain_timeout(request_id, pending.source, timeout), pending.source) from None
        finally:
            asks = self._waiting.get(request_id, [])
            if pending in asks:
                asks.remove(pending)
            if not asks:
                self._waiting.pop(request_id, None)

    async def answer_partition(self, request_id: str) -> int:
        if self._answer_partitions is None:
            self._answer_partitions = await self._partitions(self.answer_topic)
        return partition_for(request_id.encode(), self._answer_partitions)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        self._positioned.clear()

    async def _read_partition(self, partition: int) -> None:
        """Make sure the consumer reads ``partition`` from at least where its end is now."""
        wanted = TopicPartition(self.answer_topic, partition)
        if wanted in self._positioned:
            return
        async with self._reading:
            consumer = await self._started()
            assigned = consumer.assignment()
            if wanted in self._positioned:
                return
            # assign() replaces the assignment and forgets positions: keep those of the partitions already read.
            positions = {tp: await consumer.position(tp) for tp in assigned}
            consumer.assign([*assigned, wanted])
            for tp, offset in positions.items():
                consumer.seek(tp, offset)
            await consumer.seek_to_end(wanted)
            await consumer.position(wanted)  # resolved now, before the request is published
            self._positioned.add(wanted)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="d3stream-client-answers")

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers, group_id=None,
                                        enable_auto_commit=False, isolation_level="read_committed", **self.options)
            await start_client(consumer)
            self._consumer = consumer
        return self._consumer

    async def _read(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while True:
            try:
                async with self._reading:
                    batches = await consumer.getmany(timeout_ms=POLL_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broker hiccup must not end the reads every ask waits on
                log.warning("reading answers failed; retrying: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(POLL_MS / 1000)
                continue
            for records in batches.values():
                for record in records:
                    value = record.value
                    if self.registry is not None and value is not None:
                        value = await self._unframed(value)
                        if value is None:  # framed and unreadable: counted already
                            continue
                    self._offer(value)
            await asyncio.sleep(0)  # let a waiting change of the assignment take the lock

    async def _unframed(self, value: bytes) -> bytes | None:
        """An answer record's JSON document through the registry (a plain one as it is); None, counted as
        undecodable, when it is framed and cannot be read. Retried while the registry does not answer."""
        from d3stream_client.registry import UnreadableRecord

        assert self.registry is not None
        delay = POLL_MS / 1000
        while True:
            try:
                return await self.registry.document(value)
            except UnreadableRecord as exc:
                log.warning("an answer record cannot be read; skipped: %s", exc)
                self.undecodable += 1
                return None
            except Exception as exc:  # noqa: BLE001 - the registry's fault, not the record's: wait for it
                log.warning("the Schema Registry did not answer; retrying in %.1f s: %s: %s", delay,
                            type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, REGISTRY_BACKOFF_MAX_S)

    def _offer(self, value: bytes | None) -> None:
        try:
            answer = decode_answer(value or b"")
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.undecodable += 1
            return
        for pending in list(self._waiting.get(answer.id, ())):
            pending.offer(answer)

    async def _explain_timeout(self, request_id: str, published: Published | None, timeout: float) -> str:
        """What is known when an ask times out: where the request is, and how far the worker group got."""
        if published is None:
            return f"no answer to request {request_id!r} within {timeout:g} s: the request was not acknowledged"
        where = f"{published.topic}[{published.partition}] offset {published.offset}"
        return (f"no answer to request {request_id!r} within {timeout:g} s; the request is at {where}; "
                f"{await self._progress(published)}")

    async def _progress(self, published: Published) -> str:
        """The worker group's committed offset on the request's partition, in words (or why it is unknown)."""
        requests = TopicPartition(published.topic, published.partition)
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers,
                                    **without(self.options, "auto_offset_reset", "fetch_max_wait_ms",
                                              "max_poll_records", "fetch_max_bytes", "max_partition_fetch_bytes"))
        try:
            async with asyncio.timeout(5):
                await admin.start()
                offsets = await _retrying(lambda: admin.list_consumer_group_offsets(self.worker_group,
                                                                                    partitions=[requests]))
        except Exception as exc:  # noqa: BLE001 - the explanation must not hide the timeout itself
            return f"the worker group {self.worker_group!r}'s progress could not be read ({type(exc).__name__}: {exc})"
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        committed = offsets.get(requests)
        if committed is None or committed.offset < 0:
            return (f"the worker group {self.worker_group!r} has committed nothing on that partition: "
                    "is a worker running and subscribed to the topic?")
        if committed.offset <= published.offset:
            return (f"the worker group {self.worker_group!r} has committed up to offset {committed.offset}: "
                    f"{published.offset - committed.offset + 1:,} records of that partition, this one included, "
                    "are not answered yet (a lag, or a stopped worker)")
        return (f"the worker group {self.worker_group!r} has committed past it (offset {committed.offset}), so "
                f"its answer is on {self.answer_topic!r}: is answer_topic the worker's?")


async def _retrying(call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` again while the broker answers with a retriable error (its group coordinator not available yet,
    as on a broker just started): the caller's timeout bounds it."""
    while True:
        try:
            return await call()
        except KafkaError as exc:
            if not exc.retriable:
                raise
            await asyncio.sleep(0.2)
