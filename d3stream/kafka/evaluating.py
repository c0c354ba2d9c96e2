"""``d3stream evaluate``'s worker: labels joined with answers on the stream, exactly once, by partition.

The evaluator reads the answer topic (and the shadow topic, when there is one) and the label topic in its
own consumer group (``evaluate_group_id``), read_committed. Answers are keyed by request id, and so are
labels, so partition ``p`` of every one of these topics holds the same request ids: a *unit* of work. The
group's range assignor hands every topic's partition ``p`` to the same worker, so several workers split
the units between them; the evaluator refuses to start when the partition counts differ, naming the fix.

State is kept as Kafka Streams keeps it: each unit's waiting answers and labels (``core/evaluation.JoinState``)
live in a file on local disk (``core/state_store.WaitingStore``, under ``evaluate_state_dir``), and every change
is also written, one record per request id, to partition ``p`` of a compacted changelog topic
(``evaluate_state_topic``), in the same transaction as the unit's evaluation records and its input offsets.
So a pair is joined once: a crash before the commit leaves neither the evaluations nor the offsets nor the
state change (the file's batch is committed only after the Kafka transaction, with the changelog offset it
reaches), and the unit's next owner (fencing the old one by the unit's transactional id) brings its state up
to date and reads on from the committed offsets:

* a file closed cleanly (a stop, a rebalance) is brought up to date from its changelog offset: only the
  changelog's tail is read, whatever the state's size;
* after a crash, or on a machine without the file, the whole partition is restored from the changelog.

Rebuilding the state from the input topics at start was the alternative; it would re-read up to
``evaluate_window_s`` (days) of answers and labels at every start, where the changelog holds only what still
waits.

Label records that are not labels, and labels on another partition than their id's (not keyed by request
id), go to ``label_dead_letter_topic`` with the reason; the evaluator keeps going.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple, TypedDict

import msgspec
import structlog
from d3stream_client.connection import partition_for
from d3stream_client.contract import (
    Answer,
    DeadLetter,
    Evaluation,
    Label,
    Role,
    Source,
    decode_answer,
    encode,
)
from d3stream_client.validation import EventError, decode_label

from d3stream.core.agreement import calibration_bin
from d3stream.core.answers import dead_letter_event
from d3stream.core.drift import Drift
from d3stream.core.estimation import Estimates
from d3stream.core.evaluation import (
    Joined,
    JoinState,
    LabelEntry,
    Outcomes,
    read_answer,
)
from d3stream.core.state_store import ROW_OVERHEAD_BYTES, WaitingStore
from d3stream.kafka.connection import kafka_admin, kafka_consumer, kafka_producer
from d3stream.kafka.publishing import RecordBatches
from d3stream.kafka.registry import OutgoingFormat, Registry
from d3stream.ops.quality import QualityMetrics
from d3stream.settings import Settings, cache_root

if TYPE_CHECKING:
    from aiokafka import ConsumerRebalanceListener, ConsumerRecord, TopicPartition

    from d3stream.kafka.connection import AIOKafkaAdminClient, AIOKafkaConsumer, AIOKafkaProducer

log = structlog.get_logger(__name__)

MAX_BATCH_RECORDS = 2_000
MAX_DEAD_LETTER_BYTES = 65_536


class Restore(TypedDict):
    """How one unit's state was brought up to date: from the changelog's tail after a clean close, or a whole
    restore; what it read, what waits, how long it took."""

    partition: int
    mode: Literal["tail", "restore"]
    records: int
    waiting: int
    answers_waiting: int
    seconds: float


class EvaluateSetupError(Exception):
    """Topics the evaluator cannot work with (missing, or partition counts that do not match); says the fix."""


@dataclass(frozen=True)
class EvaluateTopics:
    """The topics one evaluator reads and writes."""

    answers: str
    labels: str
    evaluations: str
    state: str
    dead_letters: str
    shadow: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, shadow: str | None) -> EvaluateTopics:
        return cls(settings.delivery.answer_topic, settings.evaluation.label_topic, settings.evaluation.evaluation_topic,
                   settings.evaluation.evaluate_state_topic, settings.evaluation.label_dead_letter_topic, shadow)

    @property
    def inputs(self) -> list[str]:
        return [self.answers, *([self.shadow] if self.shadow else []), self.labels]

    def role(self, topic: str) -> Role | None:
        """live for the answer topic, shadow for the shadow topic, None for the label topic."""
        return "live" if topic == self.answers else "shadow" if topic == self.shadow else None


# A changelog whose tombstone retention cannot be read is taken to have Kafka's default (a day).
DEFAULT_DELETE_RETENTION_MS = 86_400_000
# Changelog records read per step while a unit's state is brought up to date.
RESTORE_STEP = 10_000


def state_path(settings: Settings, partition: int) -> Path:
    """The file of one unit's state: ``evaluate_state_dir`` (default ``$D3STREAM_CACHE/evaluate``), then the
    cluster (a digest of ``bootstrap_servers``), the group and the changelog topic, so workers of several
    clusters, groups or changelogs can share a volume, and a file is never brought up to date from another
    cluster's changelog of the same name (a local broker started anew, say)."""
    root = Path(settings.evaluation.evaluate_state_dir).expanduser() if settings.evaluation.evaluate_state_dir else cache_root() / "evaluate"
    cluster = hashlib.sha256(settings.connection.bootstrap_servers.encode()).hexdigest()[:12]
    return (root / cluster / _file_name(settings.evaluation.evaluate_group_id)
            / f"{_file_name(settings.evaluation.evaluate_state_topic)}-{partition}.sqlite3")


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class Record(NamedTuple):
    """One record the evaluator publishes (a None value: a deletion from the changelog)."""

    topic: str
    key: bytes | None
    value: bytes | None

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return []  # aiokafka's batch builder takes a list


