"""One d3stream worker: the request pipeline, a consume loop and a delivery mode, put together.

``Service(settings, model).run()`` (or ``Service(settings, [default, other, ...])``: several models in one
worker, routed by the request's ``model``) serves until ``stop()`` (SIGTERM/SIGINT: stop fetching, finish what is in
flight, publish, commit, close; a crash never loses a request, a clean shutdown repeats nothing). The parts:

* ``hosting.ModelHosting`` gives each served model its own parts (``core.routing.Hosted``), and the pipeline's
  ``core.routing.Router`` owns them from then on: ``Service.hosted`` and ``Service.default`` (its model, passes,
  answers and provenance) read the router, whose default a rollout's swap changes (``models/rollout.py``);
* ``pipeline.RequestPipeline`` answers the records of each fetch (no Kafka in it);
* ``consume.ConsumeLoop`` reads them under a ``ReadPolicy`` (the live stream here; a replay passes its range),
  with backpressure, settling of new assignments, rebalances and the commit cadence;
* ``fetch_handler.FetchHandler`` is the loop's handler: it hands each fetch to the pipeline and its answers to
  delivery, and guards the stream (a record the pipeline raises on is answered ``internal_error`` and
  dead-lettered, its partition going on);
* a delivery mode (``commits.DELIVERY_MODES``) is a sink (``sinks.py``: Kafka topics or a file) and a commit
  policy (``commits.py``: in the answers' transaction, or after they are written);
* ``startup.py`` makes the Kafka parts when the worker runs (consumer, sink, commit policy, consume loop) and
  takes the steps before serving in their order (topics, limits, a provenance record per model, consumer,
  the rollout's watch).

This module wires them and owns what spans them: the one model thread every model's passes share (one device:
passes never run side by side), readiness, stopping and the clean-up. An error that no retry can cure
(``WorkerFatal``: no permission, a missing topic) stops the worker without committing past the record; ``run``
raises it and ``d3stream serve`` exits with status 3.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from d3stream_client.contract import Worker
from d3stream_client.validation import RequestLimits

from d3stream import __version__
from d3stream.core.answers import answer_identity, provenance_digest
from d3stream.core.decoding import ByteBudget, MediaDecoder
from d3stream.core.inflight import InFlightLedger
from d3stream.core.outgoing import Outgoing, RecordWriter
from d3stream.core.passes import RowScheduler, default_token_budget, model_thread
from d3stream.core.pipeline import RequestPipeline
from d3stream.core.routing import Hosted, Router
from d3stream.core.seams import DecisionModel
from d3stream.core.storage import MediaFetcher
from d3stream.kafka.commits import DELIVERY_MODES, CommitPolicy
from d3stream.kafka.connection import check_connection
from d3stream.kafka.consume import ConsumeLoop, LiveRead, ReadPolicy
from d3stream.kafka.limits import Limits, WorkerFatal, producer_compression
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.registry import Registry
from d3stream.kafka.sinks import Sink
from d3stream.models.rollout import rollout_for
from d3stream.ops.collector import tuned_collector
from d3stream.ops.metrics import Metrics
from d3stream.ops.tracing import Tracing
from d3stream.runtime.cpu_threads import cap_torch_threads, release_idle_teams
from d3stream.service.fetch_handler import FetchHandler
from d3stream.service.hosting import ModelHosting, served_models
from d3stream.service.startup import make_kafka_parts, media_caches_lent, prepare_to_serve
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer

__all__ = ["OffsetTracker", "Service", "answer_identity", "default_token_budget", "provenance_digest"]

log = structlog.get_logger(__name__)


class Service:
    """One d3stream worker: a consumer group member serving one model, or several (the first is the default)."""

    def __init__(self, settings: Settings, model: DecisionModel | Sequence[DecisionModel], *,
                 fetcher: MediaFetcher | None = None, metrics: Metrics | None = None,
                 tracing: Tracing | None = None, read: ReadPolicy | None = None,
                 scheduler: RowScheduler | None = None, answer_file: Path | None = None,
                 replay_id: str | None = None, shadow: DecisionModel | None = None):
        self.settings = settings = settings.check()
        check_connection(settings.connection)
        models = served_models(model, settings.models, scheduler)
        self.metrics = metrics or Metrics()
        # Spans of served requests (otlp_endpoint, or a caller's own, e.g. a test's in-memory exporter).
        self._owns_tracing = tracing is None
        self.tracing = (tracing if tracing is not None
                        else Tracing.from_settings(settings.observability, settings.delivery))
        cap_torch_threads(settings.models.torch_threads)
        # The model thread takes the intra-op threads: a team this thread kept from loading would slow every pass.
        release_idle_teams()
        self.read = read or LiveRead(settings.delivery.request_topics)
        self.mode = DELIVERY_MODES["jsonl_file" if answer_file is not None else settings.delivery.mode]
        self.answer_file = answer_file
        self.fetcher = fetcher or MediaFetcher.from_settings(settings.storage)
        # The limits of the topics answers and dead letters go to (read from the broker at start).
        self.limits = Limits(max_request_size=settings.delivery.max_request_size,
                             compression=producer_compression(settings.delivery.compression))
        # One device, one model thread: every model's passes take turns on it, never side by side.
        self.model_thread = model_thread(settings.models.torch_threads)
        # How answers and dead letters become records: JSON, or the registry's format once chosen at start.
        self.record_writer = RecordWriter()
        # Each served model's own parts (and a shadow checkpoint's of its own, given by the caller; replays
        # have none); the pipeline's router owns the served ones from then on.
        self.hosting = ModelHosting(settings.limits, settings.batching, settings.delivery, settings.media,
                                    metrics=self.metrics, model_thread=self.model_thread,
                                    worker=Worker(host=socket.gethostname(), pid=os.getpid(), version=__version__),
                                    fit=self.limits.fit, write=self.record_writer)
        served, shadowing = self.hosting.host_served(models, settings.models, scheduler=scheduler,
                                                     replay_id=replay_id, shadow=shadow)
        # Media decoding: images on a thread of their own, videos in killable processes, under a deadline;
        # decoded media wait for their share of max_inflight_media_bytes.
        self.decoder = MediaDecoder.from_settings(settings.media)
        # What in-flight requests hold, taken and given back through one owner (the consume loop's
        # backpressure reads its counts): requests, questions, tokens, tenant quotas, the media budget.
        self.ledger = InFlightLedger(media_budget=ByteBudget(settings.media.max_inflight_media_bytes),
                                     tenant_max_inflight_tokens=settings.batching.tenant_max_inflight_tokens)
        self.in_flight = self.ledger.counts
        # Answers each fetch for the served models (its router owns them from here on) and the shadow.
        self.pipeline = RequestPipeline(settings.batching, settings.media, settings.observability,
                                        settings.models, settings.delivery, served,
                                        request_limits=RequestLimits.from_settings(settings),
                                        fetcher=self.fetcher, decoder=self.decoder, ledger=self.ledger,
                                        metrics=self.metrics, shadow=shadowing)
        # Live serving lets answers leave out of offset order (settings.delivery.ordering) and records the done offsets
        # beyond each commit point; a replay keeps offset order and commits the point alone.
        self.tracker = OffsetTracker(settings.delivery.ordering if replay_id is None else "partition",
                                     record_done=replay_id is None,
                                     metadata_bytes=settings.delivery.offset_metadata_max_bytes)
        # The watched model source (swaps without a stop) and the canary share (rollout.py), when set.
        self.rollout = rollout_for(settings.models, settings.storage, self, self.metrics)
        # Made when it runs: the Kafka consumer, where answers go and how offsets commit, the loop over them.
        self.sink: Sink | None = None
        self.delivery: CommitPolicy | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.loop: ConsumeLoop | None = None
        # Requests framed by a Schema Registry, and answers written through it (kafka/registry.py).
        self.registry = (Registry(settings.registry, metrics=self.metrics,
                                  max_record_bytes=settings.limits.max_request_bytes)
                         if settings.registry.schema_registry_url else None)
        # Answers each fetch and delivers it, under the guard (fetch_handler.py); delivery is made at run.
        self.handler = FetchHandler(self.pipeline, ledger=self.ledger, metrics=self.metrics, registry=self.registry,
                                    tracing=self.tracing)
        self.ready = False
        self._stop_asked = False
        self._show_in_metrics()

    def _show_in_metrics(self) -> None:
        """The default model's identity and kernels, and the readiness check, on the metrics endpoint."""
        default = self.default
        self.metrics.set_model(default.model.model_name, default.provenance_sha256, str(default.model.device))
        self.metrics.set_kernels(default.model.kernel_record())
        self.metrics.set_ready_check(lambda: self.ready and self.joined and not self.stopping and not self.stalled
                                     and not self.registry_outage, why_not=lambda: self.registry_outage)

    def host_model(self, model: DecisionModel) -> Hosted:
        """A model loaded while serving (a swap's new checkpoint), with the parts every served model gets, hosted
        by the router; the rollout routes requests to it once its provenance is published."""
        hosted = self.hosting.host_loaded(model)
        self.router.host(hosted)
        return hosted

    async def unhost_model(self, hosted: Hosted) -> None:
        """A retired model that answered everything routed to it, or a refused swap's: its passes closed,
        forgotten."""
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
    def shadow(self) -> Hosted | None:
        """The shadow model's parts (a served model's, or a checkpoint of its own), if there is a shadow."""
        shadow = self.pipeline.shadow
        return shadow.hosted if shadow is not None else None

    @property
    def counts(self) -> dict[str, int]:
        return {"answered": self.handler.answered, "errors": self.handler.errors,
                "dead_letters": self.default.answers.dead_letters}

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
        with (media_caches_lent(self.pipeline, self.settings.media, self.metrics),
              tuned_collector(self.settings.lifecycle.gc_young_threshold)):
            try:
                await self._serve_until_stopped()
            finally:
                await self._close()
        if self.fatal is not None:
            raise self.fatal

    async def _serve_until_stopped(self) -> None:
        settings = self.settings
        parts = make_kafka_parts(settings, self.mode, answer_file=self.answer_file, limits=self.limits,
                                 tracker=self.tracker, read=self.read, handler=self.handler,
                                 ledger=self.ledger, metrics=self.metrics)
        # Kept here as soon as made: a start-up step that fails leaves them to the clean-up (_close), and the
        # consumer, made but never started, to the caller (d3stream serve stops it).
        self.consumer, self.sink = parts.consumer, parts.sink
        self.delivery, self.loop = parts.delivery, parts.loop
        if self._stop_asked:
            self.loop.stop()
        # Topics, limits, a provenance record per model, the consumer, the rollout's watch (startup.py).
        if not await prepare_to_serve(settings, parts, pipeline=self.pipeline, decoder=self.decoder,
                                      registry=self.registry, record_writer=self.record_writer,
                                      limits=self.limits, rollout=self.rollout,
                                      publish=self.publish_model_provenance,
                                      stop_asked=lambda: self._stop_asked):
            return  # asked to stop while waiting for a registry that does not answer: nothing was read
        try:
            self.ready = True
            log.info("serving", topics=settings.delivery.request_topics, group=settings.delivery.group_id,
                     models=[each.name for each in self.hosted], budget=self.default.passes.budget, delivery=self.mode.name)
            await self.loop.run()
        finally:
            self.ready = False
            await self.consumer.stop()

    async def _close(self) -> None:
        if self.rollout is not None:
            await self.rollout.stop()
        for hosted in self.pipeline.every_model:
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
