"""How two answers to one question compare, and how an answer compares with its label.

One implementation of the figures, for every place that reports them: ``d3stream compare`` (two answer sets
offline) and the shadow's live agreement metrics (``core/shadow.py``). Agreement of the decisions,
``|Δp|`` of every option, the score MAE and the confidence shift between two answers; accuracy, the Brier
score, the log loss and the expected calibration error (ECE) of answers against labels, through one
``Tally`` that ``d3stream evaluate`` keeps live too. Pure functions over parsed answer objects (``Slot``):
no I/O, no Kafka.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from d3stream.runtime.kinds import finite_number, label_option, question_type

# Equal-width bins of [0, 1] the expected calibration error is measured over.
ECE_BINS = 10


@dataclass(slots=True)
class Slot:
    """One answered question, normalised: every option's probability and the decision (an option key).
    Treated as immutable (not frozen: a frozen dataclass costs twice as much to make, and the evaluator makes
    tens of thousands a second).

    ``noul`` has the options ``"false"`` and ``"true"``; ``score`` has its levels (``"0"``, ``"1"``, ...).
    """

    type: str
    probabilities: dict[str, float]
    decision: str
    confidence: float | None = None
    score: float | None = None
    # A score's level texts by key, as its answer's legend gives them: a label may name a level by its text.
    legend: tuple[tuple[str, str], ...] = ()

    @property
    def decision_probability(self) -> float:
        """The probability of the decided option: the confidence that calibration is measured on."""
        return self.probabilities.get(self.decision, 0.0)


def parse_slot(raw: object) -> Slot | None:
    """A question's answer object as a :class:`Slot`; None for an error slot or an unreadable one."""
    if not isinstance(raw, dict) or "error" in raw:
        return None
    kind = question_type(raw.get("type"))
    read = kind.read(raw) if kind is not None else None
    if kind is None or read is None:
        return None
    legend = raw.get("legend")
    texts = tuple((key, text) for key, text in legend.items() if isinstance(text, str)) \
        if kind.name == "score" and isinstance(legend, dict) else ()
    return Slot(kind.name, read.probabilities, read.decision, finite_number(raw.get("confidence")), read.score,
                texts)


def label_key(slot: Slot, expected: object) -> str | None:
    """The option key a label names, in the slot's own terms (a score level by its text when the label is a
    string, by its index when it is an integer: ``kinds.label_option``); None when it names none of the slot's
    options (a label of another question type, an unknown option)."""
    key = label_option(slot.type, expected, slot.legend)
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
    """Accuracy, Brier score, ECE and log loss of answers over their labelled questions."""

    n: int
    accuracy: float | None
    brier: float | None
    ece: float | None
    log_loss: float | None = None
    bins: tuple[CalibrationBin, ...] = ()
    # What the answers expected of themselves (jobs/evaluate/estimation.py) over the same labelled questions, and the
    # estimation error: expected minus realized (near 0 while the model is calibrated).
    estimated_accuracy: float | None = None
    estimated_brier: float | None = None
    accuracy_error: float | None = None
    brier_error: float | None = None


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


# The probability a log loss is taken of is at least this (an answer certain of the wrong option would
# otherwise count as infinitely wrong, and one such answer would make the mean meaningless).
LOG_LOSS_FLOOR = 1e-15


@dataclass(frozen=True)
class Scored:
    """One answered question scored against its label: the terms every label figure is a mean of."""

    type: str
    label_option: str
    predicted: str
    p_label: float
    confidence: float  # the probability of the predicted option: what calibration is measured on
    correct: bool
    brier: float
    log_loss: float
    # What the answer expects of itself against a label drawn from its probabilities (jobs/evaluate/estimation.py):
    # its expected accuracy is ``confidence``, its expected Brier term this. None: not recorded (an evaluation
    # record from before the estimates).
    expected_brier: float | None = None


def expected_brier(slot: Slot) -> float:
    """1 - sum of p^2: the Brier term a calibrated answer expects (``estimation``)."""
    return 1.0 - sum([p * p for p in slot.probabilities.values()])


def score(slot: Slot, key: str) -> Scored:
    """``slot`` against the label naming option ``key`` (``label_key`` of the label)."""
    p_label = slot.probabilities.get(key, 0.0)
    return Scored(
        type=slot.type,
        label_option=key,
        predicted=slot.decision,
        p_label=p_label,
        confidence=slot.decision_probability,
        correct=slot.decision == key,
        brier=brier(slot, key),
        log_loss=-math.log(max(p_label, LOG_LOSS_FLOOR)),
        expected_brier=expected_brier(slot),
    )


