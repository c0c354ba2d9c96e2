"""The consume loop: read records from Kafka under a read policy, hand them on a fetch at a time, commit.

``ConsumeLoop.run`` subscribes (or assigns) through its ``ReadPolicy`` -- the live stream from the committed
offsets on (``LiveRead``), or a replay's fixed range (replay.py) -- and then, until it is stopped or the
policy says the work is finished:

* **fetches** records (``getmany``, at most as many as there is room for) and hands each fetch to the
  handler as one task (the request pipeline answers it and delivers through the commit policy);
* applies **backpressure**: at ``max_inflight_requests`` requests, ``max_inflight_tokens`` prompt tokens or
  a full media budget the partitions holding their share of the in-flight work are paused (all of them past
  the limits plus ``RESERVE``, or with a full media budget), and resumed once the work drains below 80 % of
  all three, so memory stays bounded however fast producers publish, and a light stream on partitions of its
  own is not held behind a flood on others (``backpressure_pauses``; docs/SCHEDULING.md);
* keeps each partition's reads within the **window** its commit metadata can speak for (offsets.py): records
  past it are sought back to and the partition paused until its oldest unanswered request is answered;
* **commits** every ``commit_interval_ms`` (beside the loop: a transaction's round trips must not stall
  fetching) and reports lag and stalls;
* on **shutdown** (``stop()``: SIGTERM/SIGINT) stops fetching, finishes what is in flight for up to
  ``shutdown_timeout_s``, commits and returns; after a worker-fatal error it commits nothing more.

Every task it starts (a fetch's handler, the periodic commit, a partition's settling) is watched
(``Metrics.watch``): one that dies of an exception is logged with its traceback and makes the worker not ready,
``/readyz`` naming it, instead of leaving its partitions standing still behind a worker that says it is fine.

Each assigned partition's pauses are held in an ``Assignment`` (assignment.py) that the rebalance listener
(``_Rebalance``) makes when partitions are assigned and ends when they are revoked: backpressure, a tenant's
quota, the read window and settling are reasons in the partition's state, and the partition is read again only
once none is left.

Rebalance (``_Rebalance``, eager: every partition is revoked, and the assignment that follows hands some of
them back): a revocation commits what is done and holds the partitions, and the assignment keeps those handed
back as they were and lets go of those that moved (``rebalance_keep_partitions``, on by default; see
``_Rebalance``), all within ``rebalance_timeout_ms`` (a member still revoking when the group's rebalance times
out is dropped and starts another rebalance). With it off, the revoked partitions' in-flight work gets
``rebalance_drain_s`` to finish first and every partition is closed. Work of a partition that moved and
finishes later is abandoned (``exactly_once``: never committed, the new owner answers it; ``at_least_once``:
published, not committed).
A partition whose producer is fenced while the consumer holds it is settled again (``settle_again``).
Newly assigned partitions stay paused until they are *settled*: when the commit policy ``settles_assignments``
(``exactly_once``), the partition's transactional producer is initialised first (which waits until the
previous owner's last transaction is complete, and fences that owner) and only then is the committed offset
read and sought to. aiokafka reads committed offsets on assignment without ``require_stable`` (KIP-447), so
without this a new owner could start from the offset before the previous owner's last commit and answer those
requests a second time. With the committed offset the commit's metadata is read: the requests it names were
answered beyond the offset by the previous owner, and are skipped (``OffsetTracker.inherit``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import structlog
from aiokafka import ConsumerRebalanceListener
from aiokafka.structs import ConsumerRecord, TopicPartition

from d3stream.core.inflight import InFlightLedger
from d3stream.core.seams import InputRecord
from d3stream.kafka.assignment import Assignment
from d3stream.kafka.assignor import StickyAssignor
from d3stream.kafka.commits import CommitPolicy
from d3stream.kafka.connection import kafka_consumer
from d3stream.kafka.limits import WorkerFatal
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.partitions import PartitionState, PauseReason
from d3stream.ops.metrics import Metrics
from d3stream.settings import (
    BatchingSettings,
    ConnectionSettings,
    DeliverySettings,
    LifecycleSettings,
    heartbeat_interval_ms,
)

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer

log = structlog.get_logger(__name__)

# Partitions resume once in-flight work falls below this share of every limit.
RESUME_AT = 0.8
# Under backpressure, partitions below their share keep being read until the work passes the limits by this much.
RESERVE = 0.125
# How long the broker may hold a fetch that found nothing new (aiokafka's default: 500 ms). A consumer has one
# fetch in flight per broker, so partitions resumed from backpressure are not read until the fetch already
# waiting for a caught-up partition returns: with 500 ms the work in flight ran out first, and the worker stood
# idle for a seventh of a ``bench kafka`` run (docs/MEASUREMENTS.md, 2026-12-08). ``kafka_options``
# ``fetch_max_wait_ms=...`` sets another.
FETCH_MAX_WAIT_MS = 50
# How long the loop waits for records before it looks at the work in flight again: POLL_MS while it reads,
# BACKPRESSURE_POLL_MS while backpressure holds partitions. The work drains without waking the loop, so a paused
# partition resumes at the loop's next look: every 100 ms held a worker at its default 256 requests in flight to
# about 2,600 requests a second, idle two thirds of the time (bench kafka's null model, 2026-12-08); every 10 ms,
# about 9,050-9,300.
POLL_MS = 100
BACKPRESSURE_POLL_MS = 10

# The partitions a fetch's description names (``Fetch.describe``); the rest are counted.
DESCRIBED_PARTITIONS = 4

K = TypeVar("K")


def backpressure_pauses(in_flight: Mapping[K, int], requests: int, tokens: int, max_requests: int,
                        max_tokens: int) -> set[K]:
    """Under backpressure, which partitions to pause: each holding its share of ``max_requests`` (the limit over
    the assigned partitions) or more of the in-flight requests, so a flood's partitions stop while a light
    stream's keep flowing; every one once ``requests`` or ``tokens`` pass the limits by ``RESERVE``."""
    over = requests >= max_requests * (1 + RESERVE) or tokens >= max_tokens * (1 + RESERVE)
    share = max_requests / max(len(in_flight), 1)
    return {partition for partition, count in in_flight.items() if over or count >= share}



