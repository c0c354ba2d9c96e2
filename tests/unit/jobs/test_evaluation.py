"""Live evaluation's parts without a broker (d3stream/jobs/evaluate/join_state.py, agreement.py, estimation.py,
drift.py): the join state on its own (both arrival orders, repeats on both sides, labels of unknown questions
or of the wrong type, the window, the byte budget, a restore from the changelog), the figures (one ``Tally``
for the live and the offline evaluation, whatever the order), the estimates and drift. The worker on the
broker: tests/integration/test_evaluate.py and tests/system/test_evaluate.py.
"""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.contract import Source, decode_answer
from d3stream_client.validation import decode_label

from d3stream.core.agreement import Slot, Tally, label_key, label_stats, parse_slot, score
from d3stream.jobs import compare
from d3stream.jobs.evaluate import load_drift
from d3stream.jobs.evaluate.drift import Drift, psi
from d3stream.jobs.evaluate.join_state import JoinState, LabelEntry, answer_entry, decode_waiting
from d3stream.settings import load_settings
from tests.support.evaluate_events import answer_event, label_event

pytestmark = pytest.mark.timeout(300)


def _source(topic: str, offset: int, timestamp: int) -> Source:
    return Source(topic=topic, partition=0, offset=offset, timestamp=timestamp)


def _answer(state: JoinState, event: dict[str, Any], at: int, role: str = "live") -> Any:
    entry = answer_entry(decode_answer(json.dumps(event).encode()), _source("answers", at, at), role)  # type: ignore[arg-type]
    assert entry is not None
    return state.take_answer(event["id"], entry)


def _label(state: JoinState, event: dict[str, Any], at: int) -> Any:
    label = decode_label(json.dumps(event).encode())
    return state.take_label(label.id, LabelEntry(dict(label.labels), _source("labels", at, at), label.source))


# ---------------------------------------------------------------------------------------- the join state


def test_each_question_joins_once_per_model_in_either_order_and_repeats_are_ignored() -> None:
    rng = random.Random(1)
    state = JoinState(window_ms=60_000, max_bytes=10**9)
    first, second = answer_event("t1", rng), answer_event("t2", rng)
    # t1: the label first, then the answer, then both again.
    assert _label(state, {"id": "t1", "labels": {"team": "billing", "refund": True}}, 1) == []
    joined = _answer(state, first, 2)
    assert [sorted(j.evaluation.questions) for j in joined] == [["refund", "team"]]
    assert _answer(state, first, 3) is None
    assert _label(state, {"id": "t1", "labels": {"team": "tech"}}, 4) == []  # a second label of team: ignored
    # A later label of the other question joins that question only; the shadow's answer joins both labels.
    later = _label(state, {"id": "t1", "labels": {"urgency": "high"}}, 5)
    assert [list(j.evaluation.questions) for j in later] == [["urgency"]]
    assert later[0].evaluation.questions["urgency"].label_option == "2"  # the level text names level 2
    shadow = _answer(state, answer_event("t1", rng, model="m2"), 6, role="shadow")
    assert sorted(q for j in shadow for q in j.evaluation.questions) == ["refund", "team", "urgency"]
    assert {j.evaluation.role for j in shadow} == {"shadow"}
    # t2: the answer first.
    assert _answer(state, second, 7) == []
    joined = _label(state, {"id": "t2", "labels": {"team": "sales", "nope": "x", "refund": 3}}, 8)
    assert [list(j.evaluation.questions) for j in joined] == [["team"]]
    outcomes = state.take_outcomes()
    assert (outcomes.duplicate_answers, outcomes.duplicate_labels) == (1, 1)
    assert outcomes.unknown_questions == {"live:m1": 1} and outcomes.unscorable == {"live:m1": 1}
    assert outcomes.answers == {"live:m1": 2, "shadow:m2": 1}


def test_the_window_expires_waiting_answers_and_labels_and_the_budget_evicts_the_oldest() -> None:
    rng = random.Random(2)
    state = JoinState(window_ms=1_000, max_bytes=10**9)
    _answer(state, answer_event("a", rng), 0)
    _label(state, label_event("b", rng), 10)
    _answer(state, answer_event("c", rng), 900)
    assert (state.answers_waiting, state.labels_waiting) == (2, 1)
    state.tick(1_500)
    assert state.expire() == 2  # a and b: first seen more than a second of stream time ago
    outcomes = state.take_outcomes()
    assert outcomes.expired_answers == {"live:m1": 1} and outcomes.unmatched_labels == 1
    assert len(state) == 1 and (state.answers_waiting, state.labels_waiting) == (1, 0)
    assert state.drain_changes()["a"] is None  # tombstones for the changelog
    # Over the byte budget, the oldest entries go first, counted as evicted, not as expired: each leaves a
    # marker for the rest of its window.
    for n in range(20):
        _answer(state, answer_event(f"e{n}", rng), 1_500 + n)
    state.drain_changes()
    state.max_bytes = state.bytes // 2
    dropped = state.expire()
    assert state.bytes <= state.max_bytes and dropped >= 10
    changes = state.drain_changes()
    assert {"c", "e0"} <= set(changes) and "e19" not in changes  # oldest first
    assert decode_waiting(changes["e0"]).evicted and decode_waiting(changes["e0"]).answers == []
    outcomes = state.take_outcomes()
    assert outcomes.evicted == dropped and outcomes.evicted_answers == {"live:m1": dropped}
    assert outcomes.expired_answers == {}
    assert state.answers_waiting == 21 - dropped  # c and e0-e19, less the evicted
    # A label for an evicted answer is counted as such when it comes, and does not wait.
    assert _label(state, label_event("e0", rng), 1_600) == []
    assert state.take_outcomes().after_eviction == {"label": 1} and state.labels_waiting == 0
    # The markers go at the end of their window, quietly.
    state.tick(1_500 + 1_000 + 20)
    state.expire()
    outcomes = state.take_outcomes()
    assert outcomes.expired_answers == {"live:m1": 20 - dropped + 1} and outcomes.evicted == 0
    assert len(state) == 0 and state.bytes == 0


