"""``d3stream bench`` (d3stream/benchmarks/bench.py, d3stream/cli/bench.py): structure of its report on a tiny
checkpoint, never its speed."""

from __future__ import annotations

import json

import pytest

from d3stream.benchmarks import bench
from d3stream.cli import build_parser
from d3stream.cli import main as cli_main

PATH_KEYS = {
    "seconds", "questions", "questions_per_s", "requests_per_s", "input_tokens_per_s", "computed_tokens_per_s",
    "real_tokens", "padded_tokens", "real_over_padded", "passes", "model_tflops_per_s", "mfu", "peak_rss_mb",
    "peak_cuda_mb", "latency", "media_cache",
}
RATIOS = {"b_over_a", "b_over_peak", "c_over_b", "real_over_padded", "max_abs_dp"}


@pytest.mark.slow
def test_bench_small_json(qwen35_checkpoint, capsys, tmp_path):
    markdown = tmp_path / "bench.md"
    code = cli_main([
        "bench", "workloads", "--workload", "small", "--json", "--checkpoint", str(qwen35_checkpoint), "--device", "cpu",
        "--requests", "20", "--sweep", "quick", "--no-progress", "--markdown", str(markdown),
        "--threads", "1",  # quick on a busy machine (the thread count is restored afterwards)
    ])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"small"}
    entry = report["small"]
    assert RATIOS <= set(entry) and {"a", "b", "c", "workload", "setup", "calibration"} <= set(entry)
    for path in "abc":
        figures = entry[path]
        assert PATH_KEYS <= set(figures), path
        assert figures["questions"] == entry["workload"]["questions"] > 20  # 1-3 questions per request
        assert figures["questions_per_s"] > 0 and figures["input_tokens_per_s"] > 0
        assert 0 < figures["real_over_padded"] <= 1
        latency = figures["latency"]
        assert 0 < latency["p50_ms"] <= latency["p99_ms"]
        assert latency["rate_rps"] == entry["a"]["latency"]["rate_rps"]  # one arrival process for all paths
        assert figures["peak_rss_mb"] > 0 and figures["peak_cuda_mb"] is None
    assert entry["a"]["media_cache"] is None
    assert entry["c"]["prefix"]["requests_reused"] + entry["c"]["prefix"]["requests_full"] == 20
    assert entry["b_over_a"] == pytest.approx(entry["b"]["questions_per_s"] / entry["a"]["questions_per_s"], rel=1e-2)
    assert entry["c_over_b"] > 0 and entry["b_over_peak"] > 0
    assert entry["real_over_padded"] == entry["b"]["real_over_padded"]
    assert 0 <= entry["max_abs_dp"] <= 1e-2
    assert entry["calibration"]["peak_tokens_per_s"] > 0 and entry["calibration"]["max_batch_tokens"] > 0
    assert entry["workload"]["prompt_tokens"]["min"] >= 50 and entry["workload"]["prompt_tokens"]["max"] <= 450
    table = markdown.read_text()
    assert "| small | a reference" in table and "b ÷ a" in table


@pytest.mark.slow
def test_variants_of_b_run_side_by_side(qwen35_checkpoint, capsys, tmp_path):
    """``--variant`` runs path b again with one runtime choice flipped, in the same run, and compares it with
    b: length buckets pad more but answer the same, per-request media encoding answers the same."""
    markdown = tmp_path / "bench.md"
    code = cli_main([
        "bench", "workloads", "--workload", "images", "--json", "--checkpoint", str(qwen35_checkpoint), "--device", "cpu",
        "--requests", "6", "--sweep", "quick", "--no-progress", "--markdown", str(markdown), "--threads", "1",
        "--variant", "buckets", "--variant", "media_per_request",
    ])
    assert code == 0
    entry = json.loads(capsys.readouterr().out)["images"]
    b, buckets, per_request = entry["b"], entry["b_buckets"], entry["b_media_per_request"]
    assert b["questions"] == buckets["questions"] == per_request["questions"]
    assert buckets["padded_tokens"] > b["padded_tokens"] == per_request["padded_tokens"]
    assert buckets["real_tokens"] == b["real_tokens"]
    for variant in ("buckets", "media_per_request"):
        assert entry[f"b_{variant}_over_b"] > 0
        assert 0 <= entry[f"b_{variant}_max_abs_dp"] <= 1e-2
    assert entry["setup"]["pad_buckets"] is False and entry["setup"]["media_batch_patches"] > 0
    table = markdown.read_text()
    assert "| images | b with padded widths rounded to length buckets" in table
    assert "variant of b" in table


