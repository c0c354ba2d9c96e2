"""The comparison itself: two answer sets joined by request and question id, and (with labels) each side
scored, as a ``Report`` of plain figures (no output here: render.py)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from d3stream.core.agreement import (
    GroupStats,
    JoinedQuestion,
    LabelStats,
    group_stats,
    join_slots,
    label_key,
    label_stats,
    parse_slot,
)
from d3stream.jobs.compare.sources import DEFAULT_TOP, Labels
from d3stream.runtime.kinds import QUESTION_TYPE_NAMES

# -- one answered question -------------------------------------------------------------------------


# -- the comparison --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabelReport:
    """Both sides against the labels, over the joined questions that have a usable label."""

    n: int
    a: LabelStats
    b: LabelStats
    by_type: dict[str, tuple[LabelStats, LabelStats]]
    unmatched: int  # labels of no joined question
    invalid: int  # labels of a joined question that name no option of it


@dataclass(frozen=True)
class SideSummary:
    """What one side holds."""

    source: str
    requests: int
    duplicates: int
    invalid_records: int
    request_errors: int
    request_error_codes: dict[str, int]
    questions: int
    question_errors: int
    question_error_codes: dict[str, int]


@dataclass(frozen=True)
class Disagreement:
    """A request's joined questions, largest ``|Δp|`` first."""

    request_id: str
    max_abs_dp: float
    questions: tuple[JoinedQuestion, ...]


class Headline(TypedDict):
    """The headline figures (``Report.headline``, compare's ``--json`` object); the label figures with labels."""

    joined: int
    only_a: int
    only_b: int
    agreement: float | None
    mean_abs_dp: float | None
    max_abs_dp: float | None
    score_mae: float | None
    confidence_shift: float | None
    only_a_questions: int
    only_b_questions: int
    skipped_questions: int
    duplicates_a: int
    duplicates_b: int
    errors_a: int
    errors_b: int
    question_errors_a: int
    question_errors_b: int
    labelled: NotRequired[int]
    accuracy_a: NotRequired[float | None]
    accuracy_b: NotRequired[float | None]
    brier_a: NotRequired[float | None]
    brier_b: NotRequired[float | None]
    ece_a: NotRequired[float | None]
    ece_b: NotRequired[float | None]
    log_loss_a: NotRequired[float | None]
    log_loss_b: NotRequired[float | None]


@dataclass(frozen=True)
class Report:
    """Everything :func:`compare` finds; :meth:`headline` is the ``--json`` object."""

    a: SideSummary
    b: SideSummary
    only_a: tuple[str, ...]  # request ids only in A
    only_b: tuple[str, ...]
    only_a_questions: int  # questions of requests on both sides, answered (or errored) only in A
    only_b_questions: int
    skipped_questions: int  # on both sides, or on one side of a request the other refused: not compared for errors
    unreadable_questions: int  # on both sides, but an unknown type, no probabilities, or different types
    overall: GroupStats
    by_type: dict[str, GroupStats]
    by_question: dict[str, GroupStats]
    top: tuple[Disagreement, ...]
    labels: LabelReport | None
    joined: tuple[JoinedQuestion, ...] = field(default=(), repr=False)

    def headline(self) -> Headline:
        """The headline figures as one JSON-ready object."""
        out: Headline = {
            "joined": self.overall.joined,
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "agreement": self.overall.agreement,
            "mean_abs_dp": self.overall.mean_abs_dp,
            "max_abs_dp": self.overall.max_abs_dp,
            "score_mae": self.overall.score_mae,
            "confidence_shift": self.overall.confidence_shift,
            "only_a_questions": self.only_a_questions,
            "only_b_questions": self.only_b_questions,
            "skipped_questions": self.skipped_questions,
            "duplicates_a": self.a.duplicates,
            "duplicates_b": self.b.duplicates,
            "errors_a": self.a.request_errors,
            "errors_b": self.b.request_errors,
            "question_errors_a": self.a.question_errors,
            "question_errors_b": self.b.question_errors,
        }
        if self.labels is not None:
            out.update({
                "labelled": self.labels.n,
                "accuracy_a": self.labels.a.accuracy,
                "accuracy_b": self.labels.b.accuracy,
                "brier_a": self.labels.a.brier,
                "brier_b": self.labels.b.brier,
                "ece_a": self.labels.a.ece,
                "ece_b": self.labels.b.ece,
                "log_loss_a": self.labels.a.log_loss,
                "log_loss_b": self.labels.b.log_loss,
            })
        return out