def calibration_bin(confidence: float, bins: int = ECE_BINS) -> int:
    """The equal-width bin of [0, 1] a confidence falls in (``lower <= c < upper``; the last one includes 1)."""
    # The small epsilon keeps 0.3 (which is 2.9999999999999996 tenths in floats) in the bin of 0.3.
    return min(max(int(math.floor(confidence * bins + 1e-9)), 0), bins - 1)


# Sums are kept in fixed point with this many units per 1.0: integers add exactly, so a tally's figures do
# not depend on the order its questions came in (the live evaluator sees them in arrival order, compare in
# file order) and two tallies of the same questions give the very same floats.
_FIXED = 1 << 64


def _fixed(value: float) -> int:
    return round(value * _FIXED)


@dataclass
class Tally:
    """Counts and exact sums over scored questions, from which accuracy, Brier, log loss and ECE come.

    One implementation for ``d3stream compare --labels`` (offline) and ``d3stream evaluate`` (live): the same
    scored questions give identical figures whichever fed them, in whatever order.
    """

    bins: int = ECE_BINS
    n: int = 0
    correct: int = 0
    brier_sum: int = 0
    log_loss_sum: int = 0
    bin_counts: list[int] = field(default_factory=list)
    bin_correct: list[int] = field(default_factory=list)
    bin_confidence: list[int] = field(default_factory=list)
    expected_n: int = 0  # scored questions that carry their expected Brier term
    expected_correct_sum: int = 0  # of those: the sums of their confidence and expected Brier terms
    expected_brier_sum: int = 0
    realized_correct: int = 0  # and of their realized ones, so the estimation error compares like with like
    realized_brier_sum: int = 0

    def __post_init__(self) -> None:
        for counts in (self.bin_counts, self.bin_correct, self.bin_confidence):
            counts.extend([0] * (self.bins - len(counts)))

    def add(self, scored: Scored) -> None:
        self.n += 1
        self.correct += scored.correct
        self.brier_sum += _fixed(scored.brier)
        self.log_loss_sum += _fixed(scored.log_loss)
        b = calibration_bin(scored.confidence, self.bins)
        self.bin_counts[b] += 1
        self.bin_correct[b] += scored.correct
        self.bin_confidence[b] += _fixed(scored.confidence)
        if scored.expected_brier is not None:
            self.expected_n += 1
            self.expected_correct_sum += _fixed(scored.confidence)
            self.expected_brier_sum += _fixed(scored.expected_brier)
            self.realized_correct += scored.correct
            self.realized_brier_sum += _fixed(scored.brier)

    def stats(self) -> LabelStats:
        """The figures (None where there is nothing to average)."""
        n = self.n
        bins = tuple(
            CalibrationBin(b / self.bins, (b + 1) / self.bins, count,
                           self.bin_confidence[b] / (_FIXED * count) if count else None,
                           self.bin_correct[b] / count if count else None)
            for b, count in enumerate(self.bin_counts)
        )
        if not n:
            return LabelStats(0, None, None, None, None, bins)
        # ECE = sum_b (n_b / N) |accuracy_b - mean confidence_b| = sum_b |correct_b - confidence sum_b| / N.
        gaps = sum(abs(self.bin_correct[b] * _FIXED - self.bin_confidence[b]) for b in range(self.bins))
        expected_n = self.expected_n
        return LabelStats(
            n=n,
            accuracy=self.correct / n,
            brier=self.brier_sum / (_FIXED * n),
            ece=gaps / (_FIXED * n),
            log_loss=self.log_loss_sum / (_FIXED * n),
            bins=bins,
            estimated_accuracy=self.expected_correct_sum / (_FIXED * expected_n) if expected_n else None,
            estimated_brier=self.expected_brier_sum / (_FIXED * expected_n) if expected_n else None,
            accuracy_error=(self.expected_correct_sum - self.realized_correct * _FIXED) / (_FIXED * expected_n)
            if expected_n else None,
            brier_error=(self.expected_brier_sum - self.realized_brier_sum) / (_FIXED * expected_n)
            if expected_n else None,
        )


def label_stats(pairs: Sequence[tuple[Slot, str]]) -> LabelStats:
    """Accuracy, Brier score, log loss and ECE (on the probability of the decided option) of (slot, expected
    key) pairs."""
    tally = Tally()
    for slot, key in pairs:
        tally.add(score(slot, key))
    return tally.stats()


def join_slots(request_id: str, question_id: str, a: Slot, b: Slot) -> JoinedQuestion:
    """One question answered on both sides, with |Δp| of every option (an option one side lacks counts as 0);
    what ``compare`` and the shadow's live metrics (core/shadow.py) both measure."""
    options = list(a.probabilities) + [k for k in b.probabilities if k not in a.probabilities]
    deltas = {k: abs(a.probabilities.get(k, 0.0) - b.probabilities.get(k, 0.0)) for k in options}
    return JoinedQuestion(request_id, question_id, a.type, a, b, deltas)