def test_an_unknown_variant_is_refused(qwen35_text_model):
    with pytest.raises(ValueError, match="unknown --variant"):
        bench.Bench(qwen35_text_model, max_batch_tokens=1024, variants=["fast"])


def test_kernel_check_answers_held_out_requests_both_ways(qwen35_model):
    """The check gpu.sh runs before timing: held-out requests with the bound kernels and with the reference
    path. Here (no kernel packages) both are the reference code, so they agree exactly; afterwards the
    bound functions are in place again."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    bound = qwen.torch_chunk_gated_delta_rule
    result = bench.kernel_check(qwen35_model, tickets=3, pictures=1)
    assert result["requests"] == 4 and result["questions"] >= 4
    assert result["passed"] and result["max_abs_dp"] == 0.0
    assert result["kernels"]["path"] == "reference"
    assert qwen.torch_chunk_gated_delta_rule is bound


def test_every_benchmark_is_a_subcommand_of_bench():
    """``d3stream bench BENCHMARK``: one subcommand per benchmark, each with its own arguments."""
    from d3stream.cli import bench as bench_command

    parser = build_parser()
    args = parser.parse_args(["bench", "workloads", "--workload", "long-state", "--calibrate", "--device", "cpu"])
    assert args.run is bench_command.COMMAND.run and args.workload == "long-state" and args.calibrate
    assert {b.name for b in bench_command.BENCHMARKS} == {
        "workloads", "kafka", "soak", "soak-images", "evaluate", "evaluate-volume", "ask", "head-of-line", "stream",
        "scheduling", "too-large", "host", "fleet", "servers"}
    assert parser.parse_args(["bench", "kafka"]).count == 20_000
    assert parser.parse_args(["bench", "soak-images", "5", "--json"]).count == 5
    assert parser.parse_args(["bench", "scheduling", "2.5"]).count == 2.5
    assert parser.parse_args(["bench", "too-large"]).count == 12_000
    assert parser.parse_args(["bench", "stream", "100", "--images", "3"]).images == 3
    host = parser.parse_args(["bench", "host", "--workload", "shared", "--delivery", "at_least_once", "--format",
                              "avro", "--device-ms", "20", "--json"])
    assert (host.workload, host.delivery, host.format, host.device_ms, host.json) == (
        "shared", "at_least_once", "avro", 20.0, True)
    assert parser.parse_args(["bench", "host"]).max_batch_tokens == 16_384
    fleet = parser.parse_args(["bench", "fleet", "--workers", "6", "--delivery", "at_least_once", "--static"])
    assert (fleet.workers, fleet.scale_from, fleet.delivery, fleet.static) == (6, 2, "at_least_once", True)
    with pytest.raises(SystemExit):  # the old "instead" flags are gone
        parser.parse_args(["bench", "--kafka"])


def test_workloads_are_seeded_and_shaped(qwen35_text_model):
    tokenizer = qwen35_text_model.tokenizer
    small = bench.make_workload("small", 30, 0, tokenizer)
    assert [r.state for r in small] == [r.state for r in bench.make_workload("small", 30, 0, tokenizer)]
    assert [r.state for r in small] != [r.state for r in bench.make_workload("small", 30, 1, tokenizer)]
    assert all(1 <= len(r.questions) <= 3 and not r.images for r in small)
    long = bench.make_workload("long-state", 2, 0, tokenizer)
    assert all(len(r.questions) == 10 for r in long)
    tokens = len(tokenizer(long[0].state, add_special_tokens=False)["input_ids"])
    assert 1700 <= tokens <= 2300
    images = bench.make_workload("images", 10, 0, tokenizer)
    assert all(1 <= len(r.images) <= 4 for r in images)
    sizes = {image.size for r in images for image in r.images}
    assert len(sizes) > 2
    mixed = bench.make_workload("mixed", 40, 0, tokenizer)
    assert {r.kind for r in mixed} >= {"small", "long-state", "images"}


def test_a_repeated_stream_asks_the_same_few_questions_of_states_of_its_own(qwen35_text_model):
    from d3stream.benchmarks.bench_workloads import REPEATED_QUESTIONS, make_repeated

    tokenizer = qwen35_text_model.tokenizer
    requests = make_repeated(200, 0, tokenizer)
    assert [(r.state, r.questions) for r in requests] == [(r.state, r.questions) for r in make_repeated(200, 0, tokenizer)]
    asked = {(key, json.dumps(question, sort_keys=True)) for r in requests for key, question in r.questions.items()}
    assert len(asked) == REPEATED_QUESTIONS  # the same questions under the same ids, all of them asked
    assert all(1 <= len(r.questions) <= 3 and not r.images for r in requests)
    assert len({r.state for r in requests}) == len(requests)


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert bench.percentile(values, 0.5) == 50 and bench.percentile(values, 0.99) == 99
    assert bench.percentile([7.0], 0.99) == 7.0 and bench.percentile([], 0.5) is None


def test_best_seconds_takes_each_pass_at_its_fastest():
    def tally(*seconds):
        t = bench.Tally()
        for n, value in enumerate(seconds):
            t.add("batch", [10 + n], value)
        return t

    # Two rounds of the same passes: 1 + 1 (fastest of each) + 0.5 (least time between passes).
    assert bench.best_seconds([tally(1.0, 3.0), tally(2.0, 1.0)], [4.5, 4.0]) == pytest.approx(2.5)
    # Rounds that ran different passes: the fastest wall time.
    assert bench.best_seconds([tally(1.0), tally(1.0, 1.0)], [3.0, 2.5]) == 2.5


# ------------------------------------------------------------------- service-level (bench_service.py)


def test_null_model_validates_questions_and_answers_uniformly():
    from d3stream.benchmarks.bench_service import QUESTIONS, NullModel

    model = NullModel()
    prepared = model.prepare("a state", {"ok": QUESTIONS[1], "bad": {"type": "choice", "criteria": {}}})
    assert prepared.errors["bad"]["error"] == "invalid_question"
    response = prepared.answers(dict(zip(prepared.rows, model.forward(prepared.rows), strict=True)))
    assert response["answers"]["ok"]["probabilities"] == {"approve": 1 / 3, "reject": 1 / 3, "escalate": 1 / 3}
    with pytest.raises(ValueError, match="no media"):
        model.load_images([b"x"])


def test_soak_verdict_tells_flat_from_growing():
    from d3stream.benchmarks.bench_service import soak_verdict

    mb = 2**20
    flat = [(n, 1000 * mb + (n % 3) * mb) for n in range(0, 100_000, 2_000)]
    growing = [(n, 1000 * mb + n * mb // 500) for n in range(0, 100_000, 2_000)]  # +200 MB over the soak
    assert soak_verdict(flat, 100_000, 100.0)["flat_within_5pct"]
    verdict = soak_verdict(growing, 100_000, 100.0)
    assert not verdict["flat_within_5pct"] and verdict["growth_second_half"] > 0.05
    # warm-up that levels off by the middle is not a leak
    warming = [(n, min(1000 * mb + n * mb // 100, 1400 * mb)) for n in range(0, 100_000, 2_000)]
    verdict = soak_verdict(warming, 100_000, 100.0)
    assert verdict["flat_within_5pct"] and verdict["growth_since_first_tenth"] > 0.05
