"""Prometheus series of ``d3stream evaluate``: answer quality per served model, as counts and sums.

Every figure is a ratio of counters, so it can be taken over any rolling window in PromQL and summed over
evaluate workers (each holds some partitions). Per model (``model``: the answer's model; ``role``: live or
shadow) and question (``question``, ``type``):

    accuracy  = increase(d3stream_eval_correct_total[1h]) / increase(d3stream_eval_pairs_total[1h])
    Brier     = increase(d3stream_eval_brier_total[1h])   / increase(d3stream_eval_pairs_total[1h])
    log loss  = increase(d3stream_eval_log_loss_total[1h]) / increase(d3stream_eval_pairs_total[1h])
    ECE       = sum by (model, role) (abs(increase(d3stream_eval_calibration_correct_total[1h])
                  - increase(d3stream_eval_calibration_confidence_total[1h])))
                / sum by (model, role) (increase(d3stream_eval_pairs_total[1h]))

(ECE's bins are the ``bin`` label, the tenths of the decided option's probability: the same ten bins as
``d3stream compare``.) Estimates need no labels (``jobs/evaluate/estimation.py``, CBPE): the gauges
``d3stream_eval_estimated_accuracy``, ``_estimated_brier`` and ``_estimated_log_loss`` are the means the
answers of the drift window expect of themselves. Beside the realized sums, the labelled pairs' expectations:

    estimation error (accuracy) = (increase(d3stream_eval_expected_correct_total[6h])
                                   - increase(d3stream_eval_correct_total[6h])) / increase(d3stream_eval_pairs_total[6h])
    estimation error (Brier)    = (increase(d3stream_eval_expected_brier_total[6h])
                                   - increase(d3stream_eval_brier_total[6h])) / increase(d3stream_eval_pairs_total[6h])

Drift needs no labels either: the PSI of each model's answer window against its reference,
and the window's answer shares and means, are gauges. ``deploy/prometheus/d3stream-rules.yaml`` records
these figures and alerts on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "d3stream_eval"
_MODEL = ["model", "role"]
_QUESTION = [*_MODEL, "question", "type"]
# Label lag: from the answer record to the label record, seconds (minutes to days).
LAG_BUCKETS = (1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86_400, 3 * 86_400, 7 * 86_400)
# Options of a question whose answer share is exported; the rest are summed as "other".
MAX_SHARE_OPTIONS = 20


def _split(model_key: str) -> tuple[str, str]:
    role, _, model = model_key.partition(":")
    return model, role


class ScoredQuestion(Protocol):
    """A labelled question's terms (core/agreement.py's Scored; ops sits below core and reads it by shape)."""

    @property
    def type(self) -> str: ...
    @property
    def correct(self) -> bool: ...
    @property
    def brier(self) -> float: ...
    @property
    def log_loss(self) -> float: ...
    @property
    def confidence(self) -> float: ...
    @property
    def expected_brier(self) -> float | None: ...


class QualityMetrics:
    """The evaluator's series on a registry of their own, with readiness for ``/readyz``."""

    def __init__(self, *, registry: CollectorRegistry | None = None, ready: Callable[[], bool] | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._ready = ready or (lambda: False)
        self.answers = Counter(f"{PREFIX}_answers", "Answers read that can be evaluated (error answers are not).",
                               _MODEL, registry=r)
        self.error_answers = Counter(f"{PREFIX}_error_answers", "Error answers read (nothing to evaluate).",
                                     ["role"], registry=r)
        self.labels = Counter(f"{PREFIX}_labels", "Label events read (valid ones).", registry=r)
        self.invalid_labels = Counter(f"{PREFIX}_invalid_labels", "Label records sent to the label dead-letter topic, "
                                      "by reason (invalid: not a label; misplaced: on another partition than its id's).",
                                      ["reason"], registry=r)
        self.duplicates = Counter(f"{PREFIX}_duplicates", "Answers of a model a request already had, and labels of a "
                                  "question already labelled: ignored (each pair is joined once).", ["kind"], registry=r)
        self.pairs = Counter(f"{PREFIX}_pairs", "Labelled questions joined with an answer.", _QUESTION, registry=r)
        self.correct = Counter(f"{PREFIX}_correct", "Joined questions whose decision is the labelled option.",
                               _QUESTION, registry=r)
        self.brier = Counter(f"{PREFIX}_brier", "Sum of the Brier terms (sum over options of (p - onehot)^2).",
                             _QUESTION, registry=r)
        self.log_loss = Counter(f"{PREFIX}_log_loss", "Sum of -ln p(label) (p clipped at 1e-15).", _QUESTION, registry=r)
        self.calibration_pairs = Counter(f"{PREFIX}_calibration_pairs", "Joined questions by the tenth (bin) of the "
                                         "decided option's probability.", [*_QUESTION, "bin"], registry=r)
        self.calibration_correct = Counter(f"{PREFIX}_calibration_correct", "Correct joined questions by bin.",
                                           [*_QUESTION, "bin"], registry=r)
        self.calibration_confidence = Counter(f"{PREFIX}_calibration_confidence", "Sum of the decided option's "
                                              "probability by bin.", [*_QUESTION, "bin"], registry=r)
        self.expected_correct = Counter(f"{PREFIX}_expected_correct", "Sum over joined questions of the decided "
                                        "option's probability: the correct count the answers expected (CBPE).",
                                        _QUESTION, registry=r)
        self.expected_brier = Counter(f"{PREFIX}_expected_brier", "Sum over joined questions of 1 - sum p^2: the "
                                      "Brier sum the answers expected (CBPE).", _QUESTION, registry=r)
        self.estimated_accuracy = Gauge(f"{PREFIX}_estimated_accuracy", "Mean probability of the decided option "
                                        "over the drift window's answers: the accuracy expected before labels.",
                                        [*_MODEL, "question"], registry=r)
        self.estimated_brier = Gauge(f"{PREFIX}_estimated_brier", "Mean of 1 - sum p^2 over the drift window's "
                                     "answers: the Brier score expected before labels.", [*_MODEL, "question"],
                                     registry=r)
        self.estimated_log_loss = Gauge(f"{PREFIX}_estimated_log_loss", "Mean entropy of the drift window's answers: "
                                        "the log loss expected before labels.", [*_MODEL, "question"], registry=r)
        self.label_lag = Histogram(f"{PREFIX}_label_lag_seconds", "From an answer record to its label record (0 when "
                                   "the label came first).", ["role"], buckets=LAG_BUCKETS, registry=r)
        self.unknown_questions = Counter(f"{PREFIX}_unknown_questions", "Labels of a question the model's answer does "
                                         "not have.", _MODEL, registry=r)
        self.unscorable = Counter(f"{PREFIX}_unscorable_labels", "Labels that name none of the question's options (a "
                                  "label of another type, an unknown option).", _MODEL, registry=r)
        self.expired = Counter(f"{PREFIX}_expired_answers", "Answers that waited evaluate_window_s without a label.",
                               _MODEL, registry=r)
        self.unmatched = Counter(f"{PREFIX}_unmatched_labels", "Label events that waited evaluate_window_s without "
                                 "an answer.", registry=r)
        self.evicted = Counter(f"{PREFIX}_evicted", "Waiting entries dropped before their window: the state was over "
                               "evaluate_max_state_bytes.", registry=r)
        self.evicted_answers = Counter(f"{PREFIX}_evicted_answers", "Answers dropped unlabelled before their window "
                                       "(evicted over evaluate_max_state_bytes, not expired).", _MODEL, registry=r)
        self.evicted_labels = Counter(f"{PREFIX}_evicted_labels", "Label events dropped unanswered before their "
                                      "window (evicted over evaluate_max_state_bytes).", registry=r)
        self.after_eviction = Counter(f"{PREFIX}_after_eviction", "Answers and labels of a request whose waiting "
                                      "state was evicted: counted on arrival, not kept.", ["kind"], registry=r)
        self.coverage = Gauge(f"{PREFIX}_state_coverage_seconds", "Stream time the waiting state reaches back (the "
                              "least of this worker's partitions): below evaluate_window_s while entries are "
                              "evicted, answers are dropped before their labels can come.", registry=r)
        self.window = Gauge(f"{PREFIX}_window_seconds", "evaluate_window_s: how long an answer may wait for its label.",
                            registry=r)
        self.waiting = Gauge(f"{PREFIX}_waiting", "Answers waiting for a label (kind answers) and label events waiting "
                             "for an answer (kind labels).", ["kind"], registry=r)
        self.state_bytes = Gauge(f"{PREFIX}_state_bytes", "Bytes of waiting state this worker holds.", registry=r)
        self.psi = Gauge(f"{PREFIX}_psi", "Population stability index of the model's last evaluate_drift_window "
                         "answers against its reference window.", [*_MODEL, "question"], registry=r)
        self.share = Gauge(f"{PREFIX}_answer_share", "Share of the drift window's answers deciding each option "
                           "(choice, score) or falling in each tenth of p(true) (noul).",
                           [*_MODEL, "question", "option"], registry=r)
        self.mean = Gauge(f"{PREFIX}_answer_mean", "Mean p(true) (noul) or mean level (score) over the drift window.",
                          [*_MODEL, "question"], registry=r)
        self.ready_gauge = Gauge(f"{PREFIX}_ready", "1 when the evaluator has joined its group and restored its state.",
                                 registry=r)
        self.ready_gauge.set_function(lambda: 1.0 if self.is_ready() else 0.0)

    def is_ready(self) -> bool:
        try:
            return bool(self._ready())
        except Exception:  # noqa: BLE001 - a broken check must not break the probe thread
            return False

    def set_ready_check(self, check: Callable[[], bool]) -> None:
        self._ready = check

    def count_pair(self, model_key: str, question: str, scored: ScoredQuestion, calibration_bin: int) -> None:
        """One joined question, in every series the figures are ratios of (``calibration_bin``: the tenth of
        its decided option's probability)."""
        model, role = _split(model_key)
        labels = {"model": model, "role": role, "question": question, "type": scored.type}
        self.pairs.labels(**labels).inc()
        # Incremented by 0 too: a ratio's numerator must exist wherever its denominator does.
        self.correct.labels(**labels).inc(1 if scored.correct else 0)
        self.brier.labels(**labels).inc(scored.brier)
        self.log_loss.labels(**labels).inc(scored.log_loss)
        b = str(calibration_bin)
        self.calibration_pairs.labels(**labels, bin=b).inc()
        self.calibration_correct.labels(**labels, bin=b).inc(1 if scored.correct else 0)
        self.calibration_confidence.labels(**labels, bin=b).inc(scored.confidence)
        self.expected_correct.labels(**labels).inc(scored.confidence)
        self.expected_brier.labels(**labels).inc(scored.expected_brier or 0.0)

    def set_estimate(self, model_key: str, question: str, accuracy: float, brier: float, log_loss: float) -> None:
        """What the drift window's answers of a model to a question expect of themselves (CBPE)."""
        model, role = _split(model_key)
        self.estimated_accuracy.labels(model, role, question).set(accuracy)
        self.estimated_brier.labels(model, role, question).set(brier)
        self.estimated_log_loss.labels(model, role, question).set(log_loss)

    def count_by_model(self, series: Counter, counts: Mapping[str, int]) -> None:
        """Add ``counts`` (by model key, ``role:model``) to one of the per-model counters."""
        for key, count in counts.items():
            if count:
                series.labels(*_split(key)).inc(count)

    def set_drift(self, model_key: str, question: str, psi: float | None, mean: float | None,
                  shares: Mapping[str, float]) -> None:
        """The drift window of one model and question: its PSI (once there is a reference), mean and shares."""
        model, role = _split(model_key)
        if psi is not None:
            self.psi.labels(model, role, question).set(psi)
        if mean is not None:
            self.mean.labels(model, role, question).set(mean)
        ranked = sorted(shares.items(), key=lambda item: -item[1])
        for option, share in ranked[:MAX_SHARE_OPTIONS]:
            self.share.labels(model, role, question, option).set(share)
        if len(ranked) > MAX_SHARE_OPTIONS:
            self.share.labels(model, role, question, "other").set(sum(share for _, share in ranked[MAX_SHARE_OPTIONS:]))
