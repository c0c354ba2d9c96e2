"""``d3stream evaluate``'s worker: labels joined with answers on the stream, exactly once, by partition.

The evaluator is the one consume loop (``kafka/consume.py``) with three parts of its own, as ``serve`` is the
loop with the request pipeline:

* a **read policy**: the answer topic (and the shadow topic, when there is one) and the label topic, live, in
  its own consumer group (``evaluate_group_id``), read_committed. Answers and labels are keyed by request id,
  so partition ``p`` of every one of these topics holds the same request ids: a *unit* of work. The group
  assigns by range, which hands every topic's partition ``p`` to the same worker, so several workers split
  the units between them; the evaluator refuses to start when the partition counts differ, naming the fix
  (topics.py);
* a **handler** (joining.py) that takes each fetch's records into their unit's join state;
* a **commit policy** by unit (``kafka/units.CommitUnitsInTransaction``): each unit has a transactional
  producer of its own, and its evaluations, dead letters and state changes (its changelog, changelog.py) leave
  in one transaction with the offsets of its partitions of every input topic. So a pair is joined once: a
  crash before the commit leaves neither the evaluations nor the offsets nor the state change, and the unit's
  next owner (fencing the old one by the unit's transactional id) brings its state up to date and reads on
  from the committed offsets.

Settling, pausing, periodic commits, rebalances and the stop are the loop's, as for ``serve``.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from d3stream_client.contract import DeadLetter, Evaluation

from d3stream.core.decoding import ByteBudget
from d3stream.core.inflight import InFlightLedger
from d3stream.jobs.evaluate.changelog import Changelog, Restore
from d3stream.jobs.evaluate.drift import Drift
from d3stream.jobs.evaluate.estimation import Estimates
from d3stream.jobs.evaluate.joining import Joining
from d3stream.jobs.evaluate.topics import EvaluateTopics, prepare_topics, tombstone_retention_ms
from d3stream.kafka.connection import kafka_consumer, kafka_producer
from d3stream.kafka.consume import ConsumeLoop, LiveRead, group_consumer
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.registry import Registry
from d3stream.kafka.units import CommitUnitsInTransaction
from d3stream.ops.metrics import Metrics
from d3stream.ops.quality import QualityMetrics
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer, AIOKafkaProducer

# Records read and not yet joined, at most (a fetch brings up to what is left of it).
RECORDS_IN_FLIGHT = 2_000


class Evaluator:
    """One evaluate worker: ``await start()``, ``await run(stopping)``, ``await stop()``."""

    def __init__(self, settings: Settings, metrics: QualityMetrics, drift: Drift, *, shadow_topic: str | None) -> None:
        self.settings = settings
        self.metrics = metrics
        metrics.window.set(settings.evaluation.evaluate_window_s)
        self.topics = EvaluateTopics.from_settings(settings, shadow_topic)
        # Answers and labels framed by a Schema Registry are read, and evaluations written in answer_format.
        self.registry = Registry(settings.registry) if settings.registry.schema_registry_url else None
        # What the drift window's answers expect of themselves, per model and question (CBPE, estimation.py).
        self.joining = Joining(self.topics, metrics, drift, Estimates(settings.evaluation.evaluate_drift_window),
                               max_state_bytes=settings.evaluation.evaluate_max_state_bytes, registry=self.registry)
        # The loop's own series (lag, commits, rebalances) and its watch over the tasks it starts.
        self.loop_metrics = Metrics()
        self.loop: ConsumeLoop | None = None
        self.commits: CommitUnitsInTransaction | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: AIOKafkaConsumer | None = None
        self._settled_once = False

    @property
    def ready(self) -> bool:
        """In the group with the first assignment's states up to date (a later rebalance does not take it away,
        as it does not a serving worker's), no partition stalled, no task of the loop dead."""
        loop = self.loop
        if loop is None or not loop.joined:
            return False
        self._settled_once = self._settled_once or not loop.settling
        return self._settled_once and not loop.stalled and self.loop_metrics.tasks_died == 0

    @property
    def restores(self) -> list[Restore]:
        """How each unit's state was brought up to date (changelog.py)."""
        return self.joining.changelog.restores if self._reader is not None else []

    @property
    def joined_total(self) -> int:
        return self.joining.joined_total

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        settings = self.settings
        evaluation = settings.evaluation
        self.joining.partitions = await prepare_topics(settings, self.topics)
        if self.registry is not None and settings.registry.answer_format != "json":
            self.joining.outgoing = await self.registry.writers_for({self.topics.evaluations: Evaluation,
                                                                     self.topics.dead_letters: DeadLetter})
        retention = await tombstone_retention_ms(settings, self.topics.state)
        self._reader = kafka_consumer(settings.connection, client_id=f"{settings.connection.client_id}-evaluate-restore",
                                      group_id=None, enable_auto_commit=False, isolation_level="read_committed")
        await self._reader.start()
        self.joining.changelog = Changelog(settings, self._reader, tombstone_retention_ms=retention)
        consumer = self._consumer = group_consumer(settings.connection, settings.delivery,
                                                   group_id=evaluation.evaluate_group_id, co_partitioned=True,
                                                   client_suffix="-evaluate")
        tracker = OffsetTracker("partition")
        self.commits = self.joining.commits = CommitUnitsInTransaction(
            producer_factory=self._producer, open_state=self.joining.open_unit, lock=asyncio.Lock(),
            consumer=consumer, tracker=tracker, group_id=evaluation.evaluate_group_id, metrics=self.loop_metrics)
        self.joining.ledger = ledger = InFlightLedger(media_budget=ByteBudget(1))
        # A joined record holds nothing once taken in: the evaluator's bound on the records in flight is the size of
        # the fetches it joins at once (each a read-ahead of the state's entries), not a serving worker's.
        batching = settings.replaced(max_inflight_requests=RECORDS_IN_FLIGHT).batching
        self.loop = ConsumeLoop(settings.delivery, batching, settings.lifecycle, consumer,
                                commits=self.commits, tracker=tracker,
                                read=LiveRead(self.topics.inputs), handler=self.joining.take, ledger=ledger,
                                metrics=self.loop_metrics)
        await consumer.start()

    def _producer(self, partition: int) -> AIOKafkaProducer:
        """The transactional producer of unit ``partition``: its id names the group and the unit, so the unit's
        next owner fences this one."""
        settings = self.settings
        return kafka_producer(settings.connection, client_id=f"{settings.connection.client_id}-evaluate", acks="all",
                              enable_idempotence=True, linger_ms=5,
                              transactional_id=f"{settings.delivery.transactional_id_prefix}-evaluate-"
                                               f"{settings.evaluation.evaluate_group_id}-{partition}")

    async def run(self, stopping: asyncio.Event) -> None:
        """Read, join and commit until ``stopping`` is set; then what was taken in is committed. A fetch that
        waits for a Schema Registry that does not answer is given up: its offsets stay uncommitted (its
        partitions' next owner reads it again)."""
        loop = self.loop
        assert loop is not None
        asking = asyncio.ensure_future(self._stop_when(stopping, loop))
        try:
            await loop.run()
        finally:
            asking.cancel()
        if loop.fatal is not None:
            raise loop.fatal

    async def _stop_when(self, stopping: asyncio.Event, loop: ConsumeLoop) -> None:
        await stopping.wait()
        if self.registry is not None:
            self.registry.close()
        loop.stop()

    async def stop(self) -> None:
        """Close every unit (clean: its next owner on this machine reads only its changelog's tail), then the
        clients."""
        if self.commits is not None:
            await self.commits.stop()
        for consumer in (self._consumer, self._reader):
            if consumer is not None:
                await consumer.stop()
        if self.registry is not None:
            await self.registry.aclose()