def test_a_state_restored_from_its_changelog_joins_nothing_twice() -> None:
    rng = random.Random(3)
    state = JoinState(window_ms=60_000, max_bytes=10**9)
    event = answer_event("r", rng)
    _answer(state, event, 1)
    _label(state, {"id": "r", "labels": {"team": "tech"}}, 2)
    log = list(state.drain_changes().items())
    restored = JoinState(window_ms=60_000, max_bytes=10**9)
    restored.restore(iter(log))
    assert restored.bytes == state.bytes and len(restored) == 1
    assert _answer(restored, event, 3) is None
    assert _label(restored, {"id": "r", "labels": {"team": "billing"}}, 4) == []
    assert [list(j.evaluation.questions) for j in _label(restored, {"id": "r", "labels": {"refund": False}}, 5)] \
        == [["refund"]]


def test_a_score_label_that_is_a_string_names_a_level_by_its_text_even_a_digit() -> None:
    """On a "1".."5" scale the label "3" is the level whose text is "3" (key "2"), the label 3 is level 3; the
    evaluator and compare read labels through the same function, and training does too."""
    levels = ["1", "2", "3", "4", "5"]
    raw = {"type": "score", "score": 2.0, "probabilities": {str(i): 0.2 for i in range(5)}, "confidence": 0.2,
           "legend": {str(i): text for i, text in enumerate(levels)}}
    slot = parse_slot(raw)
    assert slot is not None
    assert label_key(slot, "3") == "2"
    assert label_key(slot, 3) == "3"
    assert label_key(slot, "6") is None  # a string that is no level's text names no level
    # An answer from before the legend was recorded: a digit string is the only reading left, an index.
    bare = parse_slot({key: value for key, value in raw.items() if key != "legend"})
    assert bare is not None and label_key(bare, "3") == "3"
    from d3stream.dev.train import _option_index
    from d3stream.runtime.questions import normalize_question

    question = normalize_question({"type": "score", "criteria": levels})
    assert _option_index(question, "3") == 2 and _option_index(question, 3) == 3


def test_compare_skips_label_topic_records_that_are_not_labels() -> None:
    """A label topic may hold what the evaluator dead-letters (no id, no labels, not an object): compare reads
    past it instead of stopping."""
    records = [{"id": "t1", "labels": {"team": "tech"}}, {"labels": {"team": "sales"}}, "text",
               {"id": "t2", "labels": {}}, {"id": "t3", "labels": {"refund": True}}]
    events = compare.label_events(records, "kafka:labels")
    assert [event["id"] for event in events] == ["t1", "t3"]
    assert compare.labels_of(events) == {("t1", "team"): "tech", ("t3", "refund"): True}


# --------------------------------------------------------------------------------------------- figures


def test_the_tally_gives_identical_figures_in_any_order() -> None:
    rng = random.Random(4)
    pairs = []
    for n in range(300):
        raw = answer_event(f"r{n}", rng)["answers"]
        for question, value in label_event(f"r{n}", rng)["labels"].items():
            slot = parse_slot(raw[question])
            assert slot is not None
            key = label_key(slot, value)
            assert key is not None
            pairs.append((slot, key))
    forward = label_stats(pairs)
    shuffled = list(pairs)
    random.Random(5).shuffle(shuffled)
    tally = Tally()
    for slot, key in shuffled:
        tally.add(score(slot, key))
    assert tally.stats() == forward  # exactly: every float the same
    assert forward.n == 900 and 0 < forward.accuracy < 1 and forward.log_loss > 0 and 0 <= forward.ece <= 1


def _choice_slots(probabilities: Any) -> list[Slot]:
    keys = [f"o{i}" for i in range(probabilities.shape[1])]
    return [Slot("choice", dict(zip(keys, map(float, row), strict=True)), keys[int(row.argmax())])
            for row in probabilities]


