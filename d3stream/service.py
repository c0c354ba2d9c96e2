"""The service loop: consume requests, fetch media, prepare, batch, run, publish answers, commit.

Each request read from Kafka becomes one task that walks the stages (decode the event, fetch its
media, decode the media strictly, prepare the prompts, wait for its rows' forward passes, build the
answer) and ends by publishing exactly one answer event. Failures at any stage end the same way, with
an ``error`` instead of ``answers``; records that are not even JSON objects are also dead-lettered.

Delivery (``delivery.py``): an offset is committed only together with, or after, the answers for it
*and for every earlier offset of its partition* (``OffsetTracker``): in one Kafka transaction
(``exactly_once``, the default) or behind the broker's acknowledgements (``at_least_once``). A crash
never loses a request; a clean shutdown (SIGTERM/SIGINT: stop fetching, finish what is in flight,
publish, commit, close) repeats nothing.

Backpressure: at most ``max_inflight_requests`` requests and ``max_inflight_tokens`` prompt tokens are
in flight; beyond that every assigned partition is paused, and resumed once the work drains below
80 % of both limits. Memory stays bounded however fast producers publish.

Rebalance: before partitions are taken away, their in-flight work gets ``rebalance_drain_s`` to
finish and their finished offsets are committed; work that finishes later is abandoned (``exactly_once``:
never committed, the new owner answers it; ``at_least_once``: published, not committed). The whole
revocation fits in ``rebalance_timeout_ms`` (set explicitly: aiokafka would use the session timeout):
a member that is still revoking when the group's rebalance times out is dropped, rejoins as a new member
and starts the next rebalance, so long drains under a short timeout made a rebalance storm.
Newly assigned partitions stay paused until they are *settled*: in ``exactly_once`` the partition's
transactional producer is initialised first (which waits until the previous owner's last transaction
is complete) and only then is the committed offset read and sought to. aiokafka reads committed offsets
on assignment without ``require_stable`` (KIP-447), so without this a new owner could start from the
offset before the previous owner's last commit and answer those requests a second time.

Unwritable records: the answer, dead-letter and provenance topics' message limits are read from the broker
at start (``limits.py``); an answer that does not fit its topic even compressed is published as an
``answer_too_large`` error answer under the same id, and a dead letter carries the raw bytes only up to
``dead_letter_max_bytes``, so no record can halt its partition by being refused forever. An error that no
retry can cure (``WorkerFatal``: no permission, a missing topic) stops the worker without committing past
the record; ``run`` raises it and ``d3stream serve`` exits with status 3.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from aiokafka import ConsumerRebalanceListener

from . import __version__
from .batching import BatchScheduler, PassRecord
from .config import Settings, check_settings, heartbeat_interval_ms
from .connection import client_options, connecting
from .decoding import ByteBudget, MediaDecoder
from .delivery import AtLeastOnce, ExactlyOnce, OffsetTracker, Outgoing
from .events import (
    HEADERS,
    Answer,
    BatchRecord,
    DeadLetter,
    ErrorInfo,
    EventError,
    MediaRecord,
    ModelRecord,
    Provenance,
    Request,
    RequestLimits,
    Source,
    Timings,
    Worker,
    decode_request,
    encode,
)
from .jobthread import JobThread
from .limits import Limits, WorkerFatal, producer_compression, read_topic_limits
from .metrics import Metrics
from .runtime.media import MediaBudgetExceeded, reason
from .storage import FetchedMedia, MediaError, MediaFetcher
from .tracing import Tracing, forwarded_headers, header_names

__all__ = ["OffsetTracker", "Service", "default_token_budget"]

log = structlog.get_logger(__name__)

# The (partition, offset) whose request the current task serves; schedulers that order passes by the
# source (deterministic replays) read it.
current_record: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "d3stream_current_record", default=None
)

# Partitions resume once in-flight work falls below this share of both limits.
RESUME_AT = 0.8
# A dead letter keeps this much of a record's key and of the reason (a decoder's message can quote input).
MAX_KEY_BYTES = 1024
MAX_REASON_CHARS = 2000


def default_token_budget(device: str) -> int:
    """Padded tokens per pass: a GPU keeps gaining up to ~16k, a CPU saturates at 1-4k."""
    return 16_384 if str(device).startswith("cuda") else 4_096


def provenance_digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# -------------------------------------------------------------------------------------------- service


@dataclass
class _Work:
    """What one request's answer is built from while it walks the stages."""

    source: Source
    received: float
    timings: Timings = field(default_factory=Timings)
    media: list[MediaRecord] = field(default_factory=list)
    batch: BatchRecord = field(default_factory=BatchRecord)
    tokens: int = 0
    media_bytes: int = 0  # held of the in-flight media budget
    questions: int = 0
    request: Request | None = None  # once decoded: even a worker fault is answered under its id
    extra: list[Outgoing] = field(default_factory=list)  # e.g. a dead letter, published with the answer
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS)  # of the answer and dead letter
    # When each stage started (perf_counter; 0: not reached): with the timings, what spans are built from.
    fetch_at: float = 0.0
    decode_at: float = 0.0
    prepare_at: float = 0.0
    submitted_at: float = 0.0
    publish_at: float = 0.0