def group_consumer(connection: ConnectionSettings, delivery: DeliverySettings, *, group_id: str | None = None,
                   co_partitioned: bool = False, client_suffix: str = "") -> AIOKafkaConsumer:
    """A consumer-group member: committed offsets are the commit policy's (no auto-commit), and it reads
    committed records only (answers of an aborted transaction never count as requests).

    The serve job's group by default; ``group_id`` names another job's group (without the worker's static
    membership, which is the serve group's). ``co_partitioned``: partition ``p`` of every subscribed topic goes
    to the same member (range assignment), for a job whose unit is a partition number across topics
    (kafka/units.py); otherwise sticky (kafka/assignor.py: at a rebalance each member keeps what it owns, up to
    its share, so a join or a leave moves only that member's share)."""
    from aiokafka.coordinator.assignors.range import RangePartitionAssignor

    sticky = StickyAssignor()
    assignment: dict[str, object] = {
        "partition_assignment_strategy": (RangePartitionAssignor,) if co_partitioned else (sticky,)}
    consumer = kafka_consumer(connection,
        client_id=connection.client_id + client_suffix,
        group_id=group_id or delivery.group_id,
        group_instance_id=delivery.group_instance_id if group_id is None else None,
        session_timeout_ms=delivery.session_timeout_ms,
        rebalance_timeout_ms=delivery.rebalance_timeout_ms,
        heartbeat_interval_ms=heartbeat_interval_ms(delivery),
        # A JoinGroup waits on the broker for the whole rebalance: its request must outlast it.
        request_timeout_ms=max(40_000, delivery.rebalance_timeout_ms + 5_000),
        enable_auto_commit=False,
        auto_offset_reset=delivery.auto_offset_reset,
        isolation_level="read_committed",
        fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
        **assignment,
    )
    sticky.generation = lambda: group_generation(consumer)  # the generation its partitions were assigned in
    return consumer


@dataclass
class Fetch:
    """The records of one ``getmany`` handed on by the consume loop, and for each partition they came from,
    the partition and the assignment (epoch) they were read in."""

    records: list[ConsumerRecord[bytes, bytes]]
    partitions: dict[tuple[str, int], tuple[TopicPartition, int]]

    def origin(self, record: InputRecord) -> tuple[TopicPartition, int]:
        """The partition and assignment epoch ``record`` was read in."""
        return self.partitions[(record.topic, record.partition)]

    def task_name(self) -> str:
        """What the task answering it is doing, for ``/readyz`` should it die."""
        return f"answering the records of {self.describe()}"

    def describe(self) -> str:
        """Where its records were read, for a log line or ``/readyz``: ``topic-partition@first..last`` each."""
        spans: dict[tuple[str, int], tuple[int, int]] = {}
        for record in self.records:
            place = (record.topic, record.partition)
            first, last = spans.get(place, (record.offset, record.offset))
            spans[place] = (min(first, record.offset), max(last, record.offset))
        named = [f"{topic}-{partition}@{first}" + (f"..{last}" if last > first else "")
                 for (topic, partition), (first, last) in sorted(spans.items())]
        more = len(named) - DESCRIBED_PARTITIONS  # a probe's answer stays a line however wide the fetch
        return ", ".join(named[:DESCRIBED_PARTITIONS]) + (f" and {more} more partitions" if more > 0 else "")