@dataclass
class Unit:
    """One partition number: its join state and the transactional producer its results leave through."""

    partition: int
    state: JoinState
    producer: AIOKafkaProducer
    batches: RecordBatches  # its records handed to the producer as batches built here (publishing.py)
    next_offsets: dict[str, int] = field(default_factory=dict)  # by input topic: the first offset not taken in

    def close(self, changelog_offset: int | None) -> None:
        """Close its state file: with the changelog offset it accounts for (everything committed), marked clean,
        so its next owner on this machine reads only the changelog's tail; without, not (a whole restore)."""
        self.state.store.close(changelog_offset)


@dataclass
class Batch:
    """What one unit's records produced, to be committed in one transaction."""

    joined: list[Joined] = field(default_factory=list)
    dead_letters: list[tuple[bytes | None, bytes]] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # by input topic: the offset to commit
    labels: int = 0
    error_answers: dict[str, int] = field(default_factory=dict)  # by role
    invalid_labels: dict[str, int] = field(default_factory=dict)  # by reason
    drifted: set[tuple[str, str]] = field(default_factory=set)


def dead_letter(record: ConsumerRecord, reason: str) -> bytes:
    """A label record that could not be joined, with the reason and (the start of) its bytes."""
    source = Source(topic=record.topic, partition=record.partition, offset=record.offset, timestamp=record.timestamp)
    return encode(dead_letter_event(reason, source, record.key, record.value or b"", MAX_DEAD_LETTER_BYTES))


