"""How two answers to one question compare, and how an answer compares with its label.

One implementation of the figures, for every place that reports them: ``d3stream compare`` (two answer sets
offline) and the shadow's live agreement metrics (``core/shadow.py``). Agreement of the decisions,
``|Δp|`` of every option, the score MAE and the confidence shift between two answers; accuracy, the Brier
score and the expected calibration error (ECE) of answers against labels. Pure functions over parsed
answer objects (``Slot``): no I/O, no Kafka.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from d3stream.runtime.kinds import finite_number, question_type

# Equal-width bins of [0, 1] the expected calibration error is measured over.
ECE_BINS = 10


@dataclass(frozen=True)
class Slot:
    """One answered question, normalised: every option's probability and the decision (an option key).

    ``noul`` has the options ``"false"`` and ``"true"``; ``score`` has its levels (``"0"``, ``"1"``, ...).
    """

    type: str
    probabilities: dict[str, float]
    decision: str
    confidence: float | None = None
    score: float | None = None

    @property
    def decision_probability(self) -> float:
        """The probability of the decided option: the confidence that calibration is measured on."""
        return self.probabilities.get(self.decision, 0.0)


def parse_slot(raw: Any) -> Slot | None:
    """A question's answer object as a :class:`Slot`; None for an error slot or an unreadable one."""
    if not isinstance(raw, dict) or "error" in raw:
        return None
    kind = question_type(raw.get("type"))
    read = kind.read(raw) if kind is not None else None
    if kind is None or read is None:
        return None
    return Slot(kind.name, read.probabilities, read.decision, finite_number(raw.get("confidence")), read.score)


def label_key(slot: Slot, expected: Any) -> str | None:
    """The option key a label names, in the slot's own terms; None when it cannot name one."""
    kind = question_type(slot.type)
    key = kind.label_key(expected) if kind is not None else None
    return key if key in slot.probabilities else None


@dataclass(frozen=True)
class JoinedQuestion:
    """A question answered on both sides, with ``|Δp|`` of every option (absent options count as 0)."""

    request_id: str
    question_id: str
    type: str
    a: Slot
    b: Slot
    deltas: dict[str, float]

    @property
    def agree(self) -> bool:
        return self.a.decision == self.b.decision

    @property
    def max_abs_dp(self) -> float:
        return max(self.deltas.values(), default=0.0)


@dataclass(frozen=True)
class GroupStats:
    """Comparison figures over a group of joined questions (None where the group has nothing to average)."""

    joined: int
    agreement: float | None
    mean_abs_dp: float | None
    max_abs_dp: float | None
    score_mae: float | None
    confidence_shift: float | None
    types: str = ""


@dataclass(frozen=True)
class CalibrationBin:
    lower: float
    upper: float
    count: int
    mean_confidence: float | None
    accuracy: float | None


@dataclass(frozen=True)
class LabelStats:
    """Accuracy, Brier score and ECE of one side over the labelled joined questions."""

    n: int
    accuracy: float | None
    brier: float | None
    ece: float | None
    bins: tuple[CalibrationBin, ...] = ()


def mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def group_stats(questions: Sequence[JoinedQuestion]) -> GroupStats:
    """Agreement, ``|Δp|`` mean and max (over every option), score MAE and confidence shift of a group."""
    deltas = [d for q in questions for d in q.deltas.values()]
    scores = [abs(q.b.score - q.a.score) for q in questions
              if q.type == "score" and q.a.score is not None and q.b.score is not None]
    shifts = [q.b.confidence - q.a.confidence for q in questions
              if q.a.confidence is not None and q.b.confidence is not None]
    return GroupStats(
        joined=len(questions),
        agreement=mean([1.0 if q.agree else 0.0 for q in questions]),
        mean_abs_dp=mean(deltas),
        max_abs_dp=max(deltas) if deltas else None,
        score_mae=mean(scores),
        confidence_shift=mean(shifts),
        types="/".join(sorted({q.type for q in questions})),
    )


def brier(slot: Slot, key: str) -> float:
    """Multi-class Brier score: the sum over the options of ``(p - onehot)²``.

    For ``noul`` that is the two-class sum over false and true, ``2 (p - y)²``: twice the binary Brier
    score, so it ranges over [0, 2] like the other types.
    """
    return math.fsum((p - (1.0 if option == key else 0.0)) ** 2 for option, p in slot.probabilities.items())


def calibration(confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> tuple[
    float | None, tuple[CalibrationBin, ...]
]:
    """Expected calibration error over ``bins`` equal-width bins of [0, 1], and the bins.

    ``ECE = sum_b (n_b / N) |accuracy_b - mean_confidence_b|``; a bin holds ``lower <= c < upper`` (the
    last one includes 1).
    """
    members: list[list[int]] = [[] for _ in range(bins)]
    for index, confidence in enumerate(confidences):
        # The small epsilon keeps 0.3 (which is 2.9999999999999996 tenths in floats) in the bin of 0.3.
        members[min(max(int(math.floor(confidence * bins + 1e-9)), 0), bins - 1)].append(index)
    out = []
    total = len(confidences)
    ece = 0.0
    for b, indices in enumerate(members):
        mean_confidence: float | None
        accuracy: float | None
        if indices:
            mean_confidence = math.fsum(confidences[i] for i in indices) / len(indices)
            accuracy = sum(1 for i in indices if correct[i]) / len(indices)
            ece += len(indices) / total * abs(accuracy - mean_confidence)
        else:
            mean_confidence = accuracy = None
        out.append(CalibrationBin(b / bins, (b + 1) / bins, len(indices), mean_confidence, accuracy))
    return (ece if total else None), tuple(out)


def label_stats(pairs: Sequence[tuple[Slot, str]]) -> LabelStats:
    """Accuracy, Brier score and ECE (on the probability of the decided option) of (slot, expected key) pairs."""
    if not pairs:
        return LabelStats(0, None, None, None, calibration([], [])[1])
    correct = [slot.decision == key for slot, key in pairs]
    ece, bins = calibration([slot.decision_probability for slot, _ in pairs], correct)
    return LabelStats(
        n=len(pairs),
        accuracy=sum(correct) / len(pairs),
        brier=math.fsum(brier(slot, key) for slot, key in pairs) / len(pairs),
        ece=ece,
        bins=bins,
    )


def join_slots(request_id: str, question_id: str, a: Slot, b: Slot) -> JoinedQuestion:
    """One question answered on both sides, with |Δp| of every option (an option one side lacks counts as 0);
    what ``compare`` and the shadow's live metrics (core/shadow.py) both measure."""
    options = list(a.probabilities) + [k for k in b.probabilities if k not in a.probabilities]
    deltas = {k: abs(a.probabilities.get(k, 0.0) - b.probabilities.get(k, 0.0)) for k in options}
    return JoinedQuestion(request_id, question_id, a.type, a, b, deltas)