Handler = Callable[[Fetch], Coroutine[Any, Any, None]]


class ReadPolicy(Protocol):
    """What to read and when the work is finished."""

    async def subscribe(self, consumer: AIOKafkaConsumer, listener: ConsumerRebalanceListener) -> bool:
        """Subscribe (True: partitions were assigned by hand, the consumer holds them already)."""
        ...

    async def assigned(self, consumer: AIOKafkaConsumer, partitions: Sequence[TopicPartition],
                       settling: Sequence[TopicPartition]) -> None:
        """Partitions were assigned (``settling`` ones are positioned once settled, by ``start_position``)."""
        ...

    def start_position(self, partition: TopicPartition, committed: int | None) -> int | None:
        """Where a settled partition is read from; None: leave it where aiokafka put it."""
        ...

    def accept(self, record: ConsumerRecord[bytes, bytes]) -> bool:
        """Whether a fetched record is served."""
        ...

    async def finished(self, consumer: AIOKafkaConsumer, in_flight: int) -> bool:
        """Whether the work is complete without a stop request."""
        ...


class LiveRead:
    """The live stream: the request topics, from the group's committed offsets on, until stopped."""

    def __init__(self, topics: Sequence[str]):
        self.topics = list(topics)

    async def subscribe(self, consumer: AIOKafkaConsumer, listener: ConsumerRebalanceListener) -> bool:
        consumer.subscribe(self.topics, listener=listener)
        return False

    async def assigned(self, consumer: AIOKafkaConsumer, partitions: Sequence[TopicPartition],
                       settling: Sequence[TopicPartition]) -> None:
        return None

    def start_position(self, partition: TopicPartition, committed: int | None) -> int | None:
        return committed

    def accept(self, record: ConsumerRecord[bytes, bytes]) -> bool:
        return True

    async def finished(self, consumer: AIOKafkaConsumer, in_flight: int) -> bool:
        return False


