"""Labels joined with answers as they arrive: the state of the live evaluator, without Kafka.

A label (``d3stream_client.contract.Label``) says what a request's answers should have been. It may come
before its answer or after it, minutes or days apart, twice, or never; the answer may come twice too (an
at-least-once worker, a replay), and from more than one model (the live topic's default and canary models,
the shadow topic's model). :class:`JoinState` keeps, for one partition, what each request id has seen so
far and joins a question's label with each model's answer to it exactly once:

* an answer with no label yet waits, and so does a label with no answer yet;
* a label event joins each of its questions with every model's answer that is waiting, and an answer joins
  with every label already waiting; a question is joined once per model, whatever comes again;
* an entry is dropped ``window_ms`` of stream time after its request id was first seen (then an answer never
  labelled counts as expired, a label never answered as unmatched), or earlier, oldest first, when the
  partition's state is over its byte budget: then it is evicted, its answers count as evicted (not expired:
  they did not wait their window), and a marker of a few dozen bytes stays for the rest of its window, so a
  label or answer that comes later for it is counted as arriving after the eviction, at once, instead of
  waiting a window for a partner that is gone.

Each entry is kept encoded (msgpack, the very bytes of the changelog record that makes it durable) in the
partition's ``state_store.WaitingStore``, on local disk: memory does not grow with how many entries wait, and
the byte budget is what the file holds. The figures come from ``agreement`` (``score``, ``Tally``): the
evaluator and ``d3stream compare --labels`` share one implementation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
from d3stream_client.contract import Answer, Evaluation, LabelledQuestion, LabelValue, Role, Source

from d3stream.core.agreement import Scored, Slot, label_key, parse_slot, score
from d3stream.jobs.evaluate.state_store import Held, Totals, WaitingStore

# Entries read from the store per step of a window or budget walk.
WALK_STEP = 512


class SlotRecord(msgspec.Struct, array_like=True):
    """One answered question, as much of it as scoring needs."""

    type: str
    keys: list[str]
    probabilities: list[float]
    decision: str
    legend: list[tuple[str, str]] = []

    def slot(self) -> Slot:
        return Slot(self.type, dict(zip(self.keys, self.probabilities, strict=True)), self.decision,
                    legend=tuple(self.legend))


class AnswerEntry(msgspec.Struct, array_like=True):
    """One model's answer to a request, waiting for labels."""

    model: str
    role: Role
    answer_id: str
    source: Source
    questions: dict[str, SlotRecord]

    @property
    def model_key(self) -> str:
        return f"{self.role}:{self.model}"


class LabelEntry(msgspec.Struct, array_like=True):
    """The questions one label event labelled first (a question labelled again is not kept twice)."""

    labels: dict[str, LabelValue]
    source: Source
    labeled_by: str | None = None
    labeled_at: int | None = None


class Waiting(msgspec.Struct, array_like=True):
    """Everything one request id has seen: the changelog record's value."""

    first_ms: int
    answers: list[AnswerEntry] = []
    labels: list[LabelEntry] = []
    joined: dict[str, list[str]] = {}  # model key -> question ids joined (or found unusable) for it
    evicted: bool = False  # only a marker: the entry was evicted before its window (what it held is gone)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Waiting)


def encode_waiting(waiting: Waiting) -> bytes:
    return _encoder.encode(waiting)


def decode_waiting(value: bytes) -> Waiting:
    return _decoder.decode(value)


def model_of(answer: Answer) -> str:
    """The model an answer names (its ``model``, else its provenance's), ``unknown`` when neither does."""
    if answer.model:
        return answer.model
    recorded = answer.provenance.model
    return recorded.name if recorded is not None and recorded.name else "unknown"


def answer_entry(answer: Answer, source: Source, role: Role) -> AnswerEntry | None:
    """The answer's scorable questions; None for an error answer (there is nothing to score)."""
    read = read_answer(answer, source, role)
    return read[0] if read is not None else None


def read_answer(answer: Answer, source: Source, role: Role) -> tuple[AnswerEntry, dict[str, Slot]] | None:
    """The answer's entry and its questions read as slots (what drift and the estimates take, read once);
    None for an error answer."""
    if answer.error is not None or not isinstance(answer.answers, dict):
        return None
    questions: dict[str, SlotRecord] = {}
    slots: dict[str, Slot] = {}
    for question_id, raw in answer.answers.items():
        slot = parse_slot(raw)
        if slot is not None:
            slots[question_id] = slot
            questions[question_id] = SlotRecord(slot.type, list(slot.probabilities),
                                                list(slot.probabilities.values()), slot.decision,
                                                list(slot.legend))
    return AnswerEntry(model_of(answer), role, answer.answer_id, source, questions), slots


