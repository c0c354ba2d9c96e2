"""``d3stream bench host`` (d3stream/benchmarks/bench_host.py) on the session's broker, store and registry, tiny: every
request answered and published, the report's per-stage CPU figures and the stand-in's busy share, never their values."""

from __future__ import annotations

import asyncio

from d3stream.benchmarks.bench_host import STAGES, host_bench, host_markdown, published_values


def _check_run(run: dict) -> None:
    assert run["answers_published"] == run["requests"] > 0
    assert run["questions"] >= run["requests"] and run["questions_per_s"] > 0 and run["requests_per_s"] > 0
    cpu = run["cpu_us_per_question"]
    assert set(cpu) == {*STAGES, "worker_total", "stand_in", "outside_forward"}
    assert all(value >= 0 for value in cpu.values()) and cpu["worker_total"] > 0
    assert cpu["outside_forward"] <= cpu["worker_total"]
    assert "broker" in run["servers_cpu_us_per_question"] and "object_store" in run["servers_cpu_us_per_question"]
    device = run["device"]
    assert device["passes"] > 0 and sum(device["passes_by_kind"].values()) == device["passes"]
    assert 0.0 <= device["busy_share"] <= 1.0 and 0.0 <= device["busy_share_steady"] <= 1.0
    h100 = run["h100"]
    assert h100["device_tokens_per_question"] > 0 and h100["h100_questions_per_s"] > 0
    assert h100["prompt_tokens_per_question"] >= h100["device_tokens_per_question"] * 0.5
    assert set(run["stage_wall_ms_per_request"]) >= {"prepare", "queued", "forward", "publish"}


def test_host_bench_answers_every_request_and_reports_cpu_by_stage(kafka_broker, object_store, schema_registry,
                                                                   qwen35_checkpoint):
    from d3stream.dev.infra import LocalStack

    stack = LocalStack(kafka_broker, object_store, schema_registry)
    text = host_bench(qwen35_checkpoint, workloads=("small", "repeated", "images"), formats=("json",),
                      requests={"small": 12, "repeated": 12, "images": 6}, device_ms=5.0, warm_up=False, stack=stack)
    assert [(run["workload"], run["delivery"]) for run in text["runs"]] == [
        ("small", "exactly_once"), ("small", "at_least_once"), ("repeated", "exactly_once"),
        ("repeated", "at_least_once"), ("images", "exactly_once"), ("images", "at_least_once")]
    for run in text["runs"]:
        _check_run(run)
        assert run["device"]["busy_share"] > 0  # 5 ms slept per pass
    table = host_markdown(text)
    # a row per run in the CPU table and in the H100 table
    assert table.count("| small | json |") == 4 and table.count("| images | json |") == 4 and "H100" in table

    shared = host_bench(qwen35_checkpoint, workloads=("shared",), formats=("avro",), deliveries=("exactly_once",),
                        requests={"shared": 3}, warm_up=False, stack=stack)
    [run] = shared["runs"]
    _check_run(run)
    assert run["questions"] == 30 and run["device"]["busy_share"] == 0.0  # no device time set
    # each request's 10 questions rode its shared prefix: prefix and suffix passes through the stand-in
    assert run["device"]["passes_by_kind"].get("prefix", 0) >= 1 and run["device"]["passes_by_kind"].get("suffix", 0) >= 1
    values = asyncio.run(published_values(kafka_broker.bootstrap_servers, run["answer_topic"]))
    assert len(values) == 3 and all(value[:1] == b"\x00" for value in values)  # Avro in the registry's framing
