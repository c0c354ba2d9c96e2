"""The evaluator's handler on the consume loop: labels joined with answers in each unit's state.

``Joining.take`` is what the one consume loop (``kafka/consume.py``) hands each fetch to, as it hands a fetch
of requests to the serve job's pipeline. The records of a fetch are grouped by unit (partition number), read
through the Schema Registry when one frames them, and taken in order into their unit's ``JoinUnit``: an answer
waits for its label or joins one that waited, a label waits for its answers or joins them. What that makes
(one evaluation per joined request and model, dead letters for label records that are not labels, and the
state's changes for its changelog) waits in the unit until the unit's next transaction
(``kafka/units.CommitUnitsInTransaction``) takes it, with the unit's input offsets; the metrics count it once
that transaction has committed.

Label records that are not labels, and labels on another partition than their id's (not keyed by request
id), go to ``label_dead_letter_topic`` with the reason; the evaluator keeps going.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import structlog
from d3stream_client.connection import partition_for
from d3stream_client.contract import Answer, Label, Role, Source, decode_answer, encode
from d3stream_client.validation import EventError, decode_label

from d3stream.core.agreement import calibration_bin
from d3stream.core.answers import dead_letter_event
from d3stream.jobs.evaluate.drift import Drift
from d3stream.jobs.evaluate.estimation import Estimates
from d3stream.jobs.evaluate.join_state import Joined, JoinState, LabelEntry, Outcomes, read_answer
from d3stream.jobs.evaluate.state_store import ROW_OVERHEAD_BYTES
from d3stream.jobs.evaluate.topics import EvaluateTopics
from d3stream.kafka.publishing import Publishable
from d3stream.ops.quality import QualityMetrics

if TYPE_CHECKING:
    from aiokafka import ConsumerRecord, TopicPartition

    from d3stream.core.inflight import InFlightLedger
    from d3stream.jobs.evaluate.changelog import Changelog
    from d3stream.kafka.consume import Fetch
    from d3stream.kafka.registry import OutgoingFormat, Registry
    from d3stream.kafka.units import CommitUnitsInTransaction

log = structlog.get_logger(__name__)

MAX_DEAD_LETTER_BYTES = 65_536


class Record(NamedTuple):
    """One record the evaluator publishes (a None value: a deletion from the changelog)."""

    topic: str
    key: bytes | None
    value: bytes | None

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return []  # aiokafka's batch builder takes a list


@dataclass
class Batch:
    """What one unit's records made since its last commit."""

    joined: list[Joined] = field(default_factory=list)
    dead_letters: list[tuple[bytes | None, bytes]] = field(default_factory=list)
    labels: int = 0
    error_answers: dict[str, int] = field(default_factory=dict)  # by role
    invalid_labels: dict[str, int] = field(default_factory=dict)  # by reason
    drifted: set[tuple[str, str]] = field(default_factory=set)


def dead_letter(record: ConsumerRecord, reason: str) -> bytes:
    """A label record that could not be joined, with the reason and (the start of) its bytes."""
    source = Source(topic=record.topic, partition=record.partition, offset=record.offset, timestamp=record.timestamp)
    return encode(dead_letter_event(reason, source, record.key, record.value or b"", MAX_DEAD_LETTER_BYTES))


class JoinUnit:
    """One unit's join state and what it made since its last commit (``kafka/units.UnitState``)."""

    def __init__(self, partition: int, state: JoinState, joining: Joining) -> None:
        self.partition = partition
        self.state = state
        self.joining = joining
        self.batch = Batch()
        self._leaving: tuple[Batch, Outcomes] | None = None  # what the transaction in progress carries

    def outgoing(self) -> list[Publishable]:
        joining = self.joining
        topics = joining.topics
        batch, self.batch = self.batch, Batch()
        self._leaving = batch, self.state.take_outcomes()
        # The changelog records go to the unit's partition: keyed by request id as the answers are, on a topic
        # with as many partitions (topics.prepare_topics checks), so the partitioner puts them there.
        records: list[Record] = [Record(topics.evaluations, joined.evaluation.id.encode(), encode(joined.evaluation))
                                 for joined in batch.joined]
        records += [Record(topics.state, request_id.encode(), value)
                    for request_id, value in self.state.drain_changes().items()]
        records += [Record(topics.dead_letters, key, value) for key, value in batch.dead_letters]
        if joining.outgoing is not None:
            framing = joining.outgoing
            records = [Record(each.topic, each.key, framing.encode(each.topic, each.value))
                       if each.value is not None else each for each in records]
        return list(records)

    def committed(self) -> None:
        self.state.commit()  # the file follows the changelog
        if self._leaving is not None:
            self.joining.count(*self._leaving)
            self._leaving = None

    def rolled_back(self) -> None:
        self.state.rollback()
        self.batch, self._leaving = Batch(), None

    async def close(self, *, clean: bool) -> None:
        """Close its state file: with the changelog offset it accounts for when ``clean``, so its next owner on
        this machine reads only the changelog's tail; else not (a whole restore)."""
        end = await self.joining.changelog.end(self.partition) if clean else None
        self.state.store.close(end)


