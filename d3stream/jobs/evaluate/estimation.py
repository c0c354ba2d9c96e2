"""Quality before the labels come: a model's expected accuracy, Brier score and log loss, from its own
probabilities.

Labels take days; every answer already carries a probability for each option. If those probabilities are
calibrated (the true option is drawn from them), each answer's expected score against its future label is
known now. This is NannyML's confidence-based performance estimation (CBPE), for one answered question with
probabilities ``p`` over its options and decision ``d``:

    expected accuracy     E[1{y = d}]                = p_d
    expected Brier score  E[sum_i (p_i - 1{y = i})^2] = sum_i p_i (1 - p_i)  = 1 - sum_i p_i^2
    expected log loss     E[-ln p_y]                  = -sum_i p_i ln p_i      (the entropy)

and over a window of answers, their means (the estimate of the window's accuracy, Brier score, log loss).
The estimates are taken over every answer of the drift window (``evaluate_drift_window`` per model and
question), labelled or not. Once labels come, the same expectations summed over the labelled answers sit
next to the realized sums (``Scored.confidence``, ``Scored.expected_brier``), so the estimation error over
any range is (expected - realized) / pairs: near zero while the model is calibrated; when it grows the
model's probabilities no longer mean what they say, and the estimate can no longer be trusted before the
labels come (alert ``D3streamEstimateOff``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from d3stream.core.agreement import Slot, expected_brier


@dataclass(frozen=True)
class Expected:
    """One answer's expected accuracy, Brier score and log loss against a label drawn from its probabilities."""

    accuracy: float
    brier: float
    log_loss: float


def expected(slot: Slot) -> Expected:
    """The CBPE expectations of one answered question (the module's docstring writes them down)."""
    log = math.log
    return Expected(
        accuracy=slot.decision_probability,
        brier=expected_brier(slot),
        log_loss=-sum([p * log(p) for p in slot.probabilities.values() if p > 0.0]),
    )


@dataclass
class EstimateWindow:
    """The last ``window`` answers' expectations of one model and question, and their means."""

    window: int
    recent: deque[Expected] = field(default_factory=deque)
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def add(self, answer: Expected) -> None:
        self.recent.append(answer)
        self._shift(answer, 1.0)
        if len(self.recent) > self.window:
            self._shift(self.recent.popleft(), -1.0)

    def _shift(self, answer: Expected, sign: float) -> None:
        self.sums[0] += sign * answer.accuracy
        self.sums[1] += sign * answer.brier
        self.sums[2] += sign * answer.log_loss

    @property
    def estimate(self) -> Expected | None:
        """The window's estimated accuracy, Brier score and log loss (None while it is empty)."""
        n = len(self.recent)
        if not n:
            return None
        return Expected(self.sums[0] / n, self.sums[1] / n, self.sums[2] / n)


class Estimates:
    """Every (model key, question)'s estimate window."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.questions: dict[tuple[str, str], EstimateWindow] = {}

    def add(self, model_key: str, question_id: str, slot: Slot) -> EstimateWindow:
        estimate = self.questions.get((model_key, question_id))
        if estimate is None:
            estimate = self.questions[(model_key, question_id)] = EstimateWindow(self.window)
        estimate.add(expected(slot))
        return estimate