@dataclass
class Outcomes:
    """What the state saw, for the metrics (keys: model key, or the outcome alone)."""

    answers: dict[str, int] = field(default_factory=dict)  # model key -> answers taken in
    duplicate_answers: int = 0
    duplicate_labels: int = 0  # label questions already labelled for that request
    unknown_questions: dict[str, int] = field(default_factory=dict)  # model key -> labels of no question it answered
    unscorable: dict[str, int] = field(default_factory=dict)  # model key -> labels naming none of its options
    expired_answers: dict[str, int] = field(default_factory=dict)  # model key -> answers no label joined in the window
    unmatched_labels: int = 0  # label events no answer joined in the window
    evicted: int = 0  # entries dropped before their window, over the byte budget
    evicted_answers: dict[str, int] = field(default_factory=dict)  # model key -> unjoined answers among them
    evicted_labels: int = 0  # unjoined label events among them
    after_eviction: dict[str, int] = field(default_factory=dict)  # answers and labels of an evicted request, by kind

    def bump(self, counts: dict[str, int], key: str) -> None:
        counts[key] = counts.get(key, 0) + 1


@dataclass(frozen=True)
class Joined:
    """One evaluation: a model's answer joined with a label event's questions, and their scores."""

    evaluation: Evaluation
    scored: dict[str, Scored]


def _question(scored: Scored, label: LabelValue) -> LabelledQuestion:
    return LabelledQuestion(type=scored.type, label=label, label_option=scored.label_option,
                            predicted=scored.predicted, p_label=scored.p_label, confidence=scored.confidence,
                            correct=scored.correct, brier=scored.brier, log_loss=scored.log_loss,
                            expected_brier=scored.expected_brier)