class Joining:
    """The evaluator's handler: each fetch's records taken into their units' states (see the module's
    docstring); the drift and estimate windows it moves are the worker's, across units."""

    def __init__(self, topics: EvaluateTopics, metrics: QualityMetrics, drift: Drift, estimates: Estimates, *,
                 max_state_bytes: int, registry: Registry | None) -> None:
        self.topics = topics
        self.metrics = metrics
        self.drift = drift
        self.estimates = estimates
        self.max_state_bytes = max_state_bytes
        self.registry = registry
        self.outgoing: OutgoingFormat | None = None  # evaluations written in answer_format, once chosen at start
        self.partitions = 0  # of every input topic (topics.prepare_topics)
        self.joined_total = 0
        # Set by the worker before the loop runs (worker.py).
        self.commits: CommitUnitsInTransaction
        self.changelog: Changelog
        self.ledger: InFlightLedger

    async def open_unit(self, partition: int) -> JoinUnit:
        """The unit's state brought up to date from its file and changelog (after its producer fenced the
        previous owner)."""
        return JoinUnit(partition, await self.changelog.restore(partition), self)

    async def take(self, fetch: Fetch) -> None:
        """Join one fetch's records in their units (their offsets done once taken in)."""
        try:
            read: dict[tuple[str, int], list[ConsumerRecord]] = {}
            for record in fetch.records:
                read.setdefault((record.topic, record.partition), []).append(record)
            by_unit: dict[int, list[tuple[TopicPartition, int, list[ConsumerRecord]]]] = {}
            for (topic, number), records in read.items():
                partition, epoch = fetch.partitions[(topic, number)]
                if self.registry is not None:  # framed answers and labels read as JSON (waits out a registry outage)
                    event = Label if self.topics.role(topic) is None else Answer
                    records = await self.registry.unframe(records, event)
                by_unit.setdefault(number, []).append((partition, epoch, records))
            async with self.commits.lock:
                self._rebudget()
                for number, parts in sorted(by_unit.items()):
                    unit = self.commits.state(number)
                    if not isinstance(unit, JoinUnit):
                        continue  # not held (any more): its next owner reads these records again
                    self._take_unit(unit, parts)
        finally:
            self.ledger.released(len(fetch.records))

    def _take_unit(self, unit: JoinUnit, parts: list[tuple[TopicPartition, int, list[ConsumerRecord]]]) -> None:
        tracker = self.commits.tracker
        for partition, epoch, records in parts:
            if not tracker.owns(partition, epoch):
                continue  # read before its partition was settled again: read again from the commit
            role = self.topics.role(partition.topic)
            # Their entries read ahead, together (answers and labels are keyed by request id).
            unit.state.store.prefetch(record.key.decode("utf-8", "replace") for record in records if record.key)
            for record in records:
                if role is None:
                    self._take_label(unit, record)
                else:
                    self._take_answer(unit, record, role)
                tracker.done(partition, record.offset, epoch)  # taken in: no commit can come between (the lock)
        unit.state.expire()

    def _rebudget(self) -> None:
        # The disk bound is the worker's: each unit holds an equal share of it (a unit opens with the whole).
        units = self.commits.units
        share = self.max_state_bytes // max(1, len(units))
        for unit in units.values():
            if isinstance(unit.state, JoinUnit):
                unit.state.state.max_bytes = max(share, ROW_OVERHEAD_BYTES)

    def _take_label(self, unit: JoinUnit, record: ConsumerRecord) -> None:
        batch = unit.batch
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

    def _take_answer(self, unit: JoinUnit, record: ConsumerRecord, role: Role) -> None:
        batch = unit.batch
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

    def count(self, batch: Batch, outcomes: Outcomes) -> None:
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
        states = [unit.state.state for unit in self.commits.units.values() if isinstance(unit.state, JoinUnit)]
        metrics.waiting.labels(kind="answers").set(sum(s.answers_waiting for s in states))
        metrics.waiting.labels(kind="labels").set(sum(s.labels_waiting for s in states))
        metrics.state_bytes.set(sum(s.bytes for s in states))
        covered = [s.covers_ms for s in states if len(s)]
        metrics.coverage.set(min(covered) / 1e3 if covered else 0.0)