class Evaluator:
    """One evaluate worker: ``await start()``, ``await run(stopping)``, ``await stop()``."""

    def __init__(self, settings: Settings, metrics: QualityMetrics, drift: Drift, *, shadow_topic: str | None) -> None:
        self.settings = settings
        self.metrics = metrics
        metrics.window.set(settings.evaluation.evaluate_window_s)
        self.drift = drift
        # What the drift window's answers expect of themselves, per model and question (CBPE, estimation.py).
        self.estimates = Estimates(settings.evaluation.evaluate_drift_window)
        self.topics = EvaluateTopics.from_settings(settings, shadow_topic)
        self.partitions = 0
        self.units: dict[int, Unit] = {}
        self.joined_total = 0
        self._lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None
        self._restorer: AIOKafkaConsumer | None = None
        self._joined_group = False
        self._tombstone_retention_ms = DEFAULT_DELETE_RETENTION_MS
        self.restores: list[Restore] = []  # how each unit's state was brought up to date (tests, logs)
        # Answers and labels framed by a Schema Registry are read, and evaluations written in answer_format.
        self.registry = Registry(settings.registry) if settings.registry.schema_registry_url else None
        self.outgoing: OutgoingFormat | None = None

    @property
    def ready(self) -> bool:
        return self._joined_group

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from aiokafka.coordinator.assignors.range import RangePartitionAssignor

        self.partitions = await prepare_topics(self.settings, self.topics)
        if self.registry is not None and self.settings.registry.answer_format != "json":
            self.outgoing = await self.registry.writers_for({self.topics.evaluations: Evaluation,
                                                             self.topics.dead_letters: DeadLetter})
        self._tombstone_retention_ms = await tombstone_retention_ms(self.settings, self.topics.state)
        settings = self.settings
        self._restorer = kafka_consumer(settings.connection, client_id=f"{settings.connection.client_id}-evaluate-restore", group_id=None,
            enable_auto_commit=False, isolation_level="read_committed")
        await self._restorer.start()
        self._consumer = kafka_consumer(settings.connection, client_id=f"{settings.connection.client_id}-evaluate", group_id=settings.evaluation.evaluate_group_id,
            enable_auto_commit=False, isolation_level="read_committed",
            auto_offset_reset=settings.delivery.auto_offset_reset, max_poll_records=MAX_BATCH_RECORDS,
            session_timeout_ms=settings.delivery.session_timeout_ms, rebalance_timeout_ms=settings.delivery.rebalance_timeout_ms,
            # Range hands partition p of every subscribed topic to the same member: labels meet their answers.
            partition_assignment_strategy=(RangePartitionAssignor,))
        self._consumer.subscribe(self.topics.inputs, listener=_listener(self))
        await self._consumer.start()

    async def stop(self) -> None:
        async with self._lock:
            for unit in list(self.units.values()):
                await self._give_up(unit)
            self.units.clear()
        for consumer in (self._consumer, self._restorer):
            if consumer is not None:
                await consumer.stop()
        if self.registry is not None:
            await self.registry.aclose()

    async def run(self, stopping: asyncio.Event) -> None:
        """Read, join and commit until ``stopping`` is set; the batch in hand is finished first, unless it waits
        for a Schema Registry that does not answer: that wait is given up, and the batch's offsets stay
        uncommitted (its partitions' next owner reads it again)."""
        assert self._consumer is not None
        giving_up = asyncio.ensure_future(self._give_up_registry_waits(stopping))
        try:
            while not stopping.is_set():
                fetched = await self._consumer.getmany(timeout_ms=200, max_records=MAX_BATCH_RECORDS)
                if fetched:
                    await self.take(fetched)
        except asyncio.CancelledError:
            if self.registry is None or not self.registry.closing:
                raise  # cancelled from outside, not a registry wait given up at stop
        finally:
            giving_up.cancel()

    async def _give_up_registry_waits(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        if self.registry is not None:
            self.registry.close()

    # -------------------------------------------------------------------------------- one batch

    async def take(self, fetched: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Join one fetch's records and commit each unit's results with its offsets."""
        by_unit: dict[int, list[tuple[str, list[ConsumerRecord]]]] = {}
        for tp, records in fetched.items():
            if self.registry is not None:  # framed answers and labels read as JSON (waits out a registry outage)
                event = Label if self.topics.role(tp.topic) is None else Answer
                records = await self.registry.unframe(records, event)
            by_unit.setdefault(tp.partition, []).append((tp.topic, records))
        async with self._lock:
            for partition, parts in sorted(by_unit.items()):
                unit = self.units.get(partition)
                if unit is None:
                    continue  # revoked since the fetch: its next owner reads these records again
                batch = Batch()
                for topic, records in parts:
                    self._take_records(unit, topic, records, batch)
                unit.state.expire()
                await self._commit(unit, batch)

    def _take_records(self, unit: Unit, topic: str, records: list[ConsumerRecord], batch: Batch) -> None:
        first = unit.next_offsets.get(topic, 0)
        role = self.topics.role(topic)
        # Their entries read ahead, together (answers and labels are keyed by request id).
        unit.state.store.prefetch(record.key.decode("utf-8", "replace") for record in records if record.key)
        for record in records:
            if record.offset < first:
                continue  # fetched before this unit was restored: taken in by the state already
            if role is None:
                self._take_label(unit, record, batch)
            else:
                self._take_answer(unit, record, role, batch)
            batch.offsets[topic] = record.offset + 1

    def _take_label(self, unit: Unit, record: ConsumerRecord, batch: Batch) -> None:
        try:
            unreadable = getattr(record, "unreadable", None)  # framed, and its schema could not read it
            if isinstance(unreadable, EventError):
                raise EventError("invalid_label", str(unreadable), unreadable.request_id)
            label = decode_label(record.value, record.key)
        except EventError as exc:
            batch.dead_letters.append((record.key, dead_letter(record, f"invalid_label: {exc}")))
            batch.invalid_labels["invalid"] = batch.invalid_labels.get("invalid", 0) + 1
            return
        home = partition_for(label.id.encode(), self.partitions)
        if home != record.partition:
            batch.dead_letters.append((record.key, dead_letter(
                record, f"misplaced_label: the label of {label.id!r} is on partition {record.partition} of "
                f"{record.topic}, but answers of that id are on partition {home}: publish labels keyed by the "
                "request id (the answer's key)")))
            batch.invalid_labels["misplaced"] = batch.invalid_labels.get("misplaced", 0) + 1
            return
        batch.labels += 1
        source = Source(topic=record.topic, partition=record.partition, offset=record.offset,
                        timestamp=record.timestamp)
        # Without labeled_at, the label was known when it was published: its record's timestamp (the schema).
        stamped = record.timestamp if record.timestamp is not None and record.timestamp >= 0 else None
        labeled_at = label.labeled_at if label.labeled_at is not None else stamped
        entry = LabelEntry(dict(label.labels), source, label.source, labeled_at)
        batch.joined.extend(unit.state.take_label(label.id, entry))

    def _take_answer(self, unit: Unit, record: ConsumerRecord, role: Role, batch: Batch) -> None:
        try:
            answer = decode_answer(record.value or b"")
        except (msgspec.ValidationError, msgspec.DecodeError):
            answer = None
        source = Source(topic=record.topic, partition=record.partition, offset=record.offset,
                        timestamp=record.timestamp)
        read = read_answer(answer, source, role) if answer is not None else None
        if answer is None or read is None:
            batch.error_answers[role] = batch.error_answers.get(role, 0) + 1
            return
        entry, slots = read
        joined = unit.state.take_answer(answer.id, entry)
        if joined is None:
            return  # a model's second answer to the request: ignored, its first counts
        batch.joined.extend(joined)
        for question_id, slot in slots.items():
            self.drift.add(entry.model_key, question_id, slot)
            self.estimates.add(entry.model_key, question_id, slot)
            batch.drifted.add((entry.model_key, question_id))

    # ------------------------------------------------------------------------------------ commits

    async def _commit(self, unit: Unit, batch: Batch) -> None:
        """The unit's evaluations, state changes, dead letters and offsets in one transaction; on a failure the
        unit is rebuilt from what was committed (or given up, when another worker fenced it)."""
        from aiokafka import TopicPartition
        from aiokafka.errors import KafkaError, ProducerFenced

        changes = unit.state.drain_changes()
        outcomes = unit.state.take_outcomes()
        producer = unit.producer
        # The changelog records go to the unit's partition: keyed by request id as the answers are, on a topic
        # with as many partitions (prepare_topics checks), so the partitioner puts them there.
        records: list[Record] = [Record(self.topics.evaluations, joined.evaluation.id.encode(),
                                        encode(joined.evaluation)) for joined in batch.joined]
        records += [Record(self.topics.state, request_id.encode(), value) for request_id, value in changes.items()]
        records += [Record(self.topics.dead_letters, key, value) for key, value in batch.dead_letters]
        if self.outgoing is not None:
            records = [Record(each.topic, each.key, self.outgoing.encode(each.topic, each.value))
                       if each.value is not None else each for each in records]
        try:
            await producer.begin_transaction()
            failures = await unit.batches.send(records)
            if failures:
                raise failures[0][1]
            offsets = {TopicPartition(topic, unit.partition): offset for topic, offset in batch.offsets.items()}
            if offsets:
                await producer.send_offsets_to_transaction(offsets, self.settings.evaluation.evaluate_group_id)
            await producer.commit_transaction()
        except ProducerFenced:
            log.info("fenced: another evaluate worker owns this partition now", partition=unit.partition)
            self.units.pop(unit.partition, None)
            await _quietly_stop(producer)
            unit.state.rollback()
            unit.close(None)  # another owner writes the changelog now: this file may fall behind it
            return
        except KafkaError as exc:
            log.warning("evaluation transaction failed; restoring the partition from what was committed",
                        partition=unit.partition, error=f"{type(exc).__name__}: {exc}")
            unit.state.rollback()
            await self._rebuild(unit.partition)
            return
        unit.state.commit()  # the file follows the changelog
        unit.next_offsets.update(batch.offsets)
        self._count(batch, outcomes)

    def _count(self, batch: Batch, outcomes: Outcomes) -> None:
        """The metrics of one committed batch: its joins, what the state counted, the drift it moved and the
        size of the state."""
        metrics = self.metrics
        for joined in batch.joined:
            model_key = f"{joined.evaluation.role}:{joined.evaluation.model}"
            for question_id, scored in joined.scored.items():
                metrics.count_pair(model_key, question_id, scored, calibration_bin(scored.confidence))
            metrics.label_lag.labels(role=joined.evaluation.role).observe(max(joined.evaluation.lag_ms, 0) / 1e3)
        self.joined_total += len(batch.joined)
        metrics.labels.inc(batch.labels)
        for role, count in batch.error_answers.items():
            metrics.error_answers.labels(role=role).inc(count)
        for reason, count in batch.invalid_labels.items():
            metrics.invalid_labels.labels(reason=reason).inc(count)
        metrics.count_by_model(metrics.answers, outcomes.answers)
        metrics.count_by_model(metrics.unknown_questions, outcomes.unknown_questions)
        metrics.count_by_model(metrics.unscorable, outcomes.unscorable)
        metrics.count_by_model(metrics.expired, outcomes.expired_answers)
        metrics.count_by_model(metrics.evicted_answers, outcomes.evicted_answers)
        metrics.duplicates.labels(kind="answer").inc(outcomes.duplicate_answers)
        metrics.duplicates.labels(kind="label").inc(outcomes.duplicate_labels)
        metrics.unmatched.inc(outcomes.unmatched_labels)
        metrics.evicted.inc(outcomes.evicted)
        metrics.evicted_labels.inc(outcomes.evicted_labels)
        for kind, count in outcomes.after_eviction.items():
            metrics.after_eviction.labels(kind=kind).inc(count)
        for model_key, question_id in batch.drifted:
            drift = self.drift.questions[(model_key, question_id)]
            metrics.set_drift(model_key, question_id, drift.psi, drift.mean, drift.shares())
            estimate = self.estimates.questions[(model_key, question_id)].estimate
            if estimate is not None:
                metrics.set_estimate(model_key, question_id, estimate.accuracy, estimate.brier, estimate.log_loss)
        states = [u.state for u in self.units.values()]
        metrics.waiting.labels(kind="answers").set(sum(s.answers_waiting for s in states))
        metrics.waiting.labels(kind="labels").set(sum(s.labels_waiting for s in states))
        metrics.state_bytes.set(sum(s.bytes for s in states))
        covered = [s.covers_ms for s in states if len(s)]
        metrics.coverage.set(min(covered) / 1e3 if covered else 0.0)

    # ------------------------------------------------------------------------------- assignment

    async def assigned(self, partitions: Sequence[int]) -> None:
        """Take units over: fence their previous owner, restore their state, seek to their committed offsets."""
        async with self._lock:
            for partition in sorted(set(partitions) - set(self.units)):
                await self._adopt(partition)
            self._rebudget()
            self._joined_group = True  # ready: in the group, and every partition's state up to date

    async def revoked(self, partitions: Sequence[int]) -> None:
        """Give units up (everything taken in is committed already: each batch commits before the next)."""
        async with self._lock:
            for partition in partitions:
                unit = self.units.pop(partition, None)
                if unit is not None:
                    await self._give_up(unit)
            self._rebudget()

    async def _give_up(self, unit: Unit) -> None:
        """Stop the unit's producer and close its state file clean, at the changelog's end: every batch of it is
        committed (each commits before the next is taken), and no one else writes its changelog partition yet."""
        from aiokafka import TopicPartition

        await _quietly_stop(unit.producer)
        assert self._restorer is not None
        tp = TopicPartition(self.topics.state, unit.partition)
        try:
            end = (await self._restorer.end_offsets([tp]))[tp]
        except Exception:  # noqa: BLE001 - without the offset the file is not clean: a whole restore next time
            log.warning("changelog end not read; the partition's state will be restored whole next time",
                        partition=unit.partition, exc_info=True)
            end = None
        unit.close(end)

    async def _rebuild(self, partition: int) -> None:
        unit = self.units.pop(partition, None)
        if unit is not None:
            await self._give_up(unit)  # rolled back: the file holds what the changelog holds
        await self._adopt(partition)
        self._rebudget()

    async def _adopt(self, partition: int) -> None:
        from aiokafka import TopicPartition

        settings = self.settings
        producer = kafka_producer(settings.connection, client_id=f"{settings.connection.client_id}-evaluate", acks="all", enable_idempotence=True,
            linger_ms=5, transactional_id=f"{settings.delivery.transactional_id_prefix}-evaluate-"
                                          f"{settings.evaluation.evaluate_group_id}-{partition}")
        await producer.start()  # init_transactions: the previous owner's open transaction ends first
        state = await self._bring_up_to_date(partition)
        unit = Unit(partition, state, producer, RecordBatches(producer))
        assert self._consumer is not None
        for topic in self.topics.inputs:
            tp = TopicPartition(topic, partition)
            committed = await self._consumer.committed(tp)
            if committed is not None:
                self._consumer.seek(tp, committed)
                unit.next_offsets[topic] = committed
        self.units[partition] = unit

    async def _bring_up_to_date(self, partition: int) -> JoinState:
        """The unit's state from its file and the changelog: the changelog's tail after the file's offset when
        the file was closed cleanly, else the whole changelog into a wiped file."""
        from aiokafka import TopicPartition

        assert self._restorer is not None
        settings = self.settings
        started = time.perf_counter()
        tp = TopicPartition(self.topics.state, partition)
        self._restorer.assign([tp])
        log_start = (await self._restorer.beginning_offsets([tp]))[tp]
        log_end = (await self._restorer.end_offsets([tp]))[tp]
        store = WaitingStore(state_path(settings, partition))
        resume = store.resume_from(log_start, log_end, self._tombstone_retention_ms)
        store.opened()  # not clean until closed: a crash from here on means a whole restore next time
        state = JoinState(window_ms=int(settings.evaluation.evaluate_window_s * 1000), max_bytes=settings.evaluation.evaluate_max_state_bytes,
                          store=store)
        if resume is None:
            state.restore_begin()
        records = 0
        async for chunk in self._changelog(tp, log_start if resume is None else resume, log_end):
            records += state.apply(chunk, counted=resume is not None)
        if resume is None:
            state.restore_end()
        state.commit()
        seconds = time.perf_counter() - started
        how: Restore = {"partition": partition, "mode": "tail" if resume is not None else "restore", "records": records,
               "waiting": len(state), "answers_waiting": state.answers_waiting, "seconds": round(seconds, 3)}
        self.restores.append(how)
        log.info("evaluating partition", **how, records_per_s=round(records / seconds) if seconds > 0 else None)
        return state

    def _rebudget(self) -> None:
        # The disk bound is the worker's: each unit holds an equal share of it.
        share = self.settings.evaluation.evaluate_max_state_bytes // max(1, len(self.units))
        for unit in self.units.values():
            unit.state.max_bytes = max(share, ROW_OVERHEAD_BYTES)

    async def _changelog(self, tp: TopicPartition, start: int, end: int) -> AsyncIterator[list[tuple[str, bytes | None]]]:
        """The unit's changelog records from ``start`` up to ``end`` (read_committed), oldest first, a step at
        a time: a whole partition is never held in memory."""
        assert self._restorer is not None
        if start >= end:
            return
        self._restorer.seek(tp, start)
        while await self._restorer.position(tp) < end:
            fetched = await self._restorer.getmany(tp, timeout_ms=500, max_records=RESTORE_STEP)
            records = [(r.key.decode(), r.value) for r in fetched.get(tp, []) if r.key is not None and r.offset < end]
            if records:
                yield records


def _listener(evaluator: Evaluator) -> ConsumerRebalanceListener:
    """The group's rebalance callbacks, as unit numbers (aiokafka wants its own listener class)."""
    from aiokafka import ConsumerRebalanceListener

    class Listener(_Units, ConsumerRebalanceListener):
        pass

    return Listener(evaluator)


class _Units:
    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self.evaluator.revoked(sorted({tp.partition for tp in revoked}))

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        await self.evaluator.assigned(sorted({tp.partition for tp in assigned}))


async def _quietly_stop(producer: AIOKafkaProducer) -> None:
    try:
        await producer.stop()
    except Exception:  # noqa: BLE001 - a producer being discarded; its transaction ends with it
        log.debug("producer stop failed", exc_info=True)


async def tombstone_retention_ms(settings: Settings, topic: str) -> int:
    """The changelog's ``delete.retention.ms``: how long a deletion stays readable in a compacted topic, so how
    old a cleanly closed state file may be and still be brought up to date from the tail."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import KafkaError

    admin = kafka_admin(settings.connection, client_id=f"{settings.connection.client_id}-evaluate")
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"delete.retention.ms": None})])
    except KafkaError:
        return DEFAULT_DELETE_RETENTION_MS
    finally:
        await admin.close()
    for response in responses:
        for error_code, _message, _kind, _topic, entries in (tuple(r)[:5] for r in response.resources):
            for name, value, *_ in entries if error_code == 0 else ():
                if name == "delete.retention.ms" and value is not None:
                    return int(value)
    return DEFAULT_DELETE_RETENTION_MS


async def prepare_topics(settings: Settings, topics: EvaluateTopics) -> int:
    """The number of partitions every input topic shares; missing topics are created (``create_topics``):
    the inputs and outputs with ``topic_partitions`` (or the answer topic's count), the state topic compacted
    with one partition per unit. EvaluateSetupError when the counts differ or a topic is missing."""
    from aiokafka.admin.new_topic import NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = kafka_admin(settings.connection, client_id=f"{settings.connection.client_id}-evaluate")
    await admin.start()
    try:
        counts = await _partition_counts(admin, [*topics.inputs, topics.state])
        known = [counts[name] for name in (topics.answers, topics.labels) if name in counts]
        partitions = known[0] if known else settings.delivery.topic_partitions
        wanted: dict[str, tuple[int, dict[str, str]]] = {name: (partitions, {}) for name in (*topics.inputs, topics.evaluations, topics.dead_letters)}
        wanted[topics.state] = (partitions, {"cleanup.policy": "compact"})
        missing = [name for name in wanted if name not in counts and name not in (topics.evaluations,
                                                                                  topics.dead_letters)]
        if missing and not settings.delivery.create_topics:
            raise EvaluateSetupError(f"missing topics {missing}: create them with {partitions} partitions (the "
                                     "state topic compacted), or run with --create-topics")
        if settings.delivery.create_topics:
            existing = set(await admin.list_topics())
            for name, (count, config) in wanted.items():
                if name not in existing:
                    try:
                        await admin.create_topics([NewTopic(name, count, 1, topic_configs=config)])
                    except TopicAlreadyExistsError:
                        pass
            counts = await _created(admin, [*topics.inputs, topics.state])
        _check_counts(counts, topics)
        return counts[topics.answers]
    finally:
        await admin.close()


async def _created(admin: AIOKafkaAdminClient, names: list[str], within_s: float = 10.0) -> dict[str, int]:
    """The partition counts of topics just created, once the metadata shows them all (or as it stands after
    ``within_s``): described at once, a topic created a moment ago may not be there yet."""
    deadline = time.monotonic() + within_s
    while True:
        counts = await _partition_counts(admin, names)
        if all(name in counts for name in names) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    described = await admin.describe_topics(names)
    return {topic["topic"]: len(topic["partitions"]) for topic in described
            if topic.get("error_code", 0) == 0 and topic["partitions"]}


def _check_counts(counts: dict[str, int], topics: EvaluateTopics) -> None:
    answers = counts.get(topics.answers)
    for name in [*topics.inputs, topics.state]:
        if counts.get(name) is None:
            raise EvaluateSetupError(f"topic {name!r} does not exist (create_topics is off)")
        if counts[name] != answers:
            what = "the changelog" if name == topics.state else "labels" if name == topics.labels else "shadow answers"
            raise EvaluateSetupError(
                f"topic {name!r} has {counts[name]} partitions and the answer topic {topics.answers!r} has {answers}: "
                f"{what} are joined with the answers of the same partition (all keyed by request id), so the counts "
                f"must match. Create {name!r} with {answers} partitions (kafka-topics.sh --alter --partitions "
                f"{answers} when it has fewer, and republish its records so each lands on its key's partition), or "
                "name another topic")
