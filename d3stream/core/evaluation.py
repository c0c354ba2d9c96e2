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
  labelled counts as expired, a label never answered as unmatched), or earlier when the partition's state
  is over its byte budget (evicted).

Each entry is kept encoded (msgpack, the very bytes of the changelog record that makes it durable), so the
byte budget is what the state really holds. The figures come from ``agreement`` (``score``, ``Tally``): the
evaluator and ``d3stream compare --labels`` share one implementation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
from d3stream_client.contract import Answer, Evaluation, LabelledQuestion, LabelValue, Role, Source

from d3stream.core.agreement import Scored, Slot, label_key, parse_slot, score

# What an entry costs beyond its encoded bytes: the dict slot, the key string, the bytes object and the tuple
# (measured by ``d3stream bench --evaluate``: with this the count is within a few percent of the heap it uses).
ENTRY_OVERHEAD_BYTES = 320


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
    if answer.error is not None or not isinstance(answer.answers, dict):
        return None
    questions: dict[str, SlotRecord] = {}
    for question_id, raw in answer.answers.items():
        slot = parse_slot(raw)
        if slot is not None:
            questions[question_id] = SlotRecord(slot.type, list(slot.probabilities),
                                                list(slot.probabilities.values()), slot.decision,
                                                list(slot.legend))
    return AnswerEntry(model_of(answer), role, answer.answer_id, source, questions)


@dataclass
class Outcomes:
    """What the state saw, for the metrics (keys: model key, or the outcome alone)."""

    answers: dict[str, int] = field(default_factory=dict)  # model key -> answers taken in
    duplicate_answers: int = 0
    duplicate_labels: int = 0  # label questions already labelled for that request
    unknown_questions: dict[str, int] = field(default_factory=dict)  # model key -> labels of no question it answered
    unscorable: dict[str, int] = field(default_factory=dict)  # model key -> labels naming none of its options
    expired_answers: dict[str, int] = field(default_factory=dict)  # model key -> answers no label ever joined
    unmatched_labels: int = 0  # label events no answer ever joined
    evicted: int = 0  # entries dropped before their window, over the byte budget

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
                            correct=scored.correct, brier=scored.brier, log_loss=scored.log_loss)


