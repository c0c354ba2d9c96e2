"""One d3stream worker: the request pipeline, a consume loop and a delivery mode, put together.

``Service(settings, model).run()`` (or ``Service(settings, [default, other, ...])``: several models in one
worker, routed by the request's ``model``) serves until ``stop()`` (SIGTERM/SIGINT: stop fetching, finish what is in
flight, publish, commit, close; a crash never loses a request, a clean shutdown repeats nothing). The parts:

* ``pipeline.RequestPipeline`` answers the records of each fetch (no Kafka in it);
* ``consume.ConsumeLoop`` reads them under a ``ReadPolicy`` (the live stream here; a replay passes its range),
  with backpressure, settling of new assignments, rebalances and the commit cadence;
* a delivery mode (``commits.DELIVERY_MODES``) is a sink (``sinks.py``: Kafka topics or a file) and a commit
  policy (``commits.py``: in the answers' transaction, or after they are written).

This module wires them and owns what spans them: the start-up order (topics, limits, a provenance record per
model, consumer), the one model thread every model's passes share (one device: passes never run side by side), the handler that delivers each fetch's answers and counts them, and the clean-up. An error that no
retry can cure (``WorkerFatal``: no permission, a missing topic) stops the worker without committing past the
record; ``run`` raises it and ``d3stream serve`` exits with status 3.

The handler is also the guard for what escapes the pipeline anyway (``_answer_guarded``): a fetch whose
answering raises is answered again a record at a time, and a record whose own handling still raises is skipped
(answered ``internal_error`` naming the exception, dead-lettered, counted in ``d3stream_records_failed_total``),
so its partition goes on; a handler that dies even so is logged and makes the worker not ready (``Metrics.watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer
from d3stream_client.contract import Answer, DeadLetter, ModelRecord, Worker

from d3stream import __version__
from d3stream.core.answers import AnswerBuilder, answer_identity, provenance_digest
from d3stream.core.decoding import ByteBudget, MediaDecoder
from d3stream.core.inflight import InFlightLedger
from d3stream.core.outgoing import Outgoing, RecordWriter
from d3stream.core.passes import Passes, RowScheduler, default_token_budget, model_thread
from d3stream.core.pipeline import RequestPipeline, skipped
from d3stream.core.record import RequestRecord, Stage
from d3stream.core.routing import Hosted, Router
from d3stream.core.seams import DecisionModel, InputRecord, Position, position_of
from d3stream.core.storage import MediaFetcher
from d3stream.kafka.commits import DELIVERY_MODES, Answered, CommitPolicy, delivery_for, sink_for
from d3stream.kafka.connection import check_connection, connecting
from d3stream.kafka.consume import ConsumeLoop, Fetch, LiveRead, ReadPolicy, group_consumer
from d3stream.kafka.limits import Limits, WorkerFatal, producer_compression
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.registry import Registry
from d3stream.kafka.sinks import KafkaTopics, Sink, ensure_topics
from d3stream.models.rollout import rollout_for
from d3stream.models.shadow import shadow_hosted
from d3stream.ops.collector import tuned_collector
from d3stream.ops.metrics import Metrics
from d3stream.ops.tracing import Tracing
from d3stream.runtime.cache import lent_media_caches
from d3stream.runtime.cpu_threads import release_idle_teams
from d3stream.runtime.media import reason
from d3stream.settings import Settings

__all__ = ["OffsetTracker", "Service", "answer_identity", "default_token_budget"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


def _served_models(model: DecisionModel | Sequence[DecisionModel], settings: Settings,
                   scheduler: RowScheduler | None) -> list[DecisionModel]:
    """The models a worker serves (the first is the default). A row scheduler of one's own (a deterministic
    replay) serves one fixed model; ValueError names the setting that asks for more."""
    models = list(model) if isinstance(model, Sequence) else [model]
    if not models:
        raise ValueError("a worker needs a model to serve (setting: model)")
    if scheduler is not None and len(models) > 1:
        raise ValueError("a row scheduler of one's own (a deterministic replay) serves one model: give one --model")
    if scheduler is not None and (settings.models.model_source or settings.models.canary):
        raise ValueError("a deterministic replay serves one fixed model: model_source and canary do not apply")
    return models


def _use_torch_threads(count: int | None) -> None:
    """Cap torch's intra-op threads (torch_threads; unset leaves torch's own choice)."""
    if count:
        import torch

        torch.set_num_threads(count)


class Service:
    """One d3stream worker: a consumer group member serving one model, or several (the first is the default)."""

    def __init__(self, settings: Settings, model: DecisionModel | Sequence[DecisionModel], *,
                 fetcher: MediaFetcher | None = None, metrics: Metrics | None = None,
                 tracing: Tracing | None = None, read: ReadPolicy | None = None,
                 scheduler: RowScheduler | None = None, answer_file: Path | None = None,
                 replay_id: str | None = None, shadow: DecisionModel | None = None):
        self.settings = settings = settings.check()
        check_connection(settings.connection)
        self.models = _served_models(model, settings, scheduler)
        self.metrics = metrics or Metrics()
        # Spans of served requests (otlp_endpoint, or a caller's own, e.g. a test's in-memory exporter).
        self._owns_tracing = tracing is None
        self.tracing = tracing if tracing is not None else Tracing.from_settings(settings)
        _use_torch_threads(settings.models.torch_threads)
        # The model thread takes the intra-op threads: a team this thread kept from loading would slow every pass.
        release_idle_teams()
        # A shadow checkpoint of its own (--shadow NAME=PATH), loaded by the caller; replays have none.
        self.shadow_model = shadow if replay_id is None and scheduler is None else None
        self.read = read or LiveRead(settings.delivery.request_topics)
        self.mode = DELIVERY_MODES["jsonl_file" if answer_file is not None else settings.delivery.mode]
        self.answer_file = answer_file
        self.fetcher = fetcher or MediaFetcher.from_settings(settings.storage)
        # The limits of the topics answers and dead letters go to (read from the broker at start).
        self.limits = Limits(max_request_size=settings.delivery.max_request_size,
                             compression=producer_compression(settings.delivery.compression))
        # One device, one model thread: every model's passes take turns on it, never side by side.
        self.model_thread = model_thread(settings.models.torch_threads)
        self.worker = Worker(host=socket.gethostname(), pid=os.getpid(), version=__version__)
        # How answers and dead letters become records: JSON, or the registry's format once chosen at start.
        self.record_writer = RecordWriter()
        served, shadowing = self._host_served(scheduler, replay_id)
        # Media decoding: images on a thread of their own, videos in killable processes, under a deadline;
        # decoded media wait for their share of max_inflight_media_bytes.
        self.decoder = MediaDecoder.from_settings(settings.media)
        # What in-flight requests hold, taken and given back through one owner (the consume loop's
        # backpressure reads its counts): requests, questions, tokens, tenant quotas, the media budget.
        self.ledger = InFlightLedger(media_budget=ByteBudget(settings.media.max_inflight_media_bytes),
                                     tenant_max_inflight_tokens=settings.batching.tenant_max_inflight_tokens)
        self.in_flight = self.ledger.counts
        self.pipeline = self._request_pipeline(served, shadowing)
        # Live serving lets answers leave out of offset order (settings.delivery.ordering) and records the done offsets
        # beyond each commit point; a replay keeps offset order and commits the point alone.
        self.tracker = OffsetTracker(settings.delivery.ordering if replay_id is None else "partition",
                                     record_done=replay_id is None,
                                     metadata_bytes=settings.delivery.offset_metadata_max_bytes)
        # The watched model source (swaps without a stop) and the canary share (rollout.py), when set.
        self.rollout = rollout_for(settings, self, self.metrics)
        # Made when it runs: the Kafka consumer, where answers go and how offsets commit, the loop over them.
        self.sink: Sink | None = None
        self.delivery: CommitPolicy | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.loop: ConsumeLoop | None = None
        # Requests framed by a Schema Registry, and answers written through it (kafka/registry.py).
        self.registry = (Registry(settings.registry, metrics=self.metrics,
                                  max_record_bytes=settings.limits.max_request_bytes)
                         if settings.registry.schema_registry_url else None)
        self.ready = False
        self._stop_asked = False
        self._answered = 0
        self._errors = 0
        self._show_in_metrics()

    def _host(self, model: DecisionModel, scheduler: RowScheduler | None, replay_id: str | None) -> Hosted:
        """A served model's own parts, with the token limits every served model gets: passes on the shared
        model thread, its provenance (answers depend on prefix reuse too) and the answer builder that names it."""
        model.limit_prompt_tokens(self.settings.limits.max_prompt_tokens)
        model.limit_request_tokens(self.settings.limits.max_request_tokens)
        passes = Passes(self.settings.batching, model, self.metrics, scheduler, executor=self.model_thread)
        provenance = {**model.provenance(), **passes.provenance()}
        digest = provenance_digest(provenance)
        answers = AnswerBuilder(
            self.settings.delivery,
            model_record=ModelRecord(name=model.model_name, runtime=str(provenance.get("runtime", "")),
                                     provenance_sha256=digest),
            worker=self.worker, fit=self.limits.fit, metrics=self.metrics, replay_id=replay_id,
            write=self.record_writer,
        )
        return Hosted(model, passes, answers, provenance, digest)

    def _host_served(self, scheduler: RowScheduler | None,
                     replay_id: str | None) -> tuple[list[Hosted], Hosted | None]:
        """Every served model's parts, and the shadow (live serving only): a checkpoint of its own, hosted
        here, or the served model ``shadow`` names."""
        hosted = [self._host(each, scheduler, replay_id) for each in self.models]
        if replay_id is not None or scheduler is not None:
            return hosted, None
        own = self._host(self.shadow_model, None, replay_id) if self.shadow_model is not None else None
        return hosted, shadow_hosted(self.settings.models, hosted, own)

    def _request_pipeline(self, hosted: list[Hosted], shadow: Hosted | None) -> RequestPipeline:
        """The pipeline that answers each fetch for the served models (its router owns them from here on) and
        the shadow, on this worker's media path and in-flight counts, which the consume loop's backpressure reads too."""
        return RequestPipeline(
            self.settings, hosted, fetcher=self.fetcher, decoder=self.decoder, ledger=self.ledger,
            metrics=self.metrics, shadow=shadow,
        )

    def _show_in_metrics(self) -> None:
        """The default model's identity and kernels, and the readiness check, on the metrics endpoint."""
        self.metrics.set_model(self.model.model_name, self.provenance_sha256, str(self.model.device))
        self.metrics.set_kernels(self.model.kernel_record())
        self.metrics.set_ready_check(lambda: self.ready and self.joined and not self.stopping and not self.stalled
                                     and not self.registry_outage, why_not=lambda: self.registry_outage)

    def _hosted_all(self) -> list[Hosted]:
        """The served models and a shadow checkpoint of its own (a served model's shadow is one of them)."""
        hosted, shadow = self.hosted, self.shadow
        own = shadow is not None and all(shadow is not each for each in hosted)
        return [*hosted, *([shadow] if own and shadow is not None else [])]

    def host_model(self, model: DecisionModel) -> Hosted:
        """A model loaded while serving (a swap's new checkpoint), with the limits every served model gets;
        the rollout hands it to the pipeline once its provenance is published."""
        if self.settings.media.media_cache_bytes > 0 and hasattr(model, "media_cache"):  # loaded for this worker alone
            from d3stream.runtime.cache import MediaFeatureCache

            model.media_cache = MediaFeatureCache(self.settings.media.media_cache_bytes,
                                                  on_lookup=self.metrics.count_media_cache)
        hosted = self._host(model, None, None)
        self.router.host(hosted)
        return hosted

    async def unhost_model(self, hosted: Hosted) -> None:
        """A retired model that answered everything routed to it: its passes closed, forgotten."""
        await hosted.passes.close()
        self.router.unhost(hosted)

    async def publish_model_provenance(self, hosted: Hosted) -> None:
        """One model's provenance record, keyed by its digest (the topic is compacted)."""
        assert self.sink is not None
        payload = json.dumps(hosted.provenance, sort_keys=True, ensure_ascii=False).encode()
        await self.sink.publish_provenance(Outgoing(self.settings.delivery.provenance_topic, hosted.provenance_sha256.encode(),
                                                    payload, kind="provenance"))

    # ------------------------------------------------------------------------------ what it shows

    @property
    def router(self) -> Router:
        """The one owner of the served models (core/routing.py): which are served, which is the default."""
        return self.pipeline.router

    @property
    def hosted(self) -> list[Hosted]:
        """Every served model's parts (the router's, read-only here), the default first until a swap."""
        return self.router.every

    @property
    def default(self) -> Hosted:
        """The model answering requests that name none: the first served, until a rollout swaps it."""
        return self.router.default

    @property
    def model(self) -> DecisionModel:
        return self.default.model

    @property
    def passes(self) -> Passes:
        return self.default.passes

    @property
    def answers(self) -> AnswerBuilder:
        return self.default.answers

    @property
    def provenance(self) -> dict[str, object]:
        return self.default.provenance

    @property
    def provenance_sha256(self) -> str:
        return self.default.provenance_sha256

    @property
    def shadow(self) -> Hosted | None:
        """The shadow model's parts (a served model's, or a checkpoint of its own), if there is a shadow."""
        shadow = self.pipeline.shadow
        return shadow.hosted if shadow is not None else None

    @property
    def scheduler(self) -> RowScheduler:
        return self.passes.rows

    @property
    def counts(self) -> dict[str, int]:
        return {"answered": self._answered, "errors": self._errors, "dead_letters": self.answers.dead_letters}

    @property
    def joined(self) -> bool:
        """Whether the consumer holds an assignment."""
        return self.loop is not None and self.loop.joined

    @property
    def stopping(self) -> bool:
        return self._stop_asked or (self.loop is not None and self.loop.stopping.is_set())

    @property
    def stalled(self) -> list[str]:
        return self.loop.stalled if self.loop is not None else []

    @property
    def registry_outage(self) -> str | None:
        """Why the Schema Registry is not answering, while it is not (framed requests wait for it)."""
        return self.registry.health.outage if self.registry is not None else None

    @property
    def fatal(self) -> WorkerFatal | None:
        return self.loop.fatal if self.loop is not None else None

    # ---------------------------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask the worker to shut down cleanly (safe to call from a signal handler)."""
        self._stop_asked = True
        if self.registry is not None:
            self.registry.close()  # a fetch waiting out a registry outage is given up: its offsets stay uncommitted
        if self.loop is not None:
            self.loop.stop()

    async def run(self) -> None:
        """Serve until ``stop()``; then finish in-flight work, publish, commit and close."""
        with self._media_cache_lent(), tuned_collector(self.settings.lifecycle.gc_young_threshold):
            try:
                await self._serve_until_stopped()
            finally:
                await self._close()
        if self.fatal is not None:
            raise self.fatal

    async def _serve_until_stopped(self) -> None:
        settings = self.settings
        self.consumer = group_consumer(self.settings)
        self.sink = sink_for(self.mode, kafka=lambda: KafkaTopics(settings, self.limits, self.metrics),
                             file=self.answer_file)
        self.delivery = delivery_for(self.mode, sink=self.sink, consumer=self.consumer, tracker=self.tracker,
                                     group_id=settings.delivery.group_id, metrics=self.metrics)
        self.loop = ConsumeLoop(settings, self.consumer, commits=self.delivery, tracker=self.tracker, read=self.read,
                                handler=self._serve_fetch, ledger=self.ledger, metrics=self.metrics)
        if self._stop_asked:
            self.loop.stop()
        if settings.delivery.create_topics:
            await self._connecting(ensure_topics(self.settings, self.sink))
        await self._connecting(self.sink.start())
        await self.delivery.start()
        if self.registry is not None and settings.registry.answer_format != "json":
            try:
                self.record_writer.framing = await self.registry.writers_for(self._framed_topics())
            except asyncio.CancelledError:
                if not self._stop_asked:
                    raise
                return  # asked to stop while waiting for a registry that does not answer: nothing was read
        self.limits.topics = await self._connecting(self.sink.read_limits())
        log.info("topic limits", max_message_bytes=self.limits.topics, compression=self.limits.compression,
                 max_request_size=self.limits.max_request_size)
        if any(model.video_unavailable is None for model in self.models):
            self.decoder.warm()  # the first video should not wait for its decoding process to start
        await self._publish_provenance()
        await self._connecting(self.consumer.start())
        if self.rollout is not None:
            self.rollout.start()  # watches the model source beside the consume loop, never in its way
        try:
            self.ready = True
            log.info("serving", topics=settings.delivery.request_topics, group=settings.delivery.group_id,
                     models=[each.name for each in self.hosted], budget=self.passes.budget, delivery=self.mode.name)
            await self.loop.run()
        finally:
            self.ready = False
            await self.consumer.stop()

    def _framed_topics(self) -> dict[str, type[msgspec.Struct]]:
        """The topics written in the registry's wire format, and the event each carries."""
        delivery = self.settings.delivery
        topics: dict[str, type[msgspec.Struct]] = {delivery.answer_topic: Answer, delivery.dead_letter_topic: DeadLetter}
        if self.settings.models.shadow_topic:
            topics[self.settings.models.shadow_topic] = Answer
        return topics

    async def _close(self) -> None:
        if self.rollout is not None:
            await self.rollout.stop()
        for hosted in self._hosted_all():
            await hosted.passes.close()
        self.model_thread.shutdown(wait=True)
        if self.delivery is not None:
            await self.delivery.stop()
        if self.sink is not None:
            await self.sink.stop()
        self.pipeline.close()
        self.decoder.close()
        self.fetcher.close()
        if self.registry is not None:
            await self.registry.aclose()
        if self.tracing is not None and self._owns_tracing:
            self.tracing.shutdown()  # exports what is left
        elif self.tracing is not None:
            self.tracing.flush()
        log.info("stopped", **self.counts)

    def _media_cache_lent(self) -> contextlib.AbstractContextManager[None]:
        """Each model encodes through a media-feature cache of this service while it serves (one per model:
        vision features differ between checkpoints), handed back as it was given however serving ends."""
        models = {id(each.model): each.model for each in self._hosted_all()}.values()
        return lent_media_caches(models, self.settings.media.media_cache_bytes, self.metrics.count_media_cache)

    async def _connecting(self, step: Awaitable[T]) -> T:
        """Run a start-up step that connects to Kafka; a refusal becomes an error that names the knobs."""
        return await connecting(self.settings.connection, step)

    async def _publish_provenance(self) -> None:
        """One record per served model and a shadow checkpoint of its own."""
        for hosted in self._hosted_all():
            await self.publish_model_provenance(hosted)

    # ------------------------------------------------------------------------------ one fetch

    async def _serve_fetch(self, fetched: Fetch) -> None:
        """The consume loop's handler: the pipeline answers the fetch, and each group of answers is delivered
        as it is ready (beside the pipeline's further work, not after it). Should answering raise anyway, the
        guard (``_answer_guarded``) answers each record not handed on yet by itself: a record at fault costs
        itself, never its neighbours, its partition or the worker. What escapes even that ends the task, which
        the consume loop watches (``Metrics.watch``: logged, and the worker is not ready)."""
        deliveries: list[asyncio.Future[None]] = []
        try:
            failed = await self._answer_guarded(fetched, deliveries)
            await asyncio.gather(*deliveries)
        except asyncio.CancelledError:  # the loop gave up on this fetch: nothing of it is handed on any more
            for delivery in deliveries:
                delivery.cancel()
            raise
        if failed is not None:
            raise failed

    async def _answer_guarded(self, fetched: Fetch, deliveries: list[asyncio.Future[None]]) -> Exception | None:
        """Answer the fetch, its records handed to delivery as they are answered (``deliveries``). If that
        raises (an unframing that recurses too deep, a stage's bug), the records not handed on yet are answered
        again each by itself, side by side, so that the one at fault is found and the others are answered as
        usual; one that still raises is skipped (``_answer_alone``). A worker-fatal error stops the worker as
        delivery's do; a cancellation goes through. Returns what even a skipped record's answer raised."""
        handed: set[Position] = set()
        try:
            await self._answer_unframing(fetched, fetched.records, deliveries, handed)
            return None
        except WorkerFatal as exc:
            self._stop_for(exc, fetched.records)
            return None
        except Exception as exc:  # noqa: BLE001 - the guard: a fault of the worker costs the record at fault only
            left = [record for record in fetched.records if position_of(record) not in handed]
            log.error("a fetch could not be answered: its records are answered one by one", records=len(left),
                      error=reason(exc), exc_info=exc)
        outcomes = await asyncio.gather(*(self._answer_alone(fetched, record, deliveries, handed) for record in left),
                                        return_exceptions=True)
        return next((outcome for outcome in outcomes if isinstance(outcome, Exception)), None)

    async def _answer_alone(self, fetched: Fetch, record: InputRecord, deliveries: list[asyncio.Future[None]],
                            handed: set[Position]) -> None:
        """One record of a fetch whose answering failed, answered by itself; should that raise too, the record is
        skipped: answered ``internal_error`` naming the exception and dead-lettered (``pipeline.skipped``),
        counted in ``d3stream_records_failed_total``, and its offset commits as an answered record's does, so
        its partition goes on. Raises what answering the skipped record raised (nothing is left to try)."""
        try:
            await self._answer_unframing(fetched, [record], deliveries, handed)
            return
        except WorkerFatal as exc:
            self._stop_for(exc, [record])
            return
        except Exception as exc:  # noqa: BLE001 - this record is the one at fault: skipped below
            fault = exc
        if position_of(record) in handed:  # it was answered before its handling failed: that answer stands
            log.error("a record's handling failed after it was answered", topic=record.topic,
                      partition=record.partition, offset=record.offset, error=reason(fault), exc_info=fault)
            return
        log.error("record skipped: the worker failed on it", topic=record.topic, partition=record.partition,
                  offset=record.offset, error=reason(fault), exc_info=fault,
                  then="answered internal_error and dead-lettered; its partition goes on")
        self.metrics.count_record_failed(type(fault).__name__)
        await self._answer(fetched, [skipped(record, fault)], deliveries, handed)

    async def _answer_unframing(self, fetched: Fetch, records: Sequence[InputRecord],
                                deliveries: list[asyncio.Future[None]], handed: set[Position]) -> None:
        """``_answer`` for records as they came: through the Schema Registry when one is set (registry.py). The
        records it can read now are answered while the schema ids of the others are looked up, so a flood of
        new ids delays no request whose id is known."""
        if self.registry is None:
            await self._answer(fetched, records, deliveries, handed)
            return
        ready, waiting = self.registry.unframe_known(records)
        looking = asyncio.ensure_future(self.registry.unframe_looked_up(waiting)) if waiting else None
        try:
            if ready:
                await self._answer(fetched, ready, deliveries, handed)
            if looking is not None:
                await self._answer(fetched, await looking, deliveries, handed)
        finally:
            if looking is not None and not looking.done():
                looking.cancel()  # the ready records failed: the guard answers them all again, one at a time
            elif looking is not None and not looking.cancelled():
                looking.exception()  # retrieved: it was awaited above, or given up with what failed before it

    async def _answer(self, fetched: Fetch, records: Sequence[InputRecord], deliveries: list[asyncio.Future[None]],
                      handed: set[Position]) -> None:
        """The pipeline answers ``records``; each group of answers is handed to delivery as it is ready, and
        ``handed`` keeps where each of its records was read."""
        async for answered in self.pipeline.answer(records):
            handed.update(record.position for record in answered)
            deliveries.append(asyncio.ensure_future(self._deliver(fetched, answered)))

    def _stop_for(self, exc: WorkerFatal, records: Sequence[InputRecord]) -> None:
        """A worker-fatal error while answering: the worker stops, these records' offsets stay uncommitted."""
        assert self.loop is not None
        log.error("records could not be answered; their offsets stay uncommitted",
                  offsets=[record.offset for record in records][:20], error=str(exc))
        self.loop.fail(exc)

    async def _deliver(self, fetched: Fetch, records: list[RequestRecord]) -> None:
        """Hand answers to the commit policy; count and trace them. Never raises: a worker-fatal error stops
        the worker (the offsets stay uncommitted), any other stops it too and is logged."""
        assert self.delivery is not None and self.loop is not None
        started = time.perf_counter()
        answered = []
        for record in records:
            record.publish_at = started
            partition, epoch = fetched.origin(record.input)
            answered.append(Answered(partition, record.source.offset, record.records, epoch))
        try:
            await self.delivery.deliver(answered)
        except WorkerFatal as exc:
            log.error("answers could not be published; their offsets stay uncommitted",
                      offsets=[record.source.offset for record in records][:20], error=str(exc))
            self.loop.fail(exc)
            return
        except Exception:  # noqa: BLE001 - stop rather than commit past an unpublished answer
            log.exception("answers could not be published; their offsets stay uncommitted")
            self.loop.stop()
            return
        finally:
            self.ledger.delivered(records)
            for record in records:
                record.advance(Stage.DELIVERED)
        published = time.perf_counter()
        metrics = self.metrics
        metrics.observe_stage("publish", published - started, len(records))  # delivered together
        errors: dict[str, int] = {}
        for record in records:
            metrics.observe_stage("end_to_end", published - record.received)
            assert record.answer is not None  # the pipeline hands on answered requests only
            error = record.answer.error
            if error is not None:
                errors[error.code] = errors.get(error.code, 0) + 1
        failed = sum(errors.values())
        self._answered += len(records) - failed
        self._errors += failed
        if len(records) > failed:
            metrics.count_answer(None, len(records) - failed)
        for code, count in errors.items():
            metrics.count_answer(code, count)
        if self.tracing is not None:
            for record in records:
                assert record.answer is not None  # as above: answered requests only
                self.tracing.request_served(record.input, record, record.answer, published)