def _error_code(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("code")
    return value if isinstance(value, str) and value else "unknown"


def _answers_of(record: Mapping[str, object]) -> dict[str, object] | None:
    """The ``answers`` of a record, or None for a request-level error (or a record without answers)."""
    answers = record.get("answers")
    if record.get("error") is not None or not isinstance(answers, dict):
        return None
    return answers


def summarise(answers: Mapping[str, Mapping[str, object]], source: str = "") -> SideSummary:
    """Request and question counts, and errors by code, of one side."""
    request_codes: Counter[str] = Counter()
    question_codes: Counter[str] = Counter()
    questions = 0
    for record in answers.values():
        slots = _answers_of(record)
        if slots is None:
            request_codes[_error_code(record.get("error"))] += 1
            continue
        questions += len(slots)
        for slot in slots.values():
            if isinstance(slot, dict) and "error" in slot:
                question_codes[_error_code(slot.get("error"))] += 1
    return SideSummary(
        source=getattr(answers, "source", source) or source,
        requests=len(answers),
        duplicates=getattr(answers, "duplicates", 0),
        invalid_records=getattr(answers, "invalid", 0),
        request_errors=sum(request_codes.values()),
        request_error_codes=dict(sorted(request_codes.items())),
        questions=questions,
        question_errors=sum(question_codes.values()),
        question_error_codes=dict(sorted(question_codes.items())),
    )


def _label_report(joined: Sequence[JoinedQuestion], labels: Labels) -> LabelReport:
    by_key = {(q.request_id, q.question_id): q for q in joined}
    pairs: dict[str, list[tuple[JoinedQuestion, str]]] = defaultdict(list)
    invalid = unmatched = 0
    for key, expected in labels.items():
        question = by_key.get(key)
        if question is None:
            unmatched += 1
            continue
        option_a, option_b = label_key(question.a, expected), label_key(question.b, expected)
        if option_a is None or option_b is None:
            invalid += 1
            continue
        pairs[question.type].append((question, option_a))
    everything = [pair for kind in QUESTION_TYPE_NAMES for pair in pairs.get(kind, [])]
    return LabelReport(
        n=len(everything),
        a=label_stats([(q.a, key) for q, key in everything]),
        b=label_stats([(q.b, key) for q, key in everything]),
        by_type={
            kind: (label_stats([(q.a, k) for q, k in pairs[kind]]), label_stats([(q.b, k) for q, k in pairs[kind]]))
            for kind in QUESTION_TYPE_NAMES if pairs.get(kind)
        },
        unmatched=unmatched,
        invalid=invalid,
    )


@dataclass
class _Joined:
    """The questions of two answer sets joined by request and question id, and the ones left out."""

    questions: list[JoinedQuestion] = field(default_factory=list)
    only_a: int = 0  # questions of requests on both sides, answered (or errored) only in A
    only_b: int = 0
    skipped: int = 0  # an error on either side
    unreadable: int = 0  # an unknown type, no probabilities, or different types

    def request(self, request_id: str, answers_a: Mapping[str, object], answers_b: Mapping[str, object]) -> None:
        """Join the questions of one request both sides answered."""
        self.only_a += len(answers_a.keys() - answers_b.keys())
        self.only_b += len(answers_b.keys() - answers_a.keys())
        for question_id in sorted(answers_a.keys() & answers_b.keys()):
            raw_a, raw_b = answers_a[question_id], answers_b[question_id]
            if any(isinstance(raw, dict) and "error" in raw for raw in (raw_a, raw_b)):
                self.skipped += 1
                continue
            slot_a, slot_b = parse_slot(raw_a), parse_slot(raw_b)
            if slot_a is None or slot_b is None or slot_a.type != slot_b.type:
                self.unreadable += 1
                continue
            self.questions.append(join_slots(request_id, question_id, slot_a, slot_b))


def _join(a: Mapping[str, Mapping[str, object]], b: Mapping[str, Mapping[str, object]]) -> _Joined:
    joined = _Joined()
    for request_id in sorted(set(a) & set(b)):
        answers_a, answers_b = _answers_of(a[request_id]), _answers_of(b[request_id])
        if answers_a is None or answers_b is None:
            joined.skipped += len(answers_a or answers_b or ())
            continue
        joined.request(request_id, answers_a, answers_b)
    return joined


def _disagreements(joined: Sequence[JoinedQuestion]) -> list[Disagreement]:
    """Every request with joined questions, largest ``|Δp|`` first (then by id)."""
    by_request: dict[str, list[JoinedQuestion]] = defaultdict(list)
    for question in joined:
        by_request[question.request_id].append(question)
    return sorted(
        (
            Disagreement(rid, max(q.max_abs_dp for q in qs),
                         tuple(sorted(qs, key=lambda q: (-q.max_abs_dp, q.question_id))))
            for rid, qs in by_request.items()
        ),
        key=lambda d: (-d.max_abs_dp, d.request_id),
    )


def compare(
    a: Mapping[str, Mapping[str, object]],
    b: Mapping[str, Mapping[str, object]],
    labels: Labels | None = None,
    *,
    top: int = DEFAULT_TOP,
) -> Report:
    """Join two answer sets (request id -> answer record) by request and question id and compare them.

    A question is joined when both sides answered it without error, with the same type. Questions of a
    request that one side refused (request-level ``error``) or answered with an error slot are counted
    in ``skipped_questions``; requests only on one side in ``only_a`` / ``only_b``.
    """
    joined = _join(a, b)
    questions = joined.questions
    by_type_lists: dict[str, list[JoinedQuestion]] = defaultdict(list)
    by_question_lists: dict[str, list[JoinedQuestion]] = defaultdict(list)
    for question in questions:
        by_type_lists[question.type].append(question)
        by_question_lists[question.question_id].append(question)
    return Report(
        a=summarise(a),
        b=summarise(b),
        only_a=tuple(sorted(set(a) - set(b))),
        only_b=tuple(sorted(set(b) - set(a))),
        only_a_questions=joined.only_a,
        only_b_questions=joined.only_b,
        skipped_questions=joined.skipped,
        unreadable_questions=joined.unreadable,
        overall=group_stats(questions),
        by_type={kind: group_stats(by_type_lists[kind]) for kind in QUESTION_TYPE_NAMES if kind in by_type_lists},
        by_question={qid: group_stats(qs) for qid, qs in sorted(by_question_lists.items())},
        top=tuple(_disagreements(questions)[:top]),
        labels=None if labels is None else _label_report(questions, labels),
        joined=tuple(questions),
    )


