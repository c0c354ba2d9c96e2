"""The plumbing of ``d3stream bench too-large`` (d3stream/benchmarks/bench_too_large.py) with a tiny request: every
figure is there and the answer is the ``answer_too_large`` replacement. No timing is asserted (the figure is the
benchmark's, not a test's)."""

from __future__ import annotations

import pytest

from d3stream.benchmarks.bench_too_large import too_large_bench, too_large_markdown


@pytest.mark.slow  # runs the too-large benchmark
def test_the_too_large_bench_reports_every_figure(qwen35_text_model):
    # The service sets the request limits on the model it serves: the session's model gets its own back.
    limits = qwen35_text_model.max_length, qwen35_text_model.max_request_tokens
    try:
        # 2 kB: an answer of 40 questions is over it, and the error answer that replaces it is not.
        report = too_large_bench(qwen35_text_model, 40, threads=None, limit=2_000)
    finally:
        qwen35_text_model.max_length, qwen35_text_model.max_request_tokens = limits
    request = report["request"]
    assert report["questions"] == 40 and report["limit"] == 2_000
    assert request["code"] == "answer_too_large" and request["passes"] >= 1
    assert request["seconds"] >= request["forward_s"] > 0 and request["after_pass_s"] >= 0
    assert set(report["sizing"]) == {"json", "avro"}
    for sizing in report["sizing"].values():
        assert sizing["code"] == "answer_too_large" and sizing["answer_bytes"] > 2_000 and sizing["seconds"] >= 0
    table = too_large_markdown(report)
    assert "answer_too_large in" in table and "| json |" in table and "| avro |" in table
