"""Live evaluation (``d3stream evaluate``): labels joined with answers on the stream, exactly once, per model.

The join state on its own (both arrival orders, repeats on both sides, labels of unknown questions or of the
wrong type, the window, the byte budget, a restore from the changelog), the figures (one ``Tally`` for the
live and the offline evaluation, whatever the order), drift, and then the worker on the real broker:
answers of two models and a shadow with labels before and after them, repeats, labels that never come and
malformed ones, read back and compared with ``d3stream compare --labels``; two workers with one SIGKILLed
and restarted mid-stream; and topics whose partition counts do not match.

The answers here are answer events as the worker publishes them (the contract's ``Answer``), written by the
test: the evaluator's input is the answer topic, and its tests need no model.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.contract import Source, decode_answer
from d3stream_client.publisher import Publisher, produce
from d3stream_client.validation import EventError, decode_label
from prometheus_client import generate_latest

from d3stream.cli import main as cli_main
from d3stream.core.agreement import Slot, Tally, label_key, label_stats, parse_slot, score
from d3stream.core.drift import Drift, psi
from d3stream.core.evaluation import JoinState, LabelEntry, answer_entry, decode_waiting
from d3stream.jobs import compare
from d3stream.jobs.evaluate import figures, figures_json, load_drift, read_figures, run_worker
from d3stream.kafka.evaluating import EvaluateSetupError, EvaluateTopics, prepare_topics
from d3stream.ops.quality import QualityMetrics
from d3stream.settings import load_settings

pytestmark = pytest.mark.timeout(300)

TEAMS = ("billing", "tech", "sales")
LEVELS = ("low", "medium", "high")


def _normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def answer_event(request_id: str, rng: random.Random, model: str = "m1", offset: int = 0) -> dict[str, Any]:
    """An answer event as the worker publishes it: a choice, a noul and a score with drawn probabilities."""
    team = dict(zip(TEAMS, _normalised([rng.random() + 0.05 for _ in TEAMS]), strict=True))
    levels = _normalised([rng.random() + 0.05 for _ in LEVELS])
    refund = rng.random()
    return {
        "id": request_id, "answer_id": f"{request_id}-{model}", "model": model,
        "source": {"topic": "d3.requests", "partition": 0, "offset": offset},
        "answers": {
            "team": {"type": "choice", "choice": max(team, key=team.__getitem__), "probabilities": team,
                     "confidence": max(team.values())},
            "refund": {"type": "noul", "noul": refund, "probabilities": {"false": 1 - refund, "true": refund}},
            "urgency": {"type": "score", "score": sum(i * p for i, p in enumerate(levels)),
                        "probabilities": {str(i): p for i, p in enumerate(levels)}, "confidence": max(levels),
                        "legend": {str(i): text for i, text in enumerate(LEVELS)}},
        },
    }


def label_event(request_id: str, rng: random.Random, questions: tuple[str, ...] = ("team", "refund", "urgency")
                ) -> dict[str, Any]:
    """A label event; urgency named by its level index or its level text."""
    values: dict[str, Any] = {"team": rng.choice(TEAMS), "refund": rng.random() < 0.5,
                              "urgency": rng.choice([0, 1, 2, *LEVELS])}
    return {"id": request_id, "labels": {q: values[q] for q in questions}, "source": "agent"}


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

    from d3stream.core.estimation import Estimates

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


# ------------------------------------------------------------------------------------ on the broker


def _settings(broker: Any, topic_names: Any, **overrides: Any) -> Any:
    """A test's own topics, group and state directory (its files outlive the test's workers, as a volume does)."""
    return load_settings({
        "evaluate_state_dir": tempfile.mkdtemp(prefix="d3-evaluate-state-"),
        "bootstrap_servers": broker.bootstrap_servers,
        "answer_topic": topic_names("answers"), "label_topic": topic_names("labels"),
        "evaluation_topic": topic_names("evaluations"), "label_dead_letter_topic": topic_names("label-dlq"),
        "evaluate_state_topic": topic_names("state"), "evaluate_group_id": topic_names("group"),
        "transactional_id_prefix": topic_names("txn"), "topic_partitions": 3, "metrics_port": None,
        **{k: str(v) for k, v in overrides.items()},
    }, environ={})


def _keyed(events: list[dict[str, Any]]) -> list[tuple[bytes | None, bytes]]:
    return [(e["id"].encode(), json.dumps(e).encode()) for e in events]


async def _read(servers: str, topic: str) -> list[dict[str, Any]]:
    records = await compare.read_topic(servers, compare.TopicRange(topic), timeout_s=60)
    return [r for r in records if isinstance(r, dict)]


async def _until(servers: str, topic: str, count: int, timeout_s: float = 90.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await _read(servers, topic)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


def test_answers_and_labels_in_both_orders_with_repeats_and_gaps_join_once_and_equal_compare(
        kafka_broker: Any, topic_names: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = _settings(kafka_broker, topic_names)
    servers = settings.connection.bootstrap_servers
    shadow_topic = f"{settings.delivery.answer_topic}.shadow"
    rng = random.Random(7)
    ids = [f"ticket-{n:03d}" for n in range(60)]
    live = [answer_event(i, rng, "m1") for i in ids[:50]]
    shadow = [answer_event(i, rng, "m2") for i in ids[:50:2]]
    labels = [label_event(i, rng) for i in ids[10:60]]  # ids 0-9: never labelled; 50-59: never answered
    early, late = labels[:20], labels[20:]
    hostile: list[tuple[bytes | None, bytes]] = [
        (b"bad-1", b"not json"), (b"bad-2", json.dumps({"id": "bad-2", "labels": {"team": 1.5}}).encode()),
        (None, json.dumps({"id": "ticket-010", "labels": {"team": "tech"}}).encode()),  # no key: maybe misplaced
        (b"no-id", json.dumps({"labels": {"team": "tech"}}).encode()),  # not a label: no id
    ]
    metrics = QualityMetrics()

    async def scenario() -> Any:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, shadow_topic))
        await produce(servers, shadow_topic, _keyed(shadow[:5]))
        async with Publisher(servers, settings.evaluation.label_topic) as publisher:  # the client's checked labels
            for label in early:
                await publisher.publish_label(label)
            with pytest.raises(EventError, match="invalid_label|does not match"):
                await publisher.publish_label({"id": "x", "labels": {}})
        await produce(servers, settings.evaluation.label_topic, hostile)
        stopping = asyncio.Event()
        worker = asyncio.ensure_future(run_worker(settings, stopping, metrics=metrics))
        await produce(servers, settings.delivery.answer_topic, _keyed(live + live[:7]))  # seven at-least-once repeats
        await produce(servers, shadow_topic, _keyed(shadow[5:]))
        await produce(servers, settings.evaluation.label_topic, _keyed(late + early[:4]))  # four repeated label events
        # live: ids 10-49 labelled (40); shadow: even ids 10-48 (20).
        await _until(servers, settings.evaluation.evaluation_topic, 60)
        await asyncio.sleep(1.0)  # nothing more may come
        stopping.set()
        evaluator = await worker
        return evaluator, await _read(servers, settings.evaluation.evaluation_topic), \
            await _read(servers, settings.evaluation.label_dead_letter_topic)

    evaluator, evaluations, dead = asyncio.run(scenario())
    pairs = collections.Counter((e["id"], e["role"], e["model"]) for e in evaluations)
    assert max(pairs.values()) == 1, "a pair was evaluated twice"
    assert {k for k in pairs if k[1] == "live"} == {(i, "live", "m1") for i in ids[10:50]}
    assert {k for k in pairs if k[1] == "shadow"} == {(i, "shadow", "m2") for i in ids[10:50:2]}
    assert all(set(e["questions"]) == {"team", "refund", "urgency"} for e in evaluations)
    assert any(e["lag_ms"] < 0 for e in evaluations) and any(e["lag_ms"] > 0 for e in evaluations)
    # No label here names its labeled_at: each gets its record's timestamp, as the schema says.
    assert all(e["labeled_at"] == e["label"]["timestamp"] > 0 for e in evaluations)
    reasons = [d["reason"] for d in dead]
    assert sum(r.startswith("invalid_label") for r in reasons) == 3
    assert all(r.startswith(("invalid_label", "misplaced_label")) for r in reasons)
    exposition = generate_latest(metrics.registry).decode()
    assert 'd3stream_eval_pairs_total{model="m1",question="team",role="live",type="choice"} 40.0' in exposition
    assert 'd3stream_eval_duplicates_total{kind="answer"} 7.0' in exposition
    # The estimates before labels (every answer of the window) and, beside the realized sums, the labelled
    # pairs' expectations.
    assert 'd3stream_eval_estimated_accuracy{model="m1",question="team",role="live"}' in exposition
    assert 'd3stream_eval_estimated_brier{model="m2",question="urgency",role="shadow"}' in exposition
    assert 'd3stream_eval_expected_correct_total{model="m1",question="team",role="live",type="choice"}' in exposition
    # ids 0-9 wait for labels that never come: ten live answers and five shadow ones.
    assert 'd3stream_eval_waiting{kind="answers"} 15.0' in exposition
    assert 'd3stream_eval_waiting{kind="labels"} 10.0' in exposition  # ids 50-59 wait for answers

    # The same figures offline: compare --labels over the same answers and labels.
    (tmp_path / "live.jsonl").write_text("".join(json.dumps(a) + "\n" for a in live), encoding="utf-8")
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps(label) + "\n" for label in labels), encoding="utf-8")
    answers = compare.load_answers(tmp_path / "live.jsonl")
    offline = compare.compare(answers, answers, compare.load_labels(tmp_path / "labels.jsonl")).labels
    live_figures = next(m for m in figures(evaluations) if m.role == "live")
    assert offline is not None and live_figures.overall == offline.a
    assert read_figures(settings) == figures(evaluations)
    assert figures_json(figures(evaluations))["models"][0]["n"] == 120
    # What an operator types: the report, and compare --labels on the topics themselves.
    capsys.readouterr()
    connection = ["--bootstrap-servers", servers]
    assert cli_main(["evaluate", "--report", "--json", "--evaluation-topic", settings.evaluation.evaluation_topic,
                     *connection]) == 0
    reported = json.loads(capsys.readouterr().out)["models"]
    assert [(m["role"], m["model"], m["n"]) for m in reported] == [("live", "m1", 120), ("shadow", "m2", 60)]
    # (The label file, not the topic: the topic also holds the keyless label the evaluator dead-letters.)
    assert cli_main(["compare", f"kafka:{settings.delivery.answer_topic}", f"kafka:{settings.delivery.answer_topic}", "--labels",
                     str(tmp_path / "labels.jsonl"), "--json", "--out", str(tmp_path / "report"), *connection]) == 0
    headline = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [headline[k] for k in ("accuracy_a", "brier_a", "ece_a", "log_loss_a")] == \
        [reported[0][k] for k in ("accuracy", "brier", "ece", "log_loss")]
    # The label topic itself, with what the evaluator dead-lettered (a record that is not JSON, one without
    # an id, one whose label is no label value): read past, not a stop. (Its figures may differ from the file's by the keyless
    # label, which partition order can make the first of its question.)
    assert cli_main(["compare", f"kafka:{settings.delivery.answer_topic}", f"kafka:{settings.delivery.answer_topic}", "--labels",
                     f"kafka:{settings.evaluation.label_topic}", "--json", "--out", str(tmp_path / "report-topic"),
                     *connection]) == 0
    from_topic = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 0 <= from_topic["accuracy_a"] <= 1


async def _logged(path: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(encoding="utf-8"):
        assert time.monotonic() < deadline, f"{path.name}: no {text!r} within {timeout_s:g} s"
        await asyncio.sleep(0.2)


def test_two_workers_one_killed_and_restarted_mid_stream_lose_and_double_nothing(
        kafka_broker: Any, topic_names: Any, tmp_path: Path) -> None:
    settings = _settings(kafka_broker, topic_names, session_timeout_ms=6000, topic_partitions=4)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(8)
    ids = [f"k-{n:04d}" for n in range(600)]
    answers = [answer_event(i, rng) for i in ids]
    labels = [label_event(i, rng) for i in ids]
    env = {**os.environ, "D3STREAM_BOOTSTRAP_SERVERS": servers, "D3STREAM_ANSWER_TOPIC": settings.delivery.answer_topic,
           "D3STREAM_LABEL_TOPIC": settings.evaluation.label_topic, "D3STREAM_EVALUATION_TOPIC": settings.evaluation.evaluation_topic,
           "D3STREAM_LABEL_DEAD_LETTER_TOPIC": settings.evaluation.label_dead_letter_topic,
           "D3STREAM_EVALUATE_STATE_TOPIC": settings.evaluation.evaluate_state_topic,
           "D3STREAM_EVALUATE_GROUP_ID": settings.evaluation.evaluate_group_id,
           "D3STREAM_EVALUATE_STATE_DIR": settings.evaluation.evaluate_state_dir,
           "D3STREAM_TRANSACTIONAL_ID_PREFIX": settings.delivery.transactional_id_prefix, "D3STREAM_TOPIC_PARTITIONS": "4",
           "D3STREAM_SESSION_TIMEOUT_MS": "6000", "D3STREAM_METRICS_PORT": "0", "D3STREAM_LOG_FORMAT": "json"}

    def start(name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        return subprocess.Popen([sys.executable, "-m", "d3stream", "evaluate"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    async def scenario() -> list[dict[str, Any]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        first, second = start("w1"), start("w2")
        try:
            for name in ("w1", "w2"):  # both in the group, each with partitions of its own
                await _logged(tmp_path / f"{name}.log", "evaluating partition")
            # Both workers evaluating (labels trail their answers, so each partition has answers waiting) ...
            await produce(servers, settings.delivery.answer_topic, _keyed(answers[:200]))
            await produce(servers, settings.evaluation.label_topic, _keyed(labels[:150]))
            await _until(servers, settings.evaluation.evaluation_topic, 150)
            # ... then one is killed with records in flight; the other takes its partitions over.
            await produce(servers, settings.delivery.answer_topic, _keyed(answers[200:400]))
            await produce(servers, settings.evaluation.label_topic, _keyed(labels[150:300]))
            first.send_signal(signal.SIGKILL)
            first.wait()
            await produce(servers, settings.delivery.answer_topic, _keyed(answers[400:]))
            await produce(servers, settings.evaluation.label_topic, _keyed(labels[300:450]))
            first = start("w1")  # and comes back: a second rebalance
            await asyncio.sleep(2.0)
            await produce(servers, settings.evaluation.label_topic, _keyed(labels[450:] + labels[:30]))  # some again
            found = await _until(servers, settings.evaluation.evaluation_topic, 600, timeout_s=120)
            await asyncio.sleep(1.0)
            return await _read(servers, settings.evaluation.evaluation_topic) if len(found) >= 600 else found
        finally:
            for process in (first, second):
                process.send_signal(signal.SIGTERM)
            for process in (first, second):
                process.wait(timeout=60)

    evaluations = asyncio.run(scenario())
    counts = collections.Counter(e["id"] for e in evaluations)
    assert sorted(counts) == ids, f"missing: {sorted(set(ids) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"doubled: {[i for i, c in counts.items() if c > 1][:10]}"
    logs = [(tmp_path / f"{name}.log").read_text(encoding="utf-8") for name in ("w1", "w2")]
    assert all("evaluating partition" in text for text in logs), "both workers took partitions"
    adopted = [json.loads(line) for text in logs for line in text.splitlines() if '"evaluating partition"' in line]
    # The killed worker's files were not closed: the other restored its partitions from the changelog. Files
    # closed at a rebalance were brought up to date from the changelog's tail.
    assert any(a["mode"] == "restore" and a["records"] > 0 and a["waiting"] > 0 for a in adopted), adopted
    assert any(a["mode"] == "tail" and a["waiting"] > 0 for a in adopted), adopted


async def _evaluate_until(settings: Any, servers: str, count: int, metrics: Any = None) -> Any:
    """One evaluate worker in this process until ``count`` evaluations are on the topic; it stops cleanly."""
    stopping = asyncio.Event()
    worker = asyncio.ensure_future(run_worker(settings, stopping, metrics=metrics))
    found = await _until(servers, settings.evaluation.evaluation_topic, count)
    await asyncio.sleep(0.5)  # nothing more may come
    stopping.set()
    evaluator = await worker
    assert len(found) >= count, f"{len(found)} of {count} evaluations"
    return evaluator


def test_a_clean_restart_reads_only_the_changelog_tail_and_a_new_machine_restores_it_all(
        kafka_broker: Any, topic_names: Any) -> None:
    """The state lives on local disk: a worker stopped cleanly reads none of the changelog again when it starts,
    however much waits; on a machine without the files (or after a crash) the changelog restores it all. Either
    way every answer is joined with its label once."""
    settings = _settings(kafka_broker, topic_names)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(9)
    ids = [f"w-{n:03d}" for n in range(90)]
    answers, labels = [answer_event(i, rng) for i in ids], [label_event(i, rng) for i in ids]

    async def scenario() -> tuple[list[Any], list[Any], list[Any], list[dict[str, Any]]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        await produce(servers, settings.delivery.answer_topic, _keyed(answers))
        await produce(servers, settings.evaluation.label_topic, _keyed(labels[:10]))
        first = await _evaluate_until(settings, servers, 10)  # 80 answers left waiting
        await produce(servers, settings.evaluation.label_topic, _keyed(labels[10:40]))
        second = await _evaluate_until(settings, servers, 40)  # the same files: a clean restart
        for state_file in Path(settings.evaluation.evaluate_state_dir).rglob("*"):  # a new machine
            if state_file.is_file():
                state_file.unlink()
        await produce(servers, settings.evaluation.label_topic, _keyed(labels[40:]))
        third = await _evaluate_until(settings, servers, 90)
        return first.restores, second.restores, third.restores, await _read(servers, settings.evaluation.evaluation_topic)

    first, second, third, evaluations = asyncio.run(scenario())
    assert {r["mode"] for r in first} == {"restore"} and sum(r["records"] for r in first) == 0  # nothing yet
    # The tail: at most the last batch's changes again (the changelog's end is read as its last commit lands).
    assert {r["mode"] for r in second} == {"tail"} and sum(r["records"] for r in second) < 30
    assert sum(r["answers_waiting"] for r in second) == 80 and sum(r["waiting"] for r in second) == 90
    assert {r["mode"] for r in third} == {"restore"} and sum(r["answers_waiting"] for r in third) == 50
    assert sum(r["records"] for r in third) >= 90
    assert sorted(collections.Counter(e["id"] for e in evaluations).items()) == [(i, 1) for i in ids]


def test_over_the_disk_budget_the_oldest_answers_are_evicted_counted_and_their_labels_counted_on_arrival(
        kafka_broker: Any, topic_names: Any) -> None:
    settings = _settings(kafka_broker, topic_names, topic_partitions=1, evaluate_max_state_bytes=24_000)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(10)
    ids = [f"e-{n:03d}" for n in range(120)]
    metrics = QualityMetrics()

    def taken_in() -> float:
        return sum(sample.value for family in metrics.answers.collect() for sample in family.samples
                   if sample.name.endswith("_total"))

    async def scenario() -> list[dict[str, Any]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        stopping = asyncio.Event()
        worker = asyncio.ensure_future(run_worker(settings, stopping, metrics=metrics))
        await produce(servers, settings.delivery.answer_topic, _keyed([answer_event(i, rng) for i in ids]))
        deadline = time.monotonic() + 60
        while taken_in() < len(ids):
            assert time.monotonic() < deadline and not worker.done(), f"{taken_in()} answers taken in"
            await asyncio.sleep(0.1)
        # The newest answer's label: joined; the oldest one's: its answer was evicted on the way.
        await produce(servers, settings.evaluation.label_topic, _keyed([label_event(ids[-1], rng), label_event(ids[0], rng)]))
        await _until(servers, settings.evaluation.evaluation_topic, 1)
        await asyncio.sleep(0.5)
        stopping.set()
        await worker
        return await _read(servers, settings.evaluation.evaluation_topic)

    evaluations = asyncio.run(scenario())
    assert [e["id"] for e in evaluations] == [ids[-1]]
    exposition = generate_latest(metrics.registry).decode()
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in exposition.splitlines()
              if line.startswith("d3stream_eval_") and " " in line}
    evicted = series['d3stream_eval_evicted_answers_total{model="m1",role="live"}']
    assert evicted >= 60 and series["d3stream_eval_evicted_total"] == evicted
    assert series.get('d3stream_eval_expired_answers_total{model="m1",role="live"}', 0.0) == 0.0
    assert series['d3stream_eval_after_eviction_total{kind="label"}'] == 1.0
    assert series['d3stream_eval_waiting{kind="labels"}'] == 0.0  # the late label does not wait a week
    assert series["d3stream_eval_state_bytes"] <= 24_000
    assert series["d3stream_eval_window_seconds"] == settings.evaluation.evaluate_window_s
    assert 0 < series["d3stream_eval_state_coverage_seconds"] < settings.evaluation.evaluate_window_s


def test_a_label_topic_with_another_partition_count_is_refused_naming_the_fix(
        kafka_broker: Any, topic_names: Any) -> None:
    settings = _settings(kafka_broker, topic_names)

    async def scenario() -> str:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=settings.connection.bootstrap_servers)
        await admin.start()
        await admin.create_topics([NewTopic(settings.delivery.answer_topic, 3, 1), NewTopic(settings.evaluation.label_topic, 2, 1)])
        await admin.close()
        with pytest.raises(EvaluateSetupError) as refused:
            await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        return str(refused.value)

    message = asyncio.run(scenario())
    assert f"'{settings.evaluation.label_topic}' has 2 partitions" in message and "--alter --partitions 3" in message