def load_drift(settings: Settings) -> Drift:
    """The drift tracker, with the reference file's distribution when ``evaluate_drift_reference`` names one."""
    from d3stream.core.agreement import parse_slot
    from d3stream.jobs.compare import read_jsonl
    from d3stream.jobs.evaluate.drift import reference_bins

    reference = None
    if settings.evaluation.evaluate_drift_reference:
        answers = read_jsonl(Path(settings.evaluation.evaluate_drift_reference))
        reference = reference_bins(
            (question_id, slot) for answer in answers if isinstance(answer, dict)
            and isinstance(answer.get("answers"), dict) for question_id, raw in answer["answers"].items()
            if (slot := parse_slot(raw)) is not None)
    return Drift(settings.evaluation.evaluate_drift_window, reference)


async def _shadow_topic(settings: Settings) -> str | None:
    """The shadow topic to read: ``shadow_topic`` when set, else the default one when it exists."""
    from d3stream.core.shadow import shadow_topic
    from d3stream.kafka.connection import kafka_admin

    if settings.models.shadow_topic:
        return settings.models.shadow_topic
    admin = kafka_admin(settings.connection, client_id=f"{settings.connection.client_id}-evaluate")
    await admin.start()
    try:
        name = shadow_topic(settings.models, settings.delivery)
        return name if name in await admin.list_topics() else None
    finally:
        await admin.close()


async def make_evaluator(settings: Settings, metrics: QualityMetrics | None = None) -> Evaluator:
    """An evaluate worker for ``settings``, its readiness on ``metrics``."""
    metrics = metrics or QualityMetrics()
    evaluator = Evaluator(settings, metrics, load_drift(settings), shadow_topic=await _shadow_topic(settings))
    metrics.set_ready_check(lambda: evaluator.ready)
    return evaluator


async def run_worker(settings: Settings, stopping: asyncio.Event | None = None, *,
                     metrics: QualityMetrics | None = None) -> Evaluator:
    """Run one evaluate worker until ``stopping`` is set (SIGTERM and SIGINT set it when none is given);
    returns the Evaluator (its counts)."""
    stopping = stopping or _on_signals()
    evaluator = await make_evaluator(settings, metrics)
    await evaluator.start()
    try:
        await evaluator.run(stopping)
    finally:
        await evaluator.stop()
    return evaluator


def _on_signals() -> asyncio.Event:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    return stopping