class Service:
    """One d3stream worker: a consumer group member serving one model."""

    def __init__(
        self,
        settings: Settings,
        model: Any,
        *,
        fetcher: MediaFetcher | None = None,
        metrics: Metrics | None = None,
        tracing: Tracing | None = None,
    ):
        self.settings = check_settings(settings)
        # Spans of served requests (otlp_endpoint, or a caller's own, e.g. a test's in-memory exporter).
        self._owns_tracing = tracing is None
        self.tracing = tracing if tracing is not None else Tracing.from_settings(settings)
        # Request headers the answers carry: the trace headers, then forward_headers.
        self._forwarded_names = header_names(settings.forward_headers)
        self.model = model
        self.metrics = metrics or Metrics()
        if settings.torch_threads:
            import torch

            torch.set_num_threads(settings.torch_threads)
        if hasattr(model, "limit_prompt_tokens"):
            model.limit_prompt_tokens(settings.max_prompt_tokens)
        if hasattr(model, "limit_request_tokens"):
            model.limit_request_tokens(settings.max_request_tokens)
        self.request_limits = RequestLimits.from_settings(settings)
        self.fetcher = fetcher or MediaFetcher(
            allowlist=settings.media_allowlist,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            max_concurrency=settings.s3_max_concurrency,
            connect_timeout=settings.s3_connect_timeout,
            read_timeout=settings.s3_read_timeout,
            max_attempts=settings.s3_max_attempts,
        )
        budget = settings.max_batch_tokens or default_token_budget(str(getattr(model, "device", "cpu")))
        self.prefix_runner = self._prefix_runner(settings, model, budget)
        self.provenance = model.provenance()
        if self.prefix_runner is not None:  # answers depend on the reuse policy too
            self.provenance.update(self.prefix_runner.provenance())
        self.provenance_sha256 = provenance_digest(self.provenance)
        self.model_record = ModelRecord(
            name=model.model_name, runtime=self.provenance.get("runtime", ""), provenance_sha256=self.provenance_sha256
        )
        self.worker = Worker(host=socket.gethostname(), pid=os.getpid(), version=__version__)
        self.tracker = OffsetTracker()
        # The limits of the topics answers and dead letters go to (read from the broker at start).
        self.limits = Limits(max_request_size=settings.max_request_size,
                             compression=producer_compression(settings.compression))
        self.fatal: WorkerFatal | None = None  # why the worker stopped by itself, if it did
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._inflight_requests = 0
        self._inflight_tokens = 0
        self._paused = False
        # Prompt preparation and prefix planning: one thread, woken once for many requests.
        self._prepare_thread = JobThread("d3stream-prepare")
        # Media decoding: images on a thread of their own, videos in killable processes, under a deadline;
        # decoded media wait for their share of max_inflight_media_bytes.
        self.decoder = MediaDecoder(
            timeout_s=settings.media_decode_timeout_s,
            processes=settings.media_decode_processes,
            max_pixels=settings.max_media_pixels,
            max_video_frames=settings.max_video_frames,
        )
        self.media_budget = ByteBudget(settings.max_inflight_media_bytes)
        # One model thread for both schedulers: passes never run side by side on the device.
        self._model_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3stream-model")
        self.scheduler: BatchScheduler = BatchScheduler(
            model.forward,
            length=lambda row: row.length,
            max_batch_rows=settings.max_batch_rows,
            max_batch_tokens=budget,
            linger_ms=settings.linger_ms,
            executor=self._model_executor,
            on_pass=self.metrics.observe_pass_record,
        )
        self.prefix_scheduler: BatchScheduler | None = None
        self._call_passes: list[Any] = []  # the runner's passes during the current call (model thread only)
        if self.prefix_runner is not None:
            self.prefix_scheduler = BatchScheduler(
                self._run_shared_prefix,
                length=lambda plan: plan.length + sum(plan.suffix_length(row) for row in plan.rows),
                max_batch_rows=settings.max_batch_rows,
                # A call packs its own passes under the budget; a few passes' worth per call keeps the
                # full-prompt scheduler's turn on the model thread near.
                max_batch_tokens=4 * budget,
                linger_ms=settings.linger_ms,
                executor=self._model_executor,
            )
        self.consumer: Any = None
        self.delivery: Any = None
        self.ready = False
        self.joined = False  # the consumer has an assignment (set by the rebalance listener)
        self.replay_id: str | None = None  # set by replays, so their answers are never taken for live ones
        self.metrics.set_model(model.model_name, self.provenance_sha256, str(getattr(model, "device", "cpu")))
        self.metrics.set_ready_check(
            lambda: self.ready and self.joined and not self._stop.is_set() and not self.stalled
        )
        self.stalled: list[str] = []  # partitions whose commit point has not moved for stall_unready_s
        self._inflight_questions = 0
        self.counts: dict[str, int] = {"answered": 0, "errors": 0, "dead_letters": 0}
        # Assigned partitions not yet positioned at their stable committed offset (kept paused meanwhile),
        # and the first offset of any record that arrived for one anyway (read again once settled).
        self._settling: dict[Any, asyncio.Task] = {}
        self._skipped_while_settling: dict[Any, int] = {}

    # ---------------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask the worker to shut down cleanly (safe to call from a signal handler)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until ``stop()``; then finish in-flight work, publish, commit and close."""
        with self._media_cache_lent():
            await self._serve_until_stopped()

    @contextlib.contextmanager
    def _media_cache_lent(self) -> Iterator[None]:
        """The model encodes through this service's media-feature cache while it serves, and is handed back as
        it was given however serving ends, so a model shared with other callers (a replay beside a live
        service, the next test) keeps no features, and no counter, from this one."""
        settings, model = self.settings, self.model
        if settings.media_cache_bytes <= 0 or not hasattr(model, "media_cache"):
            yield
            return
        from .runtime.cache import MediaFeatureCache

        before = model.media_cache
        model.media_cache = MediaFeatureCache(settings.media_cache_bytes, on_lookup=self.metrics.count_media_cache)
        try:
            yield
        finally:
            model.media_cache = before

    async def _serve_until_stopped(self) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        settings = self.settings
        if settings.create_topics:
            await self._connecting(self._ensure_topics())
        self.consumer = AIOKafkaConsumer(**client_options(
            settings,
            "consumer",
            client_id=settings.client_id,
            group_id=settings.group_id,
            group_instance_id=settings.group_instance_id,
            session_timeout_ms=settings.session_timeout_ms,
            rebalance_timeout_ms=settings.rebalance_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms(settings),
            # A JoinGroup waits on the broker for the whole rebalance: its request must outlast it.
            request_timeout_ms=max(40_000, settings.rebalance_timeout_ms + 5_000),
            enable_auto_commit=False,
            auto_offset_reset=settings.auto_offset_reset,
            isolation_level="read_committed",
        ))

        def producer_for(partition: Any) -> Any:
            options: dict[str, Any] = {}
            if partition is not None:
                options["transactional_id"] = (
                    f"{settings.transactional_id_prefix}-{settings.group_id}-{partition.topic}-{partition.partition}"
                )
            return AIOKafkaProducer(**client_options(
                settings,
                "producer",
                client_id=settings.client_id,
                acks="all",
                enable_idempotence=True,
                linger_ms=2,
                max_request_size=settings.max_request_size,
                compression_type=self.limits.compression,
                **options,
            ))

        self.delivery = self._delivery_class()(
            producer_factory=producer_for,
            consumer=self.consumer,
            tracker=self.tracker,
            group_id=settings.group_id,
            metrics=self.metrics,
        )
        await self._connecting(self.delivery.start())
        try:
            await self._read_limits()
            if getattr(self.model, "video_unavailable", True) is None:
                self.decoder.warm()  # the first video should not wait for its decoding process to start
            await self._publish_provenance()
            await self._connecting(self.consumer.start())
            await self._subscribe()
            try:
                self.ready = True
                log.info(
                    "serving",
                    topics=settings.request_topics,
                    group=settings.group_id,
                    model=self.model.model_name,
                    budget=self.scheduler.max_batch_tokens,
                )
                await self._consume()
                if self.fatal is None:  # after a worker-fatal error nothing more can be published
                    await self._drain(settings.shutdown_timeout_s)
                    await self._guarded(self.delivery.flush(self.tracker.partitions()))
                if self.fatal is not None:  # requests still in flight stay uncommitted: served again later
                    await self._cancel_tasks()
            finally:
                self.ready = False
                await self._stop_settling(list(self._settling))
                await self.consumer.stop()
        finally:
            await self.scheduler.close()
            if self.prefix_scheduler is not None:
                await self.prefix_scheduler.close()
            self._model_executor.shutdown(wait=True)
            await self.delivery.stop()
            self._prepare_thread.shutdown()
            self.decoder.close()
            self.fetcher.close()
            if self.tracing is not None and self._owns_tracing:
                self.tracing.shutdown()  # exports what is left
            elif self.tracing is not None:
                self.tracing.flush()
            log.info("stopped", **self.counts)
        if self.fatal is not None:
            raise self.fatal

    async def _cancel_tasks(self) -> None:
        tasks = [task for task in self._tasks if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _fail(self, exc: WorkerFatal) -> None:
        """A worker-fatal publish or commit error: stop; ``run`` raises it once everything is closed."""
        if self.fatal is None:
            log.error("stopping: publishing cannot go on", error=str(exc))
            self.fatal = exc
        self._stop.set()

    async def _guarded(self, step: Any) -> None:
        """Run a flush; a worker-fatal error stops the worker instead of ending the calling task."""
        try:
            await step
        except WorkerFatal as exc:
            self._fail(exc)

    async def _read_limits(self) -> None:
        """The message limits of the topics this worker publishes to, from the broker (WorkerFatal for a
        topic that does not exist while create_topics is off)."""
        settings = self.settings
        if not getattr(self.delivery, "writes_to_kafka", True):
            return
        self.limits.topics = await self._connecting(read_topic_limits(
            client_options(settings, "admin", client_id=settings.client_id),
            [settings.answer_topic, settings.dead_letter_topic, settings.provenance_topic],
            create_topics=settings.create_topics,
        ))
        log.info("topic limits", max_message_bytes=self.limits.topics, compression=self.limits.compression,
                 max_request_size=self.limits.max_request_size)

    async def _connecting(self, step: Any) -> Any:
        """Run a start-up step that connects to Kafka; a refusal becomes an error that names the knobs."""
        return await connecting(self.settings, step)

    # Hooks a replay (replay.py) overrides; the live service reads the topics from the committed offsets on.

    async def _subscribe(self) -> None:
        self.consumer.subscribe(self.settings.request_topics, listener=_Rebalance(self))

    async def _on_assigned(self, partitions: list[Any]) -> None:
        return None

    def _start_position(self, partition: Any, committed: int | None) -> int | None:
        """Where a settled partition is read from (a replay clamps it to its range); None: leave as is."""
        return committed

    def _accept(self, partition: Any, record: Any) -> bool:
        """Whether a fetched record is served (a replay skips what lies outside its range)."""
        return True

    async def _finished(self) -> bool:
        """Whether the work is complete without a stop request (a replay ends with its range)."""
        return False

    def _request_finished(self, partition: Any, offset: int) -> None:
        return None

    def _delivery_class(self) -> type:
        return ExactlyOnce if self.settings.delivery == "exactly_once" else AtLeastOnce

    async def _ensure_topics(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.errors import TopicAlreadyExistsError

        settings = self.settings
        admin = AIOKafkaAdminClient(**client_options(settings, "admin", client_id=settings.client_id))
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            wanted = [
                NewTopic(name, settings.topic_partitions, 1)
                for name in {*settings.request_topics, settings.answer_topic, settings.dead_letter_topic}
                if name not in existing
            ]
            if settings.provenance_topic not in existing:
                wanted.append(NewTopic(settings.provenance_topic, 1, 1, topic_configs={"cleanup.policy": "compact"}))
            for topic in wanted:
                try:
                    await admin.create_topics([topic])
                except TopicAlreadyExistsError:
                    pass
        finally:
            await admin.close()

    async def _publish_provenance(self) -> None:
        payload = json.dumps(self.provenance, sort_keys=True, ensure_ascii=False).encode()
        await self.delivery.publish(Outgoing(self.settings.provenance_topic, self.provenance_sha256.encode(), payload))

    async def _consume(self) -> None:
        settings = self.settings
        next_commit = time.monotonic() + settings.commit_interval_ms / 1000
        flushing: asyncio.Task | None = None
        while not self._stop.is_set():
            room = max(1, settings.max_inflight_requests - self._inflight_requests)
            batches = await self.consumer.getmany(timeout_ms=100, max_records=room)
            for partition, records in batches.items():
                if partition in self._settling:  # not positioned yet: read again once it is
                    first = records[0].offset if records else None
                    if first is not None:
                        skipped = self._skipped_while_settling
                        skipped[partition] = min(skipped.get(partition, first), first)
                    continue
                for record in records:
                    if not self._accept(partition, record):
                        continue
                    epoch = self.tracker.add(partition, record.offset)
                    self._inflight_requests += 1
                    task = asyncio.create_task(self._serve(partition, record, epoch))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            self._apply_backpressure()
            self.metrics.set_in_flight(self._inflight_requests, self._inflight_questions, self._inflight_tokens)
            self.metrics.set_paused(self._paused)
            if time.monotonic() >= next_commit and (flushing is None or flushing.done()):
                # Committing runs beside consumption: a transaction's round trips must not stall fetching.
                flushing = asyncio.create_task(self._flush_and_report())
                next_commit = time.monotonic() + settings.commit_interval_ms / 1000
            if await self._finished():
                break
        if flushing is not None:
            await flushing

    async def _flush_and_report(self) -> None:
        await self._guarded(self.delivery.flush())
        await self._report_lag()

    async def _report_lag(self) -> None:
        """Per partition: read lag (behind the position), committed lag (behind the commit point), the oldest
        unanswered request, and how long the commit point has stood still with work waiting; a stall longer
        than ``stall_unready_s`` makes the worker unready."""
        now = time.monotonic()
        stalled = []
        for partition in self.consumer.assignment():
            oldest, stalled_s = self.tracker.stall(partition, now)
            if self.settings.stall_unready_s and stalled_s >= self.settings.stall_unready_s:
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
                        partitions=stalled, stall_unready_s=self.settings.stall_unready_s)
        self.stalled = stalled

    def _apply_backpressure(self) -> None:
        settings = self.settings
        full = (
            self._inflight_requests >= settings.max_inflight_requests
            or self._inflight_tokens >= settings.max_inflight_tokens
            or self.media_budget.full
        )
        drained = (
            self._inflight_requests < RESUME_AT * settings.max_inflight_requests
            and self._inflight_tokens < RESUME_AT * settings.max_inflight_tokens
            and self.media_budget.used < RESUME_AT * self.media_budget.capacity
        )
        assignment = self.consumer.assignment()
        if full and not self._paused and assignment:
            self.consumer.pause(*assignment)
            self._paused = True
            log.debug("paused", requests=self._inflight_requests, tokens=self._inflight_tokens)
        elif self._paused and drained:
            self.consumer.resume(*(p for p in assignment if p not in self._settling))
            self._paused = False
            log.debug("resumed", requests=self._inflight_requests, tokens=self._inflight_tokens)

    def _begin_settling(self, partitions: list[Any]) -> None:
        """Hold newly assigned partitions paused until the delivery is ready for them and they are read
        from their stable committed offset (runs outside the rebalance callback, which must not block)."""
        if not getattr(self.delivery, "settles_assignments", False) or not partitions:
            return
        self.consumer.pause(*partitions)
        task = asyncio.create_task(self._settle(partitions))
        for partition in partitions:
            self._settling[partition] = task

    async def _settle(self, partitions: list[Any]) -> None:
        try:
            await self.delivery.assigned(partitions)
            for partition in partitions:
                if partition not in self.consumer.assignment():
                    continue
                skipped = self._skipped_while_settling.pop(partition, None)
                try:
                    position = self._start_position(partition, await self.consumer.committed(partition))
                except Exception as exc:  # noqa: BLE001 - then from where aiokafka positioned it, or what was skipped
                    log.warning("committed offset not re-read", partition=str(partition), error=str(exc))
                    position = None
                if position is None:
                    position = skipped
                if position is not None:
                    self.consumer.seek(partition, position)
        finally:
            assignment = self.consumer.assignment()
            settled = [p for p in partitions if self._settling.get(p) is asyncio.current_task()]
            for partition in settled:
                self._settling.pop(partition, None)
            if not self._paused:
                self.consumer.resume(*(p for p in settled if p in assignment))
            log.debug("partitions settled", partitions=[f"{p.topic}-{p.partition}" for p in settled])

    async def _stop_settling(self, partitions: list[Any]) -> None:
        tasks = {self._settling.pop(p) for p in partitions if p in self._settling}
        for partition in partitions:
            self._skipped_while_settling.pop(partition, None)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _drain(self, timeout: float, partitions: Sequence[Any] | None = None) -> None:
        """Wait until the in-flight work (of ``partitions``, or all) is answered, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self.tracker.in_flight(partitions) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if partitions is None and self._tasks:
            await asyncio.wait(list(self._tasks), timeout=max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------------------- one request

    async def _serve(self, partition: Any, record: Any, epoch: int | None = None) -> None:
        current_record.set((partition, record.offset))
        try:
            await self._serve_record(partition, record, epoch)
        finally:
            self._request_finished(partition, record.offset)

    async def _serve_record(self, partition: Any, record: Any, epoch: int | None = None) -> None:
        work = _Work(
            source=Source(
                topic=record.topic, partition=record.partition, offset=record.offset, timestamp=record.timestamp
            ),
            received=time.perf_counter(),
        )
        forwarded = forwarded_headers(record.headers, self._forwarded_names, self.settings.forward_headers_max_bytes)
        if forwarded:
            work.headers = [*HEADERS, *forwarded]
        try:
            answer = await self._answer(record, work)
        except Exception as exc:  # noqa: BLE001 - a worker fault still gets its request an answer
            log.exception("request failed", offset=record.offset, partition=record.partition)
            answer = self._error(record, work, "internal_error", reason(exc), request=work.request)
        finally:
            self._inflight_tokens -= work.tokens
            self.media_budget.release(work.media_bytes)
        work.timings.total = _ms(time.perf_counter() - work.received)
        answer.answer_id = answer_identity(answer, self.provenance_sha256)
        answer, outgoing = self._fitted(record, work, answer)
        records = [*work.extra, outgoing]
        try:
            work.publish_at = time.perf_counter()
            await self.delivery.deliver(partition, record.offset, records, epoch)
            published = time.perf_counter()
            self.metrics.observe_stage("publish", published - work.publish_at)
            self.metrics.observe_stage("end_to_end", published - work.received)
            if self.tracing is not None:
                self.tracing.request_served(record, work, answer, published)
        except WorkerFatal as exc:
            log.error("answer could not be published; the offset stays uncommitted", offset=record.offset,
                      partition=record.partition, error=str(exc))
            self._fail(exc)
            return
        except Exception:
            log.exception("answer could not be published; the offset stays uncommitted", offset=record.offset)
            self._stop.set()
            raise
        finally:
            self._inflight_requests -= 1
            self._inflight_questions -= work.questions
        self.counts["errors" if answer.error else "answered"] += 1
        self.metrics.count_answer(answer.error.code if answer.error else None)

    async def _answer(self, record: Any, work: _Work) -> Answer:
        try:
            request = decode_request(record.value, record.key, self.request_limits)
        except EventError as exc:
            if exc.code == "undecodable_event":
                work.extra.append(self._dead_letter(record, work, str(exc)))
            return self._error(record, work, exc.code, str(exc), request_id=exc.request_id)
        work.request = request
        if request.model is not None and request.model != self.model.model_name:
            return self._error(
                record,
                work,
                "model_not_served",
                f"this worker serves {self.model.model_name!r}, not {request.model!r}",
                request=request,
            )
        work.questions = len(request.questions)
        self._inflight_questions += work.questions
        if (request.images or request.videos) and self._may_exceed_tokens(record, request):
            try:  # refuse a request certainly over max_request_tokens before fetching its media
                await self._prepare_thread.run(
                    lambda: self.model.check_request_tokens(
                        request.state, request.questions, permutation_average=request.permutation_average
                    )
                )
            except ValueError as exc:
                return self._error(record, work, "invalid_request", str(exc), request=request)
        media = await self._media(record, work, request)
        if isinstance(media, Answer):
            return media
        decoded_images, decoded_videos = media
        try:
            started = work.prepare_at = time.perf_counter()
            prepared = await self._prepare_thread.run(
                lambda: self.model.prepare(
                    request.state,
                    request.questions,
                    decoded_images=decoded_images,
                    decoded_videos=decoded_videos,
                    permutation_average=request.permutation_average,
                ),
            )
            work.timings.prepare = _ms(time.perf_counter() - started)
            self.metrics.observe_stage("prepare", time.perf_counter() - started)
        except ValueError as exc:
            return self._error(record, work, "invalid_request", str(exc), request=request)
        work.tokens = prepared.input_tokens
        self._inflight_tokens += work.tokens
        plan = None
        if self.prefix_runner is not None and len(prepared.rows) >= self.prefix_runner.min_rows:
            plan = await self._prepare_thread.run(lambda: self._plan_shared_prefix(prepared))
        if plan is not None:
            probabilities = await self._run_shared(plan, prepared, work)
        else:
            probabilities = await self._run_rows(prepared, work)
        response = prepared.answers(probabilities)
        return Answer(
            id=request.id,
            source=work.source,
            model=response["model"],
            answers=response["answers"],
            usage=response["usage"],
            provenance=self._provenance(work),
            metadata=request.metadata,
        )

    async def _media(self, record: Any, work: _Work, request: Request) -> tuple[list, list] | Answer:
        """Fetch and decode a request's media, or the error answer that ends it. The reference count is
        checked before any fetch, pixel and frame totals (from headers) before any decode; identical
        references are fetched and decoded once."""
        if not request.images and not request.videos:
            return [], []
        settings = self.settings
        references = len(request.images) + len(request.videos)
        if references > settings.max_media_references:
            return self._error(
                record, work, "invalid_request",
                f"the request names {references:,} images and videos; at most {settings.max_media_references:,} "
                "are accepted (setting: max_media_references)",
                request=request,
            )
        for kind, listed in (("image", request.images), ("video", request.videos)):
            unavailable = getattr(self.model, f"{kind}_unavailable", None)
            if listed and unavailable is not None:
                return self._error(record, work, "media_unreadable", f"{kind} inputs are not available: {unavailable}",
                                   request=request)
        try:
            started = work.fetch_at = time.perf_counter()
            images, videos = await asyncio.gather(
                self.fetcher.fetch_all(request.images, "image"), self.fetcher.fetch_all(request.videos, "video")
            )
            work.timings.fetch = _ms(time.perf_counter() - started)
            self.metrics.observe_stage("fetch", time.perf_counter() - started)
            work.media = [_media_record(item) for item in (*images, *videos)]
            fetched = {id(item): len(item.data) for item in (*images, *videos)}  # a repeated reference once
            self.metrics.add_media_bytes(sum(fetched.values()))
        except MediaError as exc:
            return self._error(record, work, exc.code, exc.message, request=request)

        async def reserve(estimate: int) -> None:
            work.media_bytes = await self.media_budget.acquire(estimate)

        try:
            started = work.decode_at = time.perf_counter()
            decoded = await self.decoder.decode([i.data for i in images], [v.data for v in videos], reserve)
            work.timings.decode = _ms(time.perf_counter() - started)
            self.metrics.observe_stage("decode", time.perf_counter() - started)
        except MediaBudgetExceeded as exc:
            return self._error(record, work, "invalid_request", str(exc), request=request)
        except ValueError as exc:
            return self._error(record, work, "media_unreadable", str(exc), request=request)
        held = decoded.nbytes
        if held < work.media_bytes:  # keep what the media really take, give the rest of the estimate back
            self.media_budget.release(work.media_bytes - held)
            work.media_bytes = held
        return decoded.images, decoded.videos

    def _may_exceed_tokens(self, record: Any, request: Request) -> bool:
        check = getattr(self.model, "request_may_exceed_tokens", None)
        return check is not None and check(len(record.value), len(request.questions))

    async def _run_rows(self, prepared: Any, work: _Work) -> dict[Any, list[float]]:
        """Submit a request's rows to the shared scheduler; a row whose pass failed alone fails its question."""
        if not prepared.rows:
            return {}
        submitted = work.submitted_at = time.perf_counter()
        outcomes = await self.scheduler.submit_each(prepared.rows)
        probabilities: dict[Any, list[float]] = {}
        passes: dict[int, PassRecord] = {}
        for row, outcome in zip(prepared.rows, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                question = prepared.questions[row.key]
                prepared.errors[row.key] = {
                    "type": question.kind,
                    "error": "invalid_model_output",
                    "message": f"the forward pass failed for this question: {type(outcome).__name__}: {outcome}",
                }
                continue
            (result, record) = outcome
            probabilities[row] = result
            passes[id(record)] = record
        prepared.rows = [row for row in prepared.rows if row.key not in prepared.errors]
        self._account_passes(work, submitted, list(passes.values()))
        return probabilities

    def _account_passes(self, work: _Work, submitted: float, passes: Sequence[Any], **batch: Any) -> None:
        """The request's forward and queueing time and its batch record, from the passes that carried it
        (``PassRecord`` or the prefix runner's ``PassInfo``: both have rows, tokens and seconds)."""
        forward = sum(record.seconds for record in passes)
        queued = max(0.0, time.perf_counter() - submitted - forward)
        work.timings.forward = _ms(forward)
        work.timings.queued = _ms(queued)
        self.metrics.observe_stage("forward", forward)
        self.metrics.observe_stage("queued", queued)
        work.batch = BatchRecord(
            passes=len(passes),
            rows=sum(record.rows for record in passes),
            real_tokens=sum(record.real_tokens for record in passes),
            padded_tokens=sum(record.padded_tokens for record in passes),
            **batch,
        )

    # --------------------------------------------------------------------- shared-prefix reuse

    @staticmethod
    def _reuse_wanted(settings: Settings, model: Any) -> bool:
        if settings.prefix_reuse == "off" or not hasattr(model, "attention_mode"):
            return False
        if model.attention_mode == "causal":
            return True
        if settings.prefix_reuse == "on":
            raise ValueError(
                f"prefix_reuse=on needs a causal checkpoint; {model.model_name} uses attention_mode="
                f"{model.attention_mode!r}, where the prefix reads the question. Set prefix_reuse to auto or off."
            )
        return False

    def _prefix_runner(self, settings: Settings, model: Any, budget: int) -> Any:
        if not self._reuse_wanted(settings, model):
            return None
        from .runtime.prefix import PrefixRunner

        def checked(check: Any) -> None:
            self.metrics.observe_prefix_check(check.passed, self.prefix_runner.max_abs_dp)

        return PrefixRunner(
            model,
            max_batch_tokens=budget,
            max_batch_rows=settings.max_batch_rows,
            verify_every=settings.prefix_verify_every,
            tolerance=settings.prefix_tolerance,
            on_pass=self._runner_pass,
            on_check=checked,
            on_fallback=lambda reason, prepared: self.metrics.count_prefix_request(reason),
        )

    def _runner_pass(self, info: Any) -> None:
        self._call_passes.append(info)
        self.metrics.observe_pass_record(info)

    def _plan_shared_prefix(self, prepared: Any) -> Any:
        plan = self.prefix_runner.plan(prepared)
        if plan is not None:
            self.metrics.count_prefix_request("shared")
        return plan

    def _run_shared_prefix(self, plans: list[Any]) -> list[tuple[dict[Any, list[float]], list[Any]]]:
        """One call of the prefix runner on the model thread: each request's probabilities, and the passes
        that answered its rows (for its provenance)."""
        self._call_passes = []
        results = self.prefix_runner.run_requests(plans)
        passes = self._call_passes
        return [
            (result, [info for info in passes if plan in info.prefixes or any(row in result for row in info.done)])
            for plan, result in zip(plans, results, strict=True)
        ]

    async def _run_shared(self, plan: Any, prepared: Any, work: _Work) -> dict[Any, list[float]]:
        """A multi-question request on its shared prefix; if that fails, its rows run as full prompts."""
        submitted = work.submitted_at = time.perf_counter()
        try:
            [((probabilities, passes), _)] = await self.prefix_scheduler.submit([plan])
        except Exception as exc:  # noqa: BLE001 - the full-prompt path splits and reports row failures
            log.warning("shared-prefix run failed; running full prompts", error=f"{type(exc).__name__}: {exc}")
            return await self._run_rows(prepared, work)
        # Shared only if each row's answer came from a suffix pass (a failed check re-answers from full prompts).
        answered_by = {row: info.kind for info in passes if info.kind in ("suffix", "full") for row in info.done}
        reused = bool(answered_by) and all(kind == "suffix" for kind in answered_by.values())
        self._account_passes(work, submitted, passes, shared_prefix=reused,
                             saved_tokens=(len(plan.rows) - 1) * plan.length if reused else 0)
        return probabilities

    def _provenance(self, work: _Work) -> Provenance:
        return Provenance(
            model=self.model_record,
            media=work.media,
            batch=work.batch,
            timings=work.timings,
            worker=self.worker,
            replay_id=self.replay_id,
        )

    def _error(
        self,
        record: Any,
        work: _Work,
        code: str,
        message: str,
        *,
        request: Request | None = None,
        request_id: str | None = None,
    ) -> Answer:
        answer_id = (request.id if request else None) or request_id
        if not answer_id:  # no id anywhere: name the request by where it was read
            answer_id = f"{record.topic}/{record.partition}/{record.offset}"
        log.info("request refused", id=answer_id, code=code, reason=message[:300], offset=record.offset)
        return Answer(
            id=answer_id,
            source=work.source,
            model=self.model.model_name,
            error=ErrorInfo(code=code, message=message),
            provenance=self._provenance(work),
            metadata=request.metadata if request else None,
        )

    def _dead_letter(self, record: Any, work: _Work, reason: str) -> Outgoing:
        """The dead letter of a record: the reason, and its raw bytes up to ``dead_letter_max_bytes`` (with
        the size and SHA-256 of all of them). Should even that be refused as too large, its replacement
        keeps the size and hash only."""
        raw = record.value or b""
        kept = raw[: max(0, self.settings.dead_letter_max_bytes)]
        key = (record.key or b"")[:MAX_KEY_BYTES] or None
        letter = DeadLetter(
            reason=reason[:MAX_REASON_CHARS],
            source=work.source,
            key=key.decode("utf-8", "replace") if key else None,
            value=base64.b64encode(kept).decode(),
            value_bytes=len(raw),
            value_sha256=hashlib.sha256(raw).hexdigest(),
            value_truncated=len(kept) < len(raw),
        )
        self.counts["dead_letters"] += 1
        self.metrics.count_dead_letter()
        topic = self.settings.dead_letter_topic
        bare = msgspec.structs.replace(letter, value="", value_truncated=bool(raw))
        value = encode(letter)
        headers = work.headers
        if not self.limits.fit(topic, key, value, headers).fits:
            value = encode(bare)
        return Outgoing(topic, key, value, headers=headers,
                        replacement=lambda cause: Outgoing(topic, key, encode(bare), headers=headers))

    def _fitted(self, record: Any, work: _Work, answer: Answer) -> tuple[Answer, Outgoing]:
        """The answer and its record if it fits the answer topic; else an ``answer_too_large`` error answer
        under the same id (a refusal by the broker later on replaces it the same way)."""
        topic = self.settings.answer_topic
        headers = work.headers
        value = encode(answer)
        fit = self.limits.fit(topic, answer.id.encode(), value, headers)
        if fit.fits:
            def instead(cause: str) -> Outgoing:
                self.metrics.count_answer("answer_too_large")
                smaller = self._too_large(record, work, answer, f"the broker refused it for topic {topic!r}: {cause}")
                return Outgoing(topic, smaller.id.encode(), encode(smaller), headers=headers)

            return answer, Outgoing(topic, answer.id.encode(), value, headers=headers, replacement=instead)
        smaller = self._too_large(record, work, answer, fit.reason)
        return smaller, Outgoing(topic, smaller.id.encode(), encode(smaller), headers=headers)

    def _too_large(self, record: Any, work: _Work, answer: Answer, reason: str) -> Answer:
        """An ``answer_too_large`` error answer for ``answer``: no answers and no echoed metadata; the
        provenance loses its media list and the id its text if even that does not fit."""
        message = (
            f"the answer to this request is too large to publish: {reason}. Ask fewer questions or fewer options "
            "per request, or raise the answer topic's max.message.bytes (and max_request_size)"
        )
        smaller = self._error(record, work, "answer_too_large", message, request_id=answer.id)
        smaller.answer_id = answer.answer_id
        for shrink in (_without_media, _without_id):
            if self.limits.fit(self.settings.answer_topic, smaller.id.encode(), encode(smaller), work.headers).fits:
                break
            smaller = shrink(smaller, record)
        return smaller


def answer_identity(answer: Answer, provenance_sha256: str) -> str:
    """The same request record answered by the same model always gets the same answer id, so a
    duplicate published after a crash (at_least_once) can be recognised and dropped downstream."""
    source = answer.source
    text = f"{source.topic}\x00{source.partition}\x00{source.offset}\x00{answer.id}\x00{provenance_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class _Rebalance(ConsumerRebalanceListener):
    """Finish and commit revoked partitions' work before they move to another worker."""

    def __init__(self, service: Service):
        self.service = service

    async def on_partitions_revoked(self, revoked: Any) -> None:
        """Drain, commit and let go, all within the rebalance timeout: the member rejoins only when this
        returns, and one that rejoins too late is dropped and starts another rebalance."""
        revoked = list(revoked)
        if not revoked:
            return
        service = self.service
        settings = service.settings
        started = time.monotonic()
        # What is left of the rebalance timeout after the drain; a second of it stays for the rejoin itself.
        deadline = started + settings.rebalance_timeout_ms / 1000 - 1.0
        await service._stop_settling(revoked)
        await service._drain(settings.rebalance_drain_s, revoked)
        abandoned = service.tracker.in_flight(revoked)
        committed = await _within(service._guarded(service.delivery.flush(revoked)), deadline,
                                  "final commit of revoked partitions")
        await _within(service.delivery.revoked(revoked), deadline, "closing revoked partitions' producers")
        service.tracker.forget(revoked)  # from here on, late answers of these partitions are not committed
        service.metrics.forget_partitions([(p.topic, p.partition) for p in revoked])
        service.metrics.count_revoked(len(revoked), abandoned)
        if service._paused:
            service._paused = False  # a new assignment starts unpaused
        log.info("partitions revoked", partitions=[f"{p.topic}-{p.partition}" for p in revoked],
                 abandoned=abandoned, committed=committed, seconds=round(time.monotonic() - started, 3))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        assigned = list(assigned)
        service = self.service
        if getattr(service.delivery, "settles_assignments", False):
            service._begin_settling(assigned)  # delivery.assigned runs there, outside this callback
        else:
            await service.delivery.assigned(assigned)
        await service._on_assigned(assigned)
        service.joined = True
        generation = getattr(getattr(service.consumer, "_coordinator", None), "generation", None)
        service.metrics.count_rebalance(generation, len(assigned), len(service.consumer.assignment()))
        log.info("partitions assigned", partitions=[f"{p.topic}-{p.partition}" for p in assigned],
                 generation=generation)


async def _within(step: Any, deadline: float, what: str) -> bool:
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


def _without_media(answer: Answer, record: Any) -> Answer:
    media = answer.provenance.media
    note = f"the provenance lists {len(media)} media objects; left out to fit the message limit"
    return msgspec.structs.replace(
        answer,
        provenance=msgspec.structs.replace(answer.provenance, media=[]),
        error=ErrorInfo(code=answer.error.code, message=f"{answer.error.message} ({note})"),
    )


def _without_id(answer: Answer, record: Any) -> Answer:
    """A request id too long to publish: the answer is named by where the request was read."""
    return msgspec.structs.replace(answer, id=f"{record.topic}/{record.partition}/{record.offset}")


def _media_record(item: FetchedMedia) -> MediaRecord:
    return MediaRecord(uri=item.uri, etag=item.etag, version=item.version, bytes=len(item.data), sha256=item.sha256)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
