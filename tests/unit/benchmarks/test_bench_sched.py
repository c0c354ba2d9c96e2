"""The plumbing of ``d3stream bench scheduling`` (d3stream/benchmarks/bench_sched.py) with tiny counts: every figure
is there and the expired burst costs no pass. No timing is asserted."""

from __future__ import annotations

import pytest

from d3stream.benchmarks.bench_sched import STAGES, scheduling_bench, scheduling_markdown


@pytest.mark.slow  # runs the scheduling benchmark
def test_the_scheduling_bench_reports_every_figure(qwen35_model):
    report = scheduling_bench(qwen35_model, seconds=0.5, threads=None, expired=5)
    assert set(report["lanes"]) == {"alone", "flood_lanes_on", "flood_lanes_on_uncapped", "flood_lanes_off"}
    assert all(row["requests"] >= 2 for row in report["lanes"].values())
    # Where the high stream's time went, and what the flood got, in each run.
    assert all(set(row["stages_ms"]) == set(STAGES) for row in report["lanes"].values())
    # Every flood request is answered in each flooded run; how many within the window is a timing (a loaded
    # machine may answer none of them in half a second), so only its presence is checked.
    flood = report["setup"]["flood_requests"]
    assert flood >= 2
    assert all(row["flood_answered"] == (0 if name == "alone" else flood) for name, row in report["lanes"].items())
    assert all(row["flood_per_s"] >= 0 for row in report["lanes"].values())
    assert report["expired"] == {"requests": 5, "passes_run": 0, "deadline_exceeded": 5}
    assert {"alone", "flood_quotas_off", "flood_quotas_on"} <= set(report["tenants"])
    assert report["tenants"]["quota_tokens"] > 0
    table = scheduling_markdown(report)
    assert "flood lanes off" in table and "scheduler wait" in table and "flood quotas on" in table and "0 forward passes" in table