@pytest.mark.parametrize("calibrated", [True, False])
def test_the_estimates_equal_an_independent_computation_and_match_reality_only_while_calibrated(
        calibrated: bool) -> None:
    """CBPE on synthetic answers: the evaluator's window estimates equal a direct numpy computation of the
    estimators (mean p of the decision, mean 1 - sum p^2, mean entropy); with labels drawn from the answers'
    own probabilities the estimation error is near 0, with labels from sharper ones (an underconfident model) it
    is not, and it says which way."""
    import numpy as np

    from d3stream.jobs.evaluate.estimation import Estimates

    rng = np.random.default_rng(11)
    answers = rng.dirichlet([1.0, 1.0, 1.0], size=20_000)
    truth = answers if calibrated else answers**3 / (answers**3).sum(axis=1, keepdims=True)
    labels = [int(rng.choice(3, p=row)) for row in truth]
    slots = _choice_slots(answers)
    estimates = Estimates(window=len(slots))
    tally = Tally()
    for slot, label in zip(slots, labels, strict=True):
        estimates.add("live:m", "q", slot)
        tally.add(score(slot, f"o{label}"))
    window = estimates.questions[("live:m", "q")].estimate
    assert window is not None
    assert window.accuracy == pytest.approx(answers.max(axis=1).mean(), abs=1e-9)
    assert window.brier == pytest.approx((1.0 - (answers**2).sum(axis=1)).mean(), abs=1e-9)
    assert window.log_loss == pytest.approx((-(answers * np.log(answers)).sum(axis=1)).mean(), abs=1e-9)
    stats = tally.stats()
    assert stats.estimated_accuracy == pytest.approx(window.accuracy, abs=1e-9)
    assert stats.estimated_brier == pytest.approx(window.brier, abs=1e-9)
    realized_accuracy = np.mean([int(row.argmax()) == label for row, label in zip(answers, labels, strict=True)])
    assert stats.accuracy_error == pytest.approx(window.accuracy - realized_accuracy, abs=1e-9)
    if calibrated:  # 20,000 draws: the sampling error is under 0.01 (about three standard errors)
        assert abs(stats.accuracy_error) < 0.01 and abs(stats.brier_error) < 0.01
    else:  # the truth is sharper than the answers: they expected less accuracy and more Brier than came
        assert stats.accuracy_error < -0.05 and stats.brier_error > 0.05


def test_a_reference_file_fixes_the_drift_reference(tmp_path: Path) -> None:
    rng = random.Random(9)
    reference = tmp_path / "reference.jsonl"
    reference.write_text("".join(json.dumps(answer_event(f"r{n}", rng)) + "\n" for n in range(200)), encoding="utf-8")
    drift = load_drift(load_settings({"evaluate_drift_reference": str(reference), "evaluate_drift_window": "50"},
                                     environ={}))
    first = parse_slot({"type": "choice", "choice": "sales", "probabilities": {"billing": 0, "tech": 0, "sales": 1}})
    assert first is not None
    tracked = drift.add("live:m9", "team", first)
    assert tracked.reference_fixed and sum(tracked.reference.values()) == 200
    assert tracked.psi is not None and tracked.psi > 1  # one answer, all on one option: far from the reference


def test_drift_is_near_zero_on_the_same_distribution_and_large_on_a_shifted_one() -> None:
    rng = random.Random(6)
    drift = Drift(window=500)
    for n in range(1_000):
        slot = parse_slot(answer_event(f"s{n}", rng)["answers"]["team"])
        assert slot is not None
        steady = drift.add("live:m1", "team", slot)
    assert steady.psi is not None and steady.psi < 0.1
    for n in range(500):
        slot = parse_slot(answer_event(f"x{n}", rng)["answers"]["team"])
        assert slot is not None
        shifted = drift.add("live:m1", "team", parse_slot({**answer_event("x", rng)["answers"]["team"],
                                                           "choice": "sales", "probabilities": {
                                                               "billing": 0.1, "tech": 0.1, "sales": 0.8}}))  # type: ignore[arg-type]
    assert shifted.psi is not None and shifted.psi > 0.25
    assert shifted.shares() == {"sales": 1.0}
    assert psi(collections.Counter(), collections.Counter(a=1)) is None


def test_the_report_keeps_its_columns_apart_whatever_the_length_of_a_model_name_or_question() -> None:
    """``evaluate --report``: a model name longer than the default column (24) does not run into the question."""
    from d3stream.jobs.evaluate import ModelFigures, render

    long_model, long_question = "d3-demo-trained-qwen3_5-tiny-seed0-0123abcd", "which-team-should-handle-it"
    stats = Tally().stats()
    rows = render([ModelFigures(long_model, "live", 0, stats, {long_question: stats}),
                   ModelFigures("short", "shadow", 0, stats, {"q": stats})]).splitlines()
    header, *table = rows[:-1]
    start = header.index("question")
    assert header[:start].rstrip().endswith("model")
    for row in table:
        assert row[start - 1] == " " and row[start] != " ", row  # each question starts in the question column
    assert [row[start:].split()[0] for row in table] == ["(all)", long_question, "(all)", "q"]