class JoinState:
    """One partition's waiting answers and labels, by request id, joined exactly once per question and model.

    Every change is noted for the changelog (``drain_changes``: the new encoded value, or None when the entry
    is gone); ``restore`` rebuilds the state from those records.
    """

    def __init__(self, *, window_ms: int, max_bytes: int) -> None:
        self.window_ms = window_ms
        self.max_bytes = max_bytes
        self.stream_ms = 0  # the largest record timestamp seen: the clock the window is measured on
        # id -> (first seen, encoded, answers waiting for a label, label events waiting for an answer)
        self._entries: OrderedDict[str, tuple[int, bytes, int, int]] = OrderedDict()
        self._changes: dict[str, bytes | None] = {}
        self.bytes = 0
        self.answers_waiting = 0
        self.labels_waiting = 0
        self.outcomes = Outcomes()

    def __len__(self) -> int:
        return len(self._entries)

    # -------------------------------------------------------------------------------- taking records in

    def take_answer(self, request_id: str, entry: AnswerEntry) -> list[Joined] | None:
        """An answer read from the answer (or shadow) topic; the evaluations it completes, None when the request
        has an answer of that model already (a repeat: the first one counts)."""
        self.tick(entry.source.timestamp)
        waiting = self._get(request_id, entry.source.timestamp)
        if any(a.model_key == entry.model_key for a in waiting.answers):
            self.outcomes.duplicate_answers += 1
            return None
        self.outcomes.bump(self.outcomes.answers, entry.model_key)
        waiting.answers.append(entry)
        joined = [j for label in waiting.labels if (j := self._join(request_id, waiting, entry, label)) is not None]
        self._put(request_id, waiting)
        return joined

    def take_label(self, request_id: str, label: LabelEntry) -> list[Joined]:
        """A label event; the evaluations it completes. Questions labelled before are dropped from it."""
        self.tick(label.source.timestamp)
        waiting = self._get(request_id, label.source.timestamp)
        labelled = {question for earlier in waiting.labels for question in earlier.labels}
        fresh = {question: value for question, value in label.labels.items() if question not in labelled}
        self.outcomes.duplicate_labels += len(label.labels) - len(fresh)
        if not fresh:
            return []
        label = msgspec.structs.replace(label, labels=fresh)
        waiting.labels.append(label)
        joined = [j for answer in waiting.answers if (j := self._join(request_id, waiting, answer, label)) is not None]
        self._put(request_id, waiting)
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

    def expire(self) -> int:
        """Drop the entries first seen more than ``window_ms`` before the stream time, then the oldest ones while
        the state is over its byte budget; how many were dropped."""
        dropped = 0
        horizon = self.stream_ms - self.window_ms
        while self._entries:
            request_id, (first_ms, *_) = next(iter(self._entries.items()))
            over_budget = self.bytes > self.max_bytes
            if first_ms >= horizon and not over_budget:
                break
            self._drop(request_id, evicted=first_ms >= horizon)
            dropped += 1
        return dropped

    def _drop(self, request_id: str, *, evicted: bool) -> None:
        first_ms, value, answers, labels = self._entries.pop(request_id)
        self.bytes -= len(value) + len(request_id) + ENTRY_OVERHEAD_BYTES
        self.answers_waiting -= answers
        self.labels_waiting -= labels
        self._changes[request_id] = None
        waiting = decode_waiting(value)
        for answer in waiting.answers:
            if answer.model_key not in waiting.joined:
                self.outcomes.bump(self.outcomes.expired_answers, answer.model_key)
        if waiting.labels and not waiting.answers:
            self.outcomes.unmatched_labels += len(waiting.labels)
        if evicted:
            self.outcomes.evicted += 1

    # ------------------------------------------------------------------------------ entries and changelog

    def _get(self, request_id: str, timestamp: int | None) -> Waiting:
        held = self._entries.get(request_id)
        if held is None:
            return Waiting(first_ms=timestamp if timestamp is not None else self.stream_ms)
        return decode_waiting(held[1])

    def _put(self, request_id: str, waiting: Waiting) -> None:
        value = encode_waiting(waiting)
        held = self._entries.get(request_id)
        if held is not None:
            self.bytes -= len(held[1])
            self.answers_waiting -= held[2]
            self.labels_waiting -= held[3]
        else:
            self.bytes += len(request_id) + ENTRY_OVERHEAD_BYTES
        self._hold(request_id, waiting, value)
        self._changes[request_id] = value

    def _hold(self, request_id: str, waiting: Waiting, value: bytes) -> None:
        answers = sum(1 for answer in waiting.answers if answer.model_key not in waiting.joined)
        labels = len(waiting.labels) if not waiting.answers else 0
        self._entries[request_id] = (waiting.first_ms, value, answers, labels)
        self.bytes += len(value)
        self.answers_waiting += answers
        self.labels_waiting += labels

    def take_outcomes(self) -> Outcomes:
        """What was counted since the last call."""
        outcomes, self.outcomes = self.outcomes, Outcomes()
        return outcomes

    def drain_changes(self) -> dict[str, bytes | None]:
        """The entries changed since the last drain: their new encoded value, None for a dropped one."""
        changes, self._changes = self._changes, {}
        return changes

    def restore(self, records: Iterator[tuple[str, bytes | None]]) -> None:
        """Rebuild from changelog records (key, value; None deletes), oldest first; the order of first sight
        is taken from the entries themselves."""
        latest: dict[str, bytes] = {}
        for request_id, value in records:
            if value is None:
                latest.pop(request_id, None)
            else:
                latest[request_id] = value
        restored = sorted(((decode_waiting(value), request_id, value) for request_id, value in latest.items()),
                          key=lambda item: item[0].first_ms)
        self._entries.clear()
        self.bytes = self.answers_waiting = self.labels_waiting = 0
        for waiting, request_id, value in restored:
            self.bytes += len(request_id) + ENTRY_OVERHEAD_BYTES
            self._hold(request_id, waiting, value)
            self.stream_ms = max(self.stream_ms, waiting.first_ms)
        self._changes.clear()