class ConsumeLoop:
    """One consumer group member's loop (see the module's docstring)."""

    def __init__(self, delivery: DeliverySettings, batching: BatchingSettings, lifecycle: LifecycleSettings,
                 consumer: AIOKafkaConsumer, *, commits: CommitPolicy, tracker: OffsetTracker,
                 read: ReadPolicy, handler: Handler, ledger: InFlightLedger, metrics: Metrics):
        # The commit cadence and rebalance timeout (delivery), the in-flight limits backpressure holds to
        # (batching), the shutdown and rebalance drains, keeping partitions and stalls (lifecycle).
        self.delivery = delivery
        self.batching = batching
        self.lifecycle = lifecycle
        self.consumer = consumer
        self.commits = commits
        self.tracker = tracker
        self.read = read
        self.handler = handler
        # What the requests in flight hold: it counts the records read here, backpressure reads its counts.
        self.ledger = ledger
        self.in_flight = ledger.counts
        self.media_budget = ledger.media
        self.metrics = metrics
        self.quotas = ledger.quotas
        self.stopping = asyncio.Event()
        self.fatal: WorkerFatal | None = None  # why the worker stopped by itself, if it did
        self.joined = False  # the consumer has an assignment
        self.first_read_at: float | None = None  # perf_counter when the first records were handed on (benchmarks)
        # The current assignment (made and ended by the rebalance listener): its partitions' pause reasons.
        self.works = tracker.works  # every partition's work (partitions.py): its progress, pauses, transactions
        self.assignment = Assignment(consumer, works=self.works)
        self.stalled: list[str] = []  # partitions whose commit point has not moved for stall_unready_s
        self.tasks: set[asyncio.Task[None]] = set()
        # When the running rebalance began revoking (monotonic); counted as paused until its partitions settle.
        self.rebalance_began: float | None = None
        self.holdover: _Holdover | None = None  # partitions revoked and kept until the next assignment
        commits.on_fenced = self.settle_again

    @property
    def paused(self) -> bool:
        """Backpressure is on (until the work drains)."""
        return self.assignment.backpressure

    @property
    def pressure_paused(self) -> set[TopicPartition]:
        """The partitions backpressure holds."""
        return self.assignment.paused_for(PauseReason.BACKPRESSURE)

    @property
    def quota_paused(self) -> set[TopicPartition]:
        """The partitions held because a request of theirs waits for its tenant's quota (quotas.py)."""
        return self.assignment.paused_for(PauseReason.QUOTA)

    @property
    def window_paused(self) -> set[TopicPartition]:
        """The partitions read as far past their commit point as a commit's metadata can name."""
        return self.assignment.paused_for(PauseReason.WINDOW)

    @property
    def settling(self) -> dict[TopicPartition, asyncio.Task[None]]:
        """Assigned partitions not yet positioned at their stable committed offset (held paused meanwhile)."""
        return self.assignment.settling()

    def stop(self) -> None:
        self.stopping.set()

    def fail(self, exc: WorkerFatal) -> None:
        """A worker-fatal publish or commit error: stop; ``run`` raises it once everything is closed."""
        if self.fatal is None:
            log.error("stopping: publishing cannot go on", error=str(exc))
            self.fatal = exc
        self.stopping.set()

    async def guarded(self, step: Awaitable[None]) -> None:
        """Run a flush; a worker-fatal error stops the worker instead of ending the calling task."""
        try:
            await step
        except WorkerFatal as exc:
            self.fail(exc)

    # ----------------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Subscribe, consume until stopped or finished, then drain and commit (nothing after a fatal error)."""
        if await self.read.subscribe(self.consumer, _Rebalance(self)):
            self.assignment = Assignment(self.consumer, self.consumer.assignment(), works=self.works)  # by hand
            self.joined = True
        try:
            await self._consume()
            if self.fatal is None:  # after a worker-fatal error nothing more can be published
                await self.drain(self.lifecycle.shutdown_timeout_s)
                await self.guarded(self.commits.flush(self.tracker.partitions()))
            if self.fatal is not None:  # requests still in flight stay uncommitted: served again later
                await self._cancel_tasks()
        finally:
            await self.assignment.stop_settling()

    async def _consume(self) -> None:
        next_commit = time.monotonic() + self.delivery.commit_interval_ms / 1000
        flushing: asyncio.Task[None] | None = None
        while not self.stopping.is_set():
            room = max(1, self._room())
            wait_ms = BACKPRESSURE_POLL_MS if self.paused else POLL_MS
            batches = await self.consumer.getmany(timeout_ms=wait_ms, max_records=room)
            fetched = self._take(batches)
            if fetched.records:
                if self.first_read_at is None:
                    self.first_read_at = time.perf_counter()
                self.ledger.read(len(fetched.records))
                task = asyncio.create_task(self.handler(fetched))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
                # The handler answers every record, even one it fails on; should it die anyway, its records stay
                # unanswered and their partitions stand still: logged, and the worker is not ready.
                self.metrics.watch(task, fetched.task_name)  # said only if it dies
            self._apply_backpressure()
            self._apply_quotas()
            self._apply_window()
            self.metrics.set_in_flight(self.in_flight.requests, self.in_flight.questions, self.in_flight.tokens)
            self.metrics.set_paused(self.paused)
            if time.monotonic() >= next_commit and (flushing is None or flushing.done()):
                flushing = asyncio.create_task(self._flush_and_report())
                self.metrics.watch(flushing, "the periodic commit")
                next_commit = time.monotonic() + self.delivery.commit_interval_ms / 1000
            if await self.read.finished(self.consumer, self.tracker.in_flight()):
                break
        if flushing is not None:
            await flushing

    def _take(self, batches: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> Fetch:
        """The fetched records to serve, tracked under their partitions' assignments."""
        fetched = Fetch([], {})
        accept = self.read.accept
        for partition, records in batches.items():
            if self.assignment.is_settling(partition):  # not positioned yet: read again once it is
                if records:
                    self.assignment.skipped_while_settling(partition, records[0].offset)
                continue
            if self.tracker.held(partition):
                # Revoked and held (rebalance_keep_partitions): aiokafka still returns its records until the
                # next assignment, which seeks a kept partition back to where it was held. Taken now, they would
                # be read and answered twice (bench fleet --keep: 32 answers committed twice).
                continue
            limit = self.tracker.read_limit(partition, records[0].offset) if records else None
            if limit is not None and records[-1].offset > limit:
                # Past what a commit's metadata can speak for: read again once the commit point has moved.
                self.consumer.seek(partition, next(r.offset for r in records if r.offset > limit))
                records = [record for record in records if record.offset <= limit]
            accepted = [record for record in records if accept(record)]
            if accepted:
                epoch, answered = self.tracker.add_all(partition, [record.offset for record in accepted],
                                                       [record.key for record in accepted])
                if answered:  # an earlier owner's answers are out: their commit said so
                    log.info("skipped requests answered before", partition=str(partition), count=len(answered))
                    accepted = [record for record in accepted if record.offset not in answered]
                fetched.partitions[(partition.topic, partition.partition)] = (partition, epoch)
                fetched.records += accepted
        return fetched

    def _apply_window(self) -> None:
        """Pause a partition read as far past its commit point as a commit's metadata can speak for (its oldest
        request holds the point back); resume it when the point has moved."""
        assignment = self.assignment
        full = {partition for partition in self.consumer.assignment() if self.tracker.window_full(partition)}
        if newly := assignment.pause(full, PauseReason.WINDOW):
            log.warning("read window full: paused until the oldest request is answered", partitions=sorted(
                map(str, newly)), window=self.tracker.window, setting="offset_metadata_max_bytes")
        assignment.resume(assignment.paused_for(PauseReason.WINDOW) - full, PauseReason.WINDOW)

    async def _cancel_tasks(self) -> None:
        tasks = [task for task in self.tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def drain(self, timeout: float, partitions: Sequence[TopicPartition] | None = None) -> None:
        """Wait until the in-flight work (of ``partitions``, or all) is answered, or ``timeout`` passes, or no
        fetch is being worked on any more (one given up, as a registry lookup at shutdown, leaves its records in
        flight for the partition's next owner: nothing here would answer them)."""
        deadline = time.monotonic() + timeout
        while self.tracker.in_flight(partitions) and self.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if partitions is None and self.tasks:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------------------- backpressure

    def _room(self) -> int:
        """How many records one fetch may bring: up to ``max_inflight_requests`` in flight, and under
        backpressure up to its ``RESERVE`` for the partitions still read (only those below their share are).
        Without the reserve here a fetch past the limit would bring one record at a time: a pipeline trip per
        record, which cost a quarter of the Kafka path's throughput (bench kafka)."""
        limit = self.batching.max_inflight_requests
        if self.paused:
            limit = int(limit * (1 + RESERVE))
        return limit - self.in_flight.requests + self.in_flight.held_requests

    def _apply_backpressure(self) -> None:
        batching, work = self.batching, self.in_flight
        # Requests held by a tenant quota are bounded by their partitions' pause, not by these limits.
        requests, tokens = work.requests - work.held_requests, work.tokens - work.held_tokens
        full = (
            requests >= batching.max_inflight_requests
            or tokens >= batching.max_inflight_tokens
            or self.media_budget.full
        )
        drained = (
            requests < RESUME_AT * batching.max_inflight_requests
            and tokens < RESUME_AT * batching.max_inflight_tokens
            and self.media_budget.used < RESUME_AT * self.media_budget.capacity
        )
        current = self.assignment
        assignment = self.consumer.assignment()
        if current.backpressure and drained:
            current.resume(current.paused_for(PauseReason.BACKPRESSURE), PauseReason.BACKPRESSURE)
            current.backpressure = False
            log.debug("resumed", requests=work.requests, tokens=work.tokens)
        elif (full or current.backpressure) and assignment:
            if not current.backpressure:
                log.debug("paused", requests=work.requests, tokens=work.tokens)
            current.backpressure = True
            # Re-evaluated while it lasts: a partition reaching its share is paused too.
            pause = set(assignment) if self.media_budget.full else backpressure_pauses(
                {p: self.tracker.in_flight([p]) for p in assignment}, requests, tokens,
                batching.max_inflight_requests, batching.max_inflight_tokens)
            current.pause(pause, PauseReason.BACKPRESSURE)

    def _apply_quotas(self) -> None:
        """Pause the partitions with a request held by its tenant's quota; resume those whose held requests
        went on (unless another reason holds them). Other partitions are not touched."""
        if self.quotas is None or not self.quotas.enabled:
            return
        current = self.assignment
        assignment = self.consumer.assignment()
        held = {TopicPartition(topic, partition) for topic, partition in self.quotas.held_partitions()} & assignment
        if newly := current.pause(held, PauseReason.QUOTA):
            log.debug("tenant over its quota: partitions paused", partitions=sorted(str(p) for p in newly))
        current.resume(current.paused_for(PauseReason.QUOTA) - held, PauseReason.QUOTA)
        self.metrics.set_quota_held(self.quotas.held_tenants(), self.in_flight.held_requests, len(held),
                                    self.quotas.held_total)

    # ------------------------------------------------------------------------- commits and lag

    async def _flush_and_report(self) -> None:
        await self.guarded(self.commits.flush())
        await self._report_lag()

    async def _report_lag(self) -> None:
        """Per partition: read lag (behind the position), committed lag (behind the commit point), the oldest
        unanswered request, and how long the commit point has stood still with work waiting; a stall longer
        than ``stall_unready_s`` makes the worker unready."""
        now = time.monotonic()
        limit = self.lifecycle.stall_unready_s
        stalled = []
        for partition in self.consumer.assignment():
            oldest, stalled_s = self.tracker.stall(partition, now)
            if limit and stalled_s >= limit:
                stalled.append(f"{partition.topic}-{partition.partition}")
            end = self.consumer.last_stable_offset(partition) or self.consumer.highwater(partition)
            if end is None:
                continue
            try:
                position = await self.consumer.position(partition)
            except Exception:  # noqa: BLE001 - a partition moving away mid-call; next round reports it
                continue
            self.metrics.set_read_lag(partition.topic, partition.partition, max(0, end - position))
            base = self.tracker.commit_base(partition)
            self.metrics.set_partition_progress(
                partition.topic,
                partition.partition,
                committed_lag=end - (position if base is None else base),
                oldest_unanswered_s=oldest,
                stalled_s=stalled_s,
            )
        if stalled and stalled != self.stalled:
            log.warning("no progress: committed offsets stand still with work waiting; not ready",
                        partitions=stalled, stall_unready_s=limit)
        self.stalled = stalled

    # ---------------------------------------------------------------------------------- settling

    def settle_again(self, partition: TopicPartition) -> None:
        """The partition's producer was fenced while the consumer still holds it: another worker owned it and may
        have committed beyond what this one read. It is read again only once settled anew (a new producer, the
        committed offset and its metadata re-read and sought to), never on from where this worker was."""
        if partition in self.consumer.assignment() and not self.assignment.is_settling(partition):
            log.warning("fenced partition settled again from its committed offset", partition=str(partition))
            self.begin_settling([partition])

    def begin_settling(self, partitions: list[TopicPartition]) -> None:
        """Hold newly assigned partitions paused until the commit policy is ready for them and they are read
        from their stable committed offset (runs outside the rebalance callback, which must not block)."""
        assignment = self.assignment
        assignment.begin_settling(partitions, lambda settling: self._settle(assignment, settling))
        settling = assignment.settling()
        for task in {settling[partition] for partition in partitions if partition in settling}:
            # Its partitions are resumed however it ends, but without their producer or committed offset.
            self.metrics.watch(task, f"settling {', '.join(f'{p.topic}-{p.partition}' for p in partitions)}")

    async def _settle(self, assignment: Assignment, partitions: list[TopicPartition]) -> None:
        try:
            try:
                await self.commits.assigned(partitions)
            except WorkerFatal as exc:  # no permission for its transactional id, say: the worker stops
                self.fail(exc)
                return
            for partition in partitions:
                if partition not in self.consumer.assignment():
                    continue
                skipped = assignment.take_skipped(partition)
                try:
                    committed, metadata = await committed_offset(self.consumer, partition)
                    self.tracker.inherit(partition, committed, metadata)
                    position = self.read.start_position(partition, committed)
                except Exception as exc:  # noqa: BLE001 - then from where aiokafka positioned it, or what was skipped
                    log.warning("committed offset not re-read", partition=str(partition), error=str(exc))
                    position = None
                if position is None:
                    position = skipped
                if position is not None:
                    self.consumer.seek(partition, position)
        finally:
            settled = assignment.settled(partitions, asyncio.current_task())
            log.debug("partitions settled", partitions=[f"{p.topic}-{p.partition}" for p in settled])
            if not assignment.settling():
                self.rebalance_settled()

    async def still_ours(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Of partitions kept through a rebalance, those whose committed offset and metadata in the group are
        still this worker's last commit of them (one request for all); on a failed read, none."""
        try:
            fetched = await self.consumer._coordinator.fetch_committed_offsets(partitions)  # noqa: SLF001 - metadata
        except Exception as exc:  # noqa: BLE001 - then they settle afresh: slower, never wrong
            log.warning("commits of kept partitions not read; settled afresh", error=str(exc))
            return []
        ours = []
        for partition in partitions:
            found = fetched.get(partition)
            group = None if found is None or found.offset < 0 else (found.offset, found.metadata or "")
            if group == self.tracker.last_commit(partition):
                ours.append(partition)
            else:
                log.warning("a kept partition was committed by another worker meanwhile; settled afresh",
                            partition=str(partition), group=group, ours=self.tracker.last_commit(partition))
        return ours

    async def let_go(self, partitions: list[TopicPartition], deadline: float) -> int:
        """Close ``partitions`` for good (revoked, or held and not handed back): their producers stopped, their
        late answers never committed; returns how many of their requests were left unanswered."""
        if not partitions:
            return 0
        abandoned = self.tracker.in_flight(partitions)
        # The commit policy's part first (a producer is stopped), then the rest of each partition's work, in one
        # call: from here on, late answers of these partitions are not committed.
        await _within(self.commits.revoked(partitions), deadline, "closing revoked partitions' producers")
        for partition in partitions:
            self.works.end(partition)
        self.metrics.forget_partitions([(p.topic, p.partition) for p in partitions])
        self.metrics.count_revoked(len(partitions), abandoned)
        return abandoned

    def rebalance_settled(self) -> None:
        """Every partition of the assignment is read again: the rebalance's pause ends here."""
        if self.rebalance_began is not None:
            self.metrics.count_rebalance_pause(time.monotonic() - self.rebalance_began)
            self.rebalance_began = None


@dataclass
class _Holdover:
    """Partitions an eager rebalance revoked that this worker keeps in hand until the next assignment says
    whether they stay: where each was read to, and its state (why it was paused)."""

    generation: int  # the group generation they were held in
    positions: dict[TopicPartition, int]
    states: dict[TopicPartition, PartitionState]
    backpressure: bool


def known_position(consumer: AIOKafkaConsumer, partition: TopicPartition) -> int | None:
    """The next offset the consumer returns for ``partition``, when it knows one without asking the broker.
    (``AIOKafkaConsumer.position`` waits for a position instead; a revocation must not.)"""
    subscription = consumer._subscription.subscription  # noqa: SLF001 - no public non-blocking read
    if subscription is None or subscription.assignment is None or partition not in subscription.assignment.tps:
        return None
    state = subscription.assignment.state_value(partition)
    return state.position if state.has_valid_position else None


def group_generation(consumer: AIOKafkaConsumer) -> int | None:
    """The consumer group generation the member is in (None: no group; -1: the member lost its place)."""
    return getattr(getattr(consumer, "_coordinator", None), "generation", None)


class _Rebalance(ConsumerRebalanceListener):
    """Make the loop's ``Assignment`` when partitions are assigned and end it when they are revoked.

    aiokafka rebalances eagerly: every member's every partition is revoked, and the assignment that follows
    usually hands some of them back. With ``rebalance_keep_partitions`` (on by default: docs/SCALEOUT.md says
    what ``bench fleet`` measured) a revocation only commits what is done and holds the partitions
    (``_Holdover``): their transactional producers, their work in flight, their tracked offsets and positions
    stay. The assignment then keeps those handed back as they were (no
    drain, no new ``init_transactions``, no re-read of the commit) and closes only those that moved. That is
    safe because every partition has its own transactional id: the new owner of a partition that moved fences
    this worker's producer of it before it reads the committed offset, so an answer this worker still had in
    hand can never be committed beside the new owner's (docs/SCALEOUT.md). A partition is kept only when the
    assignment is the very next generation of the one it was held in: a member that lost its place in the
    group, or missed a generation, cannot know who owned the partition meanwhile, and settles it afresh.

    Without it, a revocation drains the revoked partitions' work for ``rebalance_drain_s``, commits and closes
    every one, and the assignment settles every partition anew."""

    def __init__(self, loop: ConsumeLoop):
        self.loop = loop

    async def on_partitions_revoked(self, partitions: Iterable[TopicPartition]) -> None:
        """Commit what is done and hold (or drain, commit and let go), all within the rebalance timeout: the
        member rejoins only when this returns, and one that rejoins too late is dropped and starts another
        rebalance."""
        revoked = list(partitions)
        if not revoked:
            return
        loop = self.loop
        assignment = loop.assignment
        started = time.monotonic()
        # What is left of the rebalance timeout after the drain; a second of it stays for the rejoin itself.
        deadline = started + loop.delivery.rebalance_timeout_ms / 1000 - 1.0
        if loop.rebalance_began is None:
            loop.rebalance_began = started
        generation = group_generation(loop.consumer)
        settling = set(assignment.settling())  # not positioned yet: not kept, settled afresh if handed back
        await assignment.stop_settling(revoked)
        kept: dict[TopicPartition, int] = {}
        # Kept only where the work of a partition that moves can never be committed beside its new owner's (each
        # partition's producer is fenced by the next owner); at least once drains instead, as its answers of a
        # moved partition would be published and then answered again (bench fleet: 1,656 of 62,008 repeated).
        if (loop.lifecycle.rebalance_keep_partitions and loop.commits.fences_moved_work
                and generation is not None and generation >= 0):
            kept = {partition: position for partition in revoked
                    if partition not in settling and loop.tracker.owns(partition)
                    and (position := known_position(loop.consumer, partition)) is not None}
        else:
            await loop.drain(loop.lifecycle.rebalance_drain_s, revoked)
        if kept:
            # Held before the final commit, not after: a periodic commit waiting for the policy's lock would
            # otherwise take it when the final commit lets go and open a transaction for a partition about to
            # move, whose producer the assignment then stops under it (bench fleet --keep: the worker's commits
            # hung from then on, 29 s at every later revocation). The final commit names them: it still commits.
            loop.tracker.hold(kept)  # nothing more is committed for them until the assignment says they stay
            loop.holdover = _Holdover(generation or 0, kept, {p: assignment.state(p) for p in kept},
                                      assignment.backpressure)
        committed = await _within(loop.guarded(loop.commits.flush(revoked)), deadline,
                                  "final commit of revoked partitions")
        let_go = [partition for partition in revoked if partition not in kept]
        abandoned = await loop.let_go(let_go, deadline)
        assignment.end(revoked)
        log.info("partitions revoked", partitions=[f"{p.topic}-{p.partition}" for p in revoked],
                 held=len(kept), abandoned=abandoned, committed=committed,
                 seconds=round(time.monotonic() - started, 3))

    async def on_partitions_assigned(self, partitions: Iterable[TopicPartition]) -> None:
        assigned = list(partitions)
        loop = self.loop
        generation = group_generation(loop.consumer)
        holdover, loop.holdover = loop.holdover, None
        held = holdover.positions if holdover is not None else {}
        kept: list[TopicPartition] = []
        if holdover is not None and generation == holdover.generation + 1:
            # One fenced while held (its producer's commit failed) was owned by another worker meanwhile.
            kept = [partition for partition in assigned if partition in held and loop.tracker.owns(partition)]
        for partition in kept:  # before any await: aiokafka would position them at the committed offset
            loop.consumer.seek(partition, held[partition])
        # Unpaused, as aiokafka's own states.
        loop.assignment = Assignment(loop.consumer, assigned, generation, works=loop.works)
        if loop.commits.settles_assignments:
            # The others held from the start too: aiokafka has positioned them at the committed offset it read,
            # and records read from there during the awaits below, before their settling re-reads that offset and
            # seeks to it, would be answered twice (bench fleet --keep: runs of 8-16 requests answered twice by
            # their new owner, both committed).
            loop.assignment.pause([partition for partition in assigned if partition not in kept],
                                  PauseReason.SETTLING)
        if kept:
            # Held still while the group's commits are read: a partition whose commit is not this worker's last
            # one was committed by another owner in between (a generation this worker did not see) and is settled
            # afresh instead.
            loop.assignment.pause(kept, PauseReason.SETTLING)
            kept = await loop.still_ours(kept)
        if holdover is not None:
            for partition in kept:
                loop.assignment.carry(holdover.states[partition])
                loop.assignment.resume([partition], PauseReason.SETTLING)
            loop.assignment.backpressure = holdover.backpressure and bool(kept)
            loop.tracker.release(kept)
            moved = [partition for partition in held if partition not in kept]
            if moved:
                deadline = time.monotonic() + loop.delivery.rebalance_timeout_ms / 1000
                await loop.let_go(moved, deadline)
        fresh = [partition for partition in assigned if partition not in kept]
        if loop.commits.settles_assignments:
            loop.begin_settling(fresh)  # commits.assigned runs there, outside this callback
        else:
            await loop.commits.assigned(fresh)
            await inherit(loop.consumer, loop.tracker, fresh)
        await loop.read.assigned(loop.consumer, assigned, list(loop.assignment.settling()))
        loop.joined = True
        if not loop.assignment.settling():
            loop.rebalance_settled()
        loop.metrics.count_rebalance(generation, len(assigned), len(loop.consumer.assignment()), kept=len(kept))
        log.info("partitions assigned", partitions=[f"{p.topic}-{p.partition}" for p in assigned],
                 kept=len(kept), generation=generation)


async def inherit(consumer: AIOKafkaConsumer, tracker: OffsetTracker, partitions: list[TopicPartition]) -> None:
    """Read what the partitions' last commits say was answered beyond their points (to skip it)."""
    if not tracker.record_done:
        return
    for partition in partitions:
        try:
            tracker.inherit(partition, *await committed_offset(consumer, partition))
        except Exception as exc:  # noqa: BLE001 - without it those requests are answered again (at least once)
            log.warning("commit metadata not read", partition=str(partition), error=str(exc))


async def committed_offset(consumer: AIOKafkaConsumer, partition: TopicPartition) -> tuple[int | None, str]:
    """The group's committed offset of ``partition`` and its metadata (None, "" when nothing is committed).

    ``AIOKafkaConsumer.committed`` returns the offset alone; the metadata says which offsets beyond it were
    answered already (offsets.py), so the coordinator's own fetch is asked."""
    fetched = await consumer._coordinator.fetch_committed_offsets([partition])  # noqa: SLF001 - metadata too
    found = fetched.get(partition)
    if found is None or found.offset < 0:
        return None, ""
    return found.offset, found.metadata or ""


async def _within(step: Awaitable[object], deadline: float, what: str) -> bool:
    """Run a revocation step until ``deadline`` (monotonic); past it, leave it behind and say so. A step cut
    short loses nothing: an unfinished transaction is aborted (or completed) by the new owner's producer, and
    an uncommitted offset is answered by the new owner."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
    if task in done:
        task.result()
        return True
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    log.warning(f"{what} did not finish within the rebalance timeout; left to the new owner")
    return False