class JoinState:
    """One partition's waiting answers and labels, by request id, joined exactly once per question and model.

    Every change is noted for the changelog (``drain_changes``: the new encoded value, or None when the entry
    is gone) and written to the partition's store, whose open batch the caller commits with the changelog;
    ``restore`` rebuilds the store from changelog records, ``apply`` brings it up to date with a changelog's
    tail.
    """

    def __init__(self, *, window_ms: int, max_bytes: int, store: WaitingStore | None = None) -> None:
        self.window_ms = window_ms
        self.max_bytes = max_bytes
        self.store = store if store is not None else WaitingStore()
        self.stream_ms = 0  # the largest record timestamp seen: the clock the window is measured on
        self._changes: dict[str, bytes | None] = {}
        self.outcomes = Outcomes()
        self._count_totals()

    def _count_totals(self, *, scan: bool = False) -> None:
        """The sums as the store's last batch committed them (or counted from its entries)."""
        totals = None if scan else self.store.saved_totals()
        if totals is None:
            totals = self.store.totals()
        self.bytes, self.answers_waiting, self.labels_waiting = totals.bytes, totals.answers, totals.labels
        self.entries = totals.entries
        self.stream_ms = max(self.stream_ms, self.store.newest_first_ms() or 0)

    def totals(self) -> Totals:
        return Totals(self.bytes, self.answers_waiting, self.labels_waiting, self.entries)

    def commit(self) -> None:
        """The batch's changes are in the changelog: make them durable in the store."""
        self.store.commit(self.totals())

    def rollback(self) -> None:
        """The batch's changelog transaction failed: the store and the sums go back to the last commit."""
        self.store.rollback()
        self._changes.clear()
        self._count_totals()

    def __len__(self) -> int:
        return self.entries

    # -------------------------------------------------------------------------------- taking records in

    def take_answer(self, request_id: str, entry: AnswerEntry) -> list[Joined] | None:
        """An answer read from the answer (or shadow) topic; the evaluations it completes (none when its
        request's state was evicted: it is counted, not kept), None when the request has an answer of that model
        already (a repeat: the first one counts)."""
        self.tick(entry.source.timestamp)
        waiting, before = self._get(request_id, entry.source.timestamp)
        if waiting.evicted:
            self.outcomes.bump(self.outcomes.after_eviction, "answer")
            return []
        if any(a.model_key == entry.model_key for a in waiting.answers):
            self.outcomes.duplicate_answers += 1
            return None
        self.outcomes.bump(self.outcomes.answers, entry.model_key)
        waiting.answers.append(entry)
        joined = [j for label in waiting.labels if (j := self._join(request_id, waiting, entry, label)) is not None]
        self._put(request_id, waiting, before)
        return joined

    def take_label(self, request_id: str, label: LabelEntry) -> list[Joined]:
        """A label event; the evaluations it completes. Questions labelled before are dropped from it, and the
        whole event when its request's state was evicted (it could only wait for nothing)."""
        self.tick(label.source.timestamp)
        waiting, before = self._get(request_id, label.source.timestamp)
        if waiting.evicted:
            self.outcomes.bump(self.outcomes.after_eviction, "label")
            return []
        labelled = {question for earlier in waiting.labels for question in earlier.labels}
        fresh = {question: value for question, value in label.labels.items() if question not in labelled}
        self.outcomes.duplicate_labels += len(label.labels) - len(fresh)
        if not fresh:
            return []
        label = msgspec.structs.replace(label, labels=fresh)
        waiting.labels.append(label)
        joined = [j for answer in waiting.answers if (j := self._join(request_id, waiting, answer, label)) is not None]
        self._put(request_id, waiting, before)
        return joined

    def _join(self, request_id: str, waiting: Waiting, answer: AnswerEntry, label: LabelEntry) -> Joined | None:
        """Score the label's questions this answer has not been joined on yet (each noted as joined)."""
        done = waiting.joined.setdefault(answer.model_key, [])
        scored: dict[str, Scored] = {}
        questions: dict[str, LabelledQuestion] = {}
        for question_id, value in label.labels.items():
            if question_id in done:
                continue
            done.append(question_id)
            record = answer.questions.get(question_id)
            if record is None:
                self.outcomes.bump(self.outcomes.unknown_questions, answer.model_key)
                continue
            slot = record.slot()
            key = label_key(slot, value)
            if key is None:
                self.outcomes.bump(self.outcomes.unscorable, answer.model_key)
                continue
            scored[question_id] = score(slot, key)
            questions[question_id] = _question(scored[question_id], value)
        if not scored:
            return None
        evaluation = Evaluation(
            id=request_id, model=answer.model, role=answer.role, answer_id=answer.answer_id, answer=answer.source,
            label=label.source, labeled_by=label.labeled_by, labeled_at=label.labeled_at,
            lag_ms=(label.source.timestamp or 0) - (answer.source.timestamp or 0), questions=questions)
        return Joined(evaluation, scored)

    # ---------------------------------------------------------------------------------- the window

    def tick(self, timestamp: int | None) -> None:
        if timestamp is not None and timestamp > self.stream_ms:
            self.stream_ms = timestamp

    @property
    def covers_ms(self) -> int:
        """Stream time the state reaches back: from the oldest entry's first sight to now (markers count: an
        evicted request is still known)."""
        oldest = self.store.oldest_first_ms()
        return 0 if oldest is None else max(0, self.stream_ms - oldest)

    def expire(self) -> int:
        """Drop the entries first seen more than ``window_ms`` before the stream time, then evict the oldest ones
        while the state is over its byte budget (markers last); how many entries were dropped or evicted."""
        dropped = 0
        horizon = self.stream_ms - self.window_ms
        while rows := self.store.seen_before(horizon, WALK_STEP):
            for request_id, held in rows:
                self._drop(request_id, held)
            dropped += len(rows)
        while self.bytes > self.max_bytes and (rows := self.store.oldest_live(WALK_STEP)):
            dropped += self._evict_while_over(rows)
        while self.bytes > self.max_bytes and (rows := self.store.oldest_markers(WALK_STEP)):
            for request_id, held in rows:
                if self.bytes <= self.max_bytes:
                    break
                self._forget(request_id, held)
        return dropped

    def _evict_while_over(self, rows: list[tuple[str, Held]]) -> int:
        evicted = 0
        for request_id, held in rows:
            if self.bytes <= self.max_bytes:
                break
            self._evict(request_id, held)
            evicted += 1
        return evicted

    def _drop(self, request_id: str, held: Held) -> None:
        """Its window is over: what still waited counts as expired (answers) or unmatched (labels)."""
        self._forget(request_id, held)
        if held.marker:
            return
        models, labels = _still_waiting(decode_waiting(held.value))
        for model_key in models:
            self.outcomes.bump(self.outcomes.expired_answers, model_key)
        self.outcomes.unmatched_labels += labels

    def _evict(self, request_id: str, held: Held) -> None:
        """Over the byte budget before its window: what waited counts as evicted, and a marker stays."""
        waiting = decode_waiting(held.value)
        models, labels = _still_waiting(waiting)
        for model_key in models:
            self.outcomes.bump(self.outcomes.evicted_answers, model_key)
        self.outcomes.evicted_labels += labels
        self.outcomes.evicted += 1
        self._put(request_id, Waiting(first_ms=waiting.first_ms, evicted=True), held)

    def _forget(self, request_id: str, held: Held) -> None:
        self.store.delete(request_id)
        self._count(request_id, held, -1)
        self._changes[request_id] = None

    # ------------------------------------------------------------------------------ entries and changelog

    def _get(self, request_id: str, timestamp: int | None) -> tuple[Waiting, Held | None]:
        """The request's record (a new one when it has none yet) and its entry as stored (None: none)."""
        held = self.store.get(request_id)
        if held is None:
            return Waiting(first_ms=timestamp if timestamp is not None else self.stream_ms), None
        return decode_waiting(held.value), held

    def _put(self, request_id: str, waiting: Waiting, before: Held | None) -> None:
        """Store the request's record in place of ``before`` (what ``_get`` found)."""
        value = encode_waiting(waiting)
        if before is not None:
            self._count(request_id, before, -1)
        held = _held(waiting, value)
        self.store.put(request_id, held)
        self._count(request_id, held, +1)
        self._changes[request_id] = value

    def _count(self, request_id: str, held: Held, sign: int) -> None:
        self.bytes += sign * held.size(request_id)
        self.answers_waiting += sign * held.answers
        self.labels_waiting += sign * held.labels
        self.entries += sign

    def take_outcomes(self) -> Outcomes:
        """What was counted since the last call."""
        outcomes, self.outcomes = self.outcomes, Outcomes()
        return outcomes

    def drain_changes(self) -> dict[str, bytes | None]:
        """The entries changed since the last drain: their new encoded value, None for a dropped one."""
        changes, self._changes = self._changes, {}
        return changes

    def restore(self, records: Iterable[tuple[str, bytes | None]]) -> None:
        """Rebuild the store from changelog records (key, value; None deletes), oldest first, in its open batch."""
        self.restore_begin()
        self.apply(records, counted=False)
        self.restore_end()

    def restore_begin(self) -> None:
        """Before a restore from the whole changelog: nothing held."""
        self.store.clear()
        self._changes.clear()
        self.bytes = self.answers_waiting = self.labels_waiting = self.entries = 0

    def restore_end(self) -> None:
        """After it: the sums counted from what was restored."""
        self._count_totals(scan=True)

    def apply(self, records: Iterable[tuple[str, bytes | None]], *, counted: bool = True) -> int:
        """Write changelog records (key, value; None deletes) to the store, oldest first, in its open batch:
        a changelog's tail that other owners wrote since this file's offset, or (``counted`` off, between
        ``restore_begin`` and ``restore_end``) a whole changelog. How many records were applied. No outcome is
        counted again: their writers counted them."""
        applied = 0
        store = self.store
        for request_id, value in records:
            if counted and (before := store.get(request_id)) is not None:
                self._count(request_id, before, -1)
            if value is None:
                store.delete(request_id)
            else:
                held = _held(decode_waiting(value), value)
                store.put(request_id, held)
                if counted:
                    self._count(request_id, held, +1)
                    self.tick(held.first_ms)
            applied += 1
        store.flush()  # a whole changelog must not wait in the store's write buffer
        return applied


def _still_waiting(waiting: Waiting) -> tuple[list[str], int]:
    """What of a request still waits: the model keys of its answers no label joined, and its label events
    when no answer came."""
    models = [answer.model_key for answer in waiting.answers if answer.model_key not in waiting.joined]
    return models, len(waiting.labels) if not waiting.answers else 0


def _held(waiting: Waiting, value: bytes) -> Held:
    """The store's entry of an encoded record: its answers waiting for a label and labels waiting for an answer."""
    if waiting.evicted:
        return Held(waiting.first_ms, value, marker=True)
    models, labels = _still_waiting(waiting)
    return Held(waiting.first_ms, value, len(models), labels)
