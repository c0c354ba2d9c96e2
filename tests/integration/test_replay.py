"""Replays on the real broker: ranges by offset and time, parallel workers, bit-identical deterministic replays,
and the drift report against recorded answers (a killed replay: tests/system/test_replay.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from d3stream_client.publisher import produce

from d3stream.benchmarks.chaos import count_topic
from d3stream.jobs.replay import ReplayRange, parse_time, replay_drift, run_replay
from d3stream.service import Service
from d3stream.settings import Settings


def request(number: int, *, long: bool = False) -> dict:
    state = f"Order {number}: " + ("widget " * (120 if long else (number % 13 + 1)))
    return {
        "id": f"r{number:04d}",
        "state": state,
        "questions": {
            "stock": {"type": "noul", "instructions": "In stock?"},
            "route": {"type": "choice", "criteria": {"north": "dock A", "south": "dock B", "hold": None}},
            "priority": {"type": "score", "criteria": ["low", "mid", "high"]},
        },
    }


def records(count: int, **kwargs) -> list[tuple[bytes, bytes]]:
    return [(f"r{n:04d}".encode(), json.dumps(request(n, **kwargs)).encode()) for n in range(count)]


def settings_for(broker, requests_topic: str, answers_topic: str, group: str, **extra) -> Settings:
    return Settings.from_flat(
        bootstrap_servers=broker.bootstrap_servers,
        request_topics=[requests_topic],
        answer_topic=answers_topic,
        dead_letter_topic=f"{answers_topic}-dlq",
        provenance_topic=f"{answers_topic}-prov",
        group_id=group,
        metrics_port=None,
        commit_interval_ms=100,
        linger_ms=5,
        **extra,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def max_abs_dp(first: dict, second: dict) -> float:
    worst = 0.0
    for key, answer in first.items():
        for option, p in answer["probabilities"].items():
            worst = max(worst, abs(p - second[key]["probabilities"][option]))
    return worst


@pytest.fixture
def request_topic(kafka_broker, topic_names):
    name = topic_names("replay-req")
    kafka_broker.create_topic(name, partitions=2)
    return name


def test_replay_by_offsets_writes_each_request_once_with_the_replay_id(
    kafka_broker, request_topic, topic_names, qwen35_text_model, tmp_path
):
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(20)))
    settings = settings_for(kafka_broker, request_topic, topic_names("unused"), topic_names("g"))
    out = tmp_path / "replay.jsonl"
    plan = ReplayRange(topic=request_topic, start_offset=2, end_offset=7)
    summary = asyncio.run(run_replay(settings, qwen35_text_model, plan, replay_id="offsets", out_file=out))

    answers = read_jsonl(out)
    # 2 partitions x offsets 2..6
    assert summary["range_records"] == 10 and summary["replayed"] == 10
    assert sorted((a["source"]["partition"], a["source"]["offset"]) for a in answers) == [
        (p, o) for p in (0, 1) for o in range(2, 7)
    ]
    assert all(a["provenance"]["replay_id"] == "offsets" for a in answers)
    assert all(set(a["answers"]) == {"stock", "route", "priority"} for a in answers)


def test_replay_by_timestamps_selects_the_requests_of_the_window(
    kafka_broker, topic_names, qwen35_text_model, tmp_path
):
    topic = topic_names("replay-time")
    kafka_broker.create_topic(topic, partitions=1)
    base = 1_764_400_000_000

    async def publish() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers)
        await producer.start()
        try:
            for number, (key, value) in enumerate(records(10)):
                await producer.send_and_wait(topic, value=value, key=key, timestamp_ms=base + number * 60_000)
        finally:
            await producer.stop()

    asyncio.run(publish())
    settings = settings_for(kafka_broker, topic, topic_names("unused"), topic_names("g"))
    out = tmp_path / "window.jsonl"
    window = ReplayRange(topic=topic, start_time=base + 3 * 60_000, end_time=parse_time(str(base + 7 * 60_000)))
    asyncio.run(run_replay(settings, qwen35_text_model, window, replay_id="window", out_file=out))
    assert sorted(a["id"] for a in read_jsonl(out)) == [f"r{n:04d}" for n in range(3, 7)]


def test_two_replay_workers_split_the_partitions_and_answer_each_request_once(
    kafka_broker, request_topic, topic_names, qwen35_text_model
):
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(60)))
    answers_topic = topic_names("replay-out")
    kafka_broker.create_topic(answers_topic, partitions=2)
    settings = settings_for(kafka_broker, request_topic, answers_topic, topic_names("g"))
    plan = ReplayRange(topic=request_topic)

    async def both() -> list[dict]:
        return list(await asyncio.gather(
            run_replay(settings, qwen35_text_model, plan, replay_id="pair"),
            run_replay(settings, qwen35_text_model, plan, replay_id="pair"),
        ))

    summaries = asyncio.run(both())
    answers = asyncio.run(count_topic(kafka_broker.bootstrap_servers, answers_topic))
    ids = [a["id"] for a in answers]
    assert sorted(ids) == [f"r{n:04d}" for n in range(60)]  # exactly once, in a topic (exactly_once)
    assert sum(s["replayed"] for s in summaries) == 60
    assert all(a["provenance"]["replay_id"] == "pair" for a in answers)


def test_deterministic_replays_reproduce_themselves_bit_for_bit(
    kafka_broker, request_topic, topic_names, qwen35_text_model, tmp_path
):
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(30)))
    settings = settings_for(kafka_broker, request_topic, topic_names("unused"), topic_names("g"))
    runs = []
    for number in range(2):
        out = tmp_path / f"det{number}.jsonl"
        asyncio.run(run_replay(settings, qwen35_text_model, ReplayRange(topic=request_topic),
                               replay_id=f"det{number}", out_file=out, deterministic=True, rows_per_pass=5))
        runs.append({a["id"]: a for a in read_jsonl(out)})
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == 30
    for key in runs[0]:
        assert runs[0][key]["answers"] == runs[1][key]["answers"]  # exact float equality
        assert runs[0][key]["provenance"]["batch"] == runs[1][key]["provenance"]["batch"]


def test_replaying_the_live_model_reproduces_its_answers_and_reports_the_drift(
    kafka_broker, request_topic, topic_names, qwen35_text_model, tmp_path
):
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(24)))
    live_answers = topic_names("live-out")
    kafka_broker.create_topic(live_answers, partitions=2)
    settings = settings_for(kafka_broker, request_topic, live_answers, topic_names("live"))

    async def serve_all() -> None:
        service = Service(settings, qwen35_text_model)
        task = asyncio.create_task(service.run())
        while service.counts["answered"] < 24:
            await asyncio.sleep(0.05)
        service.stop()
        await task

    asyncio.run(serve_all())
    out = tmp_path / "replayed.jsonl"
    asyncio.run(run_replay(settings, qwen35_text_model, ReplayRange(topic=request_topic), replay_id="drift",
                           out_file=out, deterministic=True, rows_per_pass=3))
    drift = replay_drift(f"kafka:{live_answers}", str(out), Settings.from_flat(bootstrap_servers=kafka_broker.bootstrap_servers))
    assert drift["joined"] == 24 * 3 and drift["only_a"] == 0 and drift["only_b"] == 0
    assert drift["max_abs_dp"] <= 1e-2  # bf16 tolerance: other pass compositions, same answers
    recorded = {a["id"]: a["answers"] for a in asyncio.run(count_topic(kafka_broker.bootstrap_servers, live_answers))}
    replayed = {a["id"]: a["answers"] for a in read_jsonl(out)}
    assert max(max_abs_dp(recorded[key], replayed[key]) for key in recorded) == pytest.approx(drift["max_abs_dp"])


def _replay_cli(argv: list[str]) -> int:
    from d3stream.cli import main

    return main(["replay", *argv])


@pytest.mark.usefixtures("logging_restored")
def test_replay_needs_a_target_and_refuses_the_live_answer_topic_unless_told(
    kafka_broker, request_topic, topic_names, qwen35_text_checkpoint, capsys
):
    asyncio.run(produce(kafka_broker.bootstrap_servers, request_topic, records(6)))
    live = topic_names("live-answers")
    kafka_broker.create_topic(live, partitions=2)
    common = ["--from-topic", request_topic, "--model", str(qwen35_text_checkpoint), "--verify", "none",
              "--bootstrap-servers", kafka_broker.bootstrap_servers, "--group-id", topic_names("g"),
              "--answer-topic", live, "--dead-letter-topic", f"{live}-dlq", "--provenance-topic", f"{live}-prov",
              "--metrics-port", "", "--commit-interval-ms", "100", "--json"]

    with pytest.raises(SystemExit) as no_target:  # no default target: neither the live topic nor any other
        _replay_cli([*common, "--replay-id", "none"])
    assert no_target.value.code == 2
    assert "--to-topic" in capsys.readouterr().err

    assert _replay_cli([*common, "--replay-id", "refused", "--to-topic", live]) == 2
    refusal = capsys.readouterr().err
    assert "live answer topic" in refusal and "--allow-live-answer-topic" in refusal
    assert asyncio.run(count_topic(kafka_broker.bootstrap_servers, live, settle_s=2)) == []
    # Never into a request topic, whatever the flags: workers would read the answers as requests.
    assert _replay_cli([*common, "--replay-id", "loop", "--to-topic", request_topic, "--allow-live-answer-topic"]) == 2
    assert "request topic" in capsys.readouterr().err

    assert _replay_cli([*common, "--replay-id", "told", "--to-topic", live, "--allow-live-answer-topic"]) == 0
    answers = asyncio.run(count_topic(kafka_broker.bootstrap_servers, live))
    assert sorted(a["id"] for a in answers) == [f"r{n:04d}" for n in range(6)]
    assert {a["provenance"]["replay_id"] for a in answers} == {"told"}
