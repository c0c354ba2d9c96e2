"""Drift while labels are slow: how a model's answers are spread now, against how they were spread before.

Labels may take days; the answers themselves are there at once. For every model and question the evaluator
keeps the distribution of its last ``window`` answers (choice shares of the decided option, the mean
probability of a noul's true, the mean level of a score) and compares it with a reference distribution by
the population stability index,

    PSI = sum over bins of (current share - reference share) x ln(current share / reference share),

with each share floored at ``SHARE_FLOOR`` so that an empty bin does not make it infinite. The bins are the
options of a choice and the levels of a score (the decided one), and ten equal-width bins of p(true) for a
noul. The reference is the first ``window`` answers of that model to that question the evaluator read, or a
file of answers given as reference (``evaluate_drift_reference``). A common reading: below 0.1 stable, 0.1
to 0.25 a moderate shift, above 0.25 a large one.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from d3stream.core.agreement import Slot, calibration_bin

SHARE_FLOOR = 1e-4
NOUL_BINS = 10


def drift_bin(slot: Slot) -> str:
    """The bin an answer falls in: its decision (choice, score), or its tenth of p(true) (noul)."""
    if slot.type == "noul":
        return f"p{calibration_bin(slot.probabilities.get('true', 0.0), NOUL_BINS)}"
    return slot.decision


def answer_value(slot: Slot) -> float | None:
    """What the mean of a noul (p(true)) or a score (its expected level) is taken over; None for a choice."""
    if slot.type == "noul":
        return slot.probabilities.get("true", 0.0)
    if slot.type == "score":
        return slot.score
    return None


def psi(reference: Counter[str], current: Counter[str]) -> float | None:
    """The population stability index of ``current`` against ``reference`` (None when either is empty)."""
    total_reference, total_current = sum(reference.values()), sum(current.values())
    if not total_reference or not total_current:
        return None
    value = 0.0
    for key in reference.keys() | current.keys():
        expected = max(reference[key] / total_reference, SHARE_FLOOR)
        actual = max(current[key] / total_current, SHARE_FLOOR)
        value += (actual - expected) * math.log(actual / expected)
    return value


@dataclass
class QuestionDrift:
    """One model's answers to one question: the reference bins, and the rolling window's."""

    window: int
    reference: Counter[str] = field(default_factory=Counter)
    reference_fixed: bool = False  # from a reference file: never learnt from the stream
    recent: deque[tuple[str, float | None]] = field(default_factory=deque)
    current: Counter[str] = field(default_factory=Counter)
    value_sum: float = 0.0
    values: int = 0
    learnt: int = 0  # answers taken into a reference learnt from the stream

    def add(self, slot: Slot) -> None:
        bin_, value = drift_bin(slot), answer_value(slot)
        if not self.reference_fixed and self.learnt < self.window:
            self.reference[bin_] += 1
            self.learnt += 1
        self.recent.append((bin_, value))
        self.current[bin_] += 1
        if value is not None:
            self.value_sum += value
            self.values += 1
        if len(self.recent) > self.window:
            old_bin, old_value = self.recent.popleft()
            self.current[old_bin] -= 1
            if not self.current[old_bin]:
                del self.current[old_bin]
            if old_value is not None:
                self.value_sum -= old_value
                self.values -= 1

    @property
    def psi(self) -> float | None:
        """PSI of the window against the reference, once the reference is complete."""
        if not self.reference_fixed and self.learnt < self.window:
            return None
        return psi(self.reference, self.current)

    @property
    def mean(self) -> float | None:
        return self.value_sum / self.values if self.values else None

    def shares(self) -> dict[str, float]:
        total = len(self.recent)
        return {key: count / total for key, count in self.current.items()} if total else {}


class Drift:
    """Every (model key, question)'s drift; the reference of a question may come from a file of answers."""

    def __init__(self, window: int, reference: dict[str, Counter[str]] | None = None) -> None:
        self.window = window
        self.fixed = reference or {}
        self.questions: dict[tuple[str, str], QuestionDrift] = {}

    def add(self, model_key: str, question_id: str, slot: Slot) -> QuestionDrift:
        drift = self.questions.get((model_key, question_id))
        if drift is None:
            fixed = self.fixed.get(question_id)
            drift = self.questions[(model_key, question_id)] = QuestionDrift(
                self.window, Counter(fixed) if fixed else Counter(), reference_fixed=bool(fixed))
        drift.add(slot)
        return drift


def reference_bins(slots: Iterable[tuple[str, Slot]]) -> dict[str, Counter[str]]:
    """Reference bins by question id from (question id, answered slot) pairs (a reference file's answers)."""
    bins: dict[str, Counter[str]] = {}
    for question_id, slot in slots:
        bins.setdefault(question_id, Counter())[drift_bin(slot)] += 1
    return bins
