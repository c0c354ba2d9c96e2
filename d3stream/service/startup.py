"""A worker's start-up: the Kafka parts it makes when it runs, and the steps it takes, in order, to serve.

``Service.run`` (service.py) makes its ``KafkaParts`` here (``make_kafka_parts``): the consumer-group member,
the sink answers go to (``sinks.py``: Kafka topics or a file), the commit policy over them (``commits.py``)
and the consume loop, wired to the worker's fetch handler. ``prepare_to_serve`` then takes the steps before
the first fetch, in this order:

1. the request topics and the sink's topics created where missing, when ``create_topics`` asks for it;
2. the message limit of each topic the sink writes to read from the broker (answers are fitted to it, and
   the producers' batches kept under it);
3. the sink and the commit policy started;
4. with a Schema Registry and an ``answer_format`` other than JSON, the answers' writers chosen (a registry
   that does not answer is waited for; a stop asked meanwhile ends the start-up, nothing read);
5. the video decoding process started, when a served model takes videos (the first video should not wait);
6. a provenance record per model published (each served model's, and a shadow checkpoint's of its own);
7. the consumer started: once it joins the group, records come, and everything above must be ready;
8. the rollout's watch of the model source started (``models/rollout.py``), beside the consume loop.

A step that connects to Kafka turns a refusal into an error that names the connection settings
(``connection.connecting``). For the whole run, before the first step, each model is lent a media-feature
cache of the worker (``media_caches_lent``), handed back however the run ends.

Why a module of its own: the start-up is one sequence whose order is the point, and it reads best in one
place; the worker (service.py) keeps what spans its whole life: its parts, readiness, stopping and the
clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from d3stream.core.decoding import MediaDecoder
from d3stream.core.inflight import InFlightLedger
from d3stream.core.outgoing import RecordWriter
from d3stream.core.pipeline import RequestPipeline
from d3stream.core.routing import Hosted
from d3stream.kafka.commits import CommitPolicy, DeliveryMode, delivery_for, sink_for
from d3stream.kafka.connection import connecting
from d3stream.kafka.consume import ConsumeLoop, ReadPolicy, group_consumer
from d3stream.kafka.limits import Limits
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.registry import Registry, framed_topics
from d3stream.kafka.sinks import KafkaTopics, Sink, ensure_topics
from d3stream.models.rollout import Rollout
from d3stream.ops.metrics import Metrics
from d3stream.runtime.cache import lent_media_caches
from d3stream.service.fetch_handler import FetchHandler
from d3stream.settings import MediaSettings, Settings

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer

__all__ = ["KafkaParts", "make_kafka_parts", "media_caches_lent", "prepare_to_serve"]

log = structlog.get_logger(__name__)


def media_caches_lent(pipeline: RequestPipeline, media: MediaSettings,
                      metrics: Metrics) -> contextlib.AbstractContextManager[None]:
    """Each model encodes through a media-feature cache of this worker while it serves (one per model: vision
    features differ between checkpoints), handed back as it was given however serving ends."""
    models = {id(each.model): each.model for each in pipeline.every_model}.values()
    return lent_media_caches(models, media.media_cache_bytes, metrics.count_media_cache)


@dataclass
class KafkaParts:
    """What a worker makes when it runs: its consumer, where answers go, how offsets commit, the loop over
    them."""

    consumer: AIOKafkaConsumer
    sink: Sink
    delivery: CommitPolicy
    loop: ConsumeLoop


def make_kafka_parts(settings: Settings, mode: DeliveryMode, *, answer_file: Path | None, limits: Limits,
                     tracker: OffsetTracker, read: ReadPolicy, handler: FetchHandler, ledger: InFlightLedger,
                     metrics: Metrics) -> KafkaParts:
    """The consumer, the sink of ``mode`` (its Kafka topics, or ``answer_file``), its commit policy and the
    consume loop handing each fetch to ``handler``, which delivers through the policy. Nothing is started."""
    consumer = group_consumer(settings.connection, settings.delivery)
    sink = sink_for(mode, file=answer_file, kafka=lambda: KafkaTopics(settings.connection, settings.delivery,
                                                                      settings.models, limits, metrics))
    delivery = delivery_for(mode, sink=sink, consumer=consumer, tracker=tracker,
                            group_id=settings.delivery.group_id, metrics=metrics)
    loop = ConsumeLoop(settings.delivery, settings.batching, settings.lifecycle, consumer, commits=delivery,
                       tracker=tracker, read=read, handler=handler.serve, ledger=ledger, metrics=metrics)
    handler.deliver_through(delivery, loop)
    return KafkaParts(consumer, sink, delivery, loop)


async def prepare_to_serve(settings: Settings, parts: KafkaParts, *, pipeline: RequestPipeline,
                           decoder: MediaDecoder, registry: Registry | None, record_writer: RecordWriter,
                           limits: Limits, rollout: Rollout | None,
                           publish: Callable[[Hosted], Awaitable[None]], stop_asked: Callable[[], bool]) -> bool:
    """Take the steps before serving, in their order (see the module). False when a stop was asked while the
    registry was waited for (nothing was read: do not serve)."""
    connection = settings.connection
    if settings.delivery.create_topics:
        await connecting(connection, ensure_topics(connection, settings.delivery, parts.sink))
    # The topics' limits first: the producers' batch size is kept under them.
    limits.topics = await connecting(connection, parts.sink.read_limits())
    await connecting(connection, parts.sink.start())
    await parts.delivery.start()
    if registry is not None and settings.registry.answer_format != "json":
        try:
            framed = framed_topics(settings.delivery, settings.models)
            record_writer.framing = await registry.writers_for(framed)
        except asyncio.CancelledError:
            if not stop_asked():
                raise
            return False  # asked to stop while waiting for a registry that does not answer: nothing was read
    log.info("topic limits", max_message_bytes=limits.topics, compression=limits.compression,
             max_request_size=limits.max_request_size)
    if any(each.model.video_unavailable is None for each in pipeline.router.every):
        decoder.warm()  # the first video should not wait for its decoding process to start
    for hosted in pipeline.every_model:  # a record per served model, and a shadow checkpoint's
        await publish(hosted)
    await connecting(connection, parts.consumer.start())
    if rollout is not None:
        rollout.start()  # watches the model source beside the consume loop, never in its way
    return True
