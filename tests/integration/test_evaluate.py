"""Live evaluation (``d3stream evaluate``) on the real broker, in process: answers of two models and a shadow with
labels before and after them, repeats, labels that never come and malformed ones, read back and compared with
``d3stream compare --labels``; a clean restart reads only the changelog's tail and a new machine restores it
all; over the disk budget the oldest answers are evicted and counted.

The answers here are answer events as the worker publishes them (the contract's ``Answer``), written by the
test: the evaluator's input is the answer topic, and its tests need no model.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.publisher import Publisher, produce
from d3stream_client.validation import EventError
from prometheus_client import generate_latest

from d3stream.cli import main as cli_main
from d3stream.jobs import compare
from d3stream.jobs.evaluate import (
    EvaluateTopics,
    figures,
    figures_json,
    prepare_topics,
    read_figures,
    run_worker,
)
from d3stream.ops.quality import QualityMetrics
from tests.support.evaluate_events import (
    answer_event,
    evaluate_settings,
    events_until,
    keyed,
    label_event,
    read_events,
)

pytestmark = pytest.mark.timeout(300)


def test_answers_and_labels_in_both_orders_with_repeats_and_gaps_join_once_and_equal_compare(
        kafka_broker: Any, topic_names: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = evaluate_settings(kafka_broker, topic_names)
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
        await produce(servers, shadow_topic, keyed(shadow[:5]))
        async with Publisher(servers, settings.evaluation.label_topic) as publisher:  # the client's checked labels
            for label in early:
                await publisher.publish_label(label)
            with pytest.raises(EventError, match="invalid_label|does not match"):
                await publisher.publish_label({"id": "x", "labels": {}})
        await produce(servers, settings.evaluation.label_topic, hostile)
        stopping = asyncio.Event()
        worker = asyncio.ensure_future(run_worker(settings, stopping, metrics=metrics))
        await produce(servers, settings.delivery.answer_topic, keyed(live + live[:7]))  # seven at-least-once repeats
        await produce(servers, shadow_topic, keyed(shadow[5:]))
        await produce(servers, settings.evaluation.label_topic, keyed(late + early[:4]))  # four repeated label events
        # live: ids 10-49 labelled (40); shadow: even ids 10-48 (20).
        await events_until(servers, settings.evaluation.evaluation_topic, 60)
        await asyncio.sleep(1.0)  # nothing more may come
        stopping.set()
        evaluator = await worker
        return evaluator, await read_events(servers, settings.evaluation.evaluation_topic), \
            await read_events(servers, settings.evaluation.label_dead_letter_topic)

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


async def _evaluate_until(settings: Any, servers: str, count: int, metrics: Any = None) -> Any:
    """One evaluate worker in this process until ``count`` evaluations are on the topic; it stops cleanly."""
    stopping = asyncio.Event()
    worker = asyncio.ensure_future(run_worker(settings, stopping, metrics=metrics))
    found = await events_until(servers, settings.evaluation.evaluation_topic, count)
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
    settings = evaluate_settings(kafka_broker, topic_names)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(9)
    ids = [f"w-{n:03d}" for n in range(90)]
    answers, labels = [answer_event(i, rng) for i in ids], [label_event(i, rng) for i in ids]

    async def scenario() -> tuple[list[Any], list[Any], list[Any], list[dict[str, Any]]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        await produce(servers, settings.delivery.answer_topic, keyed(answers))
        await produce(servers, settings.evaluation.label_topic, keyed(labels[:10]))
        first = await _evaluate_until(settings, servers, 10)  # 80 answers left waiting
        await produce(servers, settings.evaluation.label_topic, keyed(labels[10:40]))
        second = await _evaluate_until(settings, servers, 40)  # the same files: a clean restart
        for state_file in Path(settings.evaluation.evaluate_state_dir).rglob("*"):  # a new machine
            if state_file.is_file():
                state_file.unlink()
        await produce(servers, settings.evaluation.label_topic, keyed(labels[40:]))
        third = await _evaluate_until(settings, servers, 90)
        return first.restores, second.restores, third.restores, await read_events(servers, settings.evaluation.evaluation_topic)

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
    settings = evaluate_settings(kafka_broker, topic_names, topic_partitions=1, evaluate_max_state_bytes=24_000)
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
        await produce(servers, settings.delivery.answer_topic, keyed([answer_event(i, rng) for i in ids]))
        deadline = time.monotonic() + 60
        while taken_in() < len(ids):
            assert time.monotonic() < deadline and not worker.done(), f"{taken_in()} answers taken in"
            await asyncio.sleep(0.1)
        # The newest answer's label: joined; the oldest one's: its answer was evicted on the way.
        await produce(servers, settings.evaluation.label_topic, keyed([label_event(ids[-1], rng), label_event(ids[0], rng)]))
        await events_until(servers, settings.evaluation.evaluation_topic, 1)
        await asyncio.sleep(0.5)
        stopping.set()
        await worker
        return await read_events(servers, settings.evaluation.evaluation_topic)

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


def test_a_unit_fenced_while_its_worker_holds_it_is_rebuilt_from_its_changelog_and_joins_each_pair_once(
        kafka_broker: Any, topic_names: Any) -> None:
    """Another producer takes the unit's transactional id while the worker holds the unit (a zombie's successor,
    or a second worker with the same group misconfigured): the worker's next transaction is refused, its unit is
    closed, its state rebuilt whole from the changelog and its partitions read again from their commits; every
    answer is still joined with its label exactly once."""
    from d3stream.kafka.connection import kafka_producer

    settings = evaluate_settings(kafka_broker, topic_names)
    servers = settings.connection.bootstrap_servers
    rng = random.Random(11)
    ids = [f"f-{n:02d}" for n in range(30)]
    answers, labels = [answer_event(i, rng) for i in ids], [label_event(i, rng) for i in ids]

    async def scenario() -> tuple[list[Any], list[dict[str, Any]]]:
        await prepare_topics(settings, EvaluateTopics.from_settings(settings, None))
        stopping = asyncio.Event()
        worker = asyncio.ensure_future(run_worker(settings, stopping))
        await produce(servers, settings.delivery.answer_topic, keyed(answers))
        await produce(servers, settings.evaluation.label_topic, keyed(labels[:10]))
        await events_until(servers, settings.evaluation.evaluation_topic, 10)
        intruder = kafka_producer(settings.connection, transactional_id=f"{settings.delivery.transactional_id_prefix}"
                                  f"-evaluate-{settings.evaluation.evaluate_group_id}-0")
        await intruder.start()  # init_transactions: the worker's producer of unit 0 is fenced from here on
        await intruder.stop()
        await produce(servers, settings.evaluation.label_topic, keyed(labels[10:]))
        await events_until(servers, settings.evaluation.evaluation_topic, 30)
        await asyncio.sleep(1.0)  # nothing more may come
        stopping.set()
        evaluator = await worker
        return evaluator.restores, await read_events(servers, settings.evaluation.evaluation_topic)

    restores, evaluations = asyncio.run(scenario())
    assert sorted(collections.Counter(e["id"] for e in evaluations).items()) == [(i, 1) for i in ids]
    fenced_unit = [restore["mode"] for restore in restores if restore["partition"] == 0]
    assert fenced_unit == ["restore", "restore"], "unit 0 rebuilt whole once fenced (its file may lag the changelog)"
