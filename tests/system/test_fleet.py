"""``d3stream bench fleet`` (d3stream/benchmarks/fleet.py) on a tiny fleet: two ``fleet_worker`` processes in one
group, 1 -> 2 workers, a rolling restart of both, 2 -> 1, ``exactly_once``, on the session's broker.

What it must do, never how fast: every request published is answered exactly once (read_committed) through
every event, each event moved the group through at least one rebalance and the workers' own counters saw them
(rebalances and seconds paused), each worker of the rolling restart was replaced (its replacement started and
joined first, as the shipped Deployment rolls) and stopped with SIGTERM and exited 0, and
the report has the figures the table and docs/MEASUREMENTS.md quote."""

from __future__ import annotations

import json

import pytest

from d3stream.benchmarks.fleet import FleetShape, fleet_bench_async, fleet_markdown
from tests.support.stream_helpers import run

pytestmark = pytest.mark.timeout(300)

# Small in every way: a 2-partition topic, short passes, a backlog of a few passes, one-second windows.
TINY = FleetShape(workers=2, scale_from=1, partitions=2, device_ms=10.0, batch_rows=4, max_inflight=16, steady_s=1.0,
                  backlog=200, stable_s=1.0, min_event_s=1.0, settle_timeout_s=90.0)


def test_a_tiny_fleet_answers_every_request_once_through_a_scale_up_a_rolling_restart_and_a_scale_down(
        kafka_broker, tmp_path, capsys):
    report = run(fleet_bench_async(TINY, broker=kafka_broker, folder=tmp_path))
    with capsys.disabled():
        print(f"\n[bench fleet, tiny] {json.dumps(report['events'])}\n{fleet_markdown(report)}")
    assert [(steady["workers"], steady["rebalances"]) for steady in report["steady"]] == [(1, 0), (2, 0)]
    events = {event["name"]: event for event in report["events"]}
    assert list(events) == ["scale_up", "rolling_restart", "scale_down"]
    assert [(e["workers_before"], e["workers_after"]) for e in events.values()] == [(1, 2), (2, 2), (2, 1)]

    assert report["sent"] > 0 and report["answered"] == report["sent"]
    assert report["lost"] == 0, f"unanswered: {report['lost_ids']}"
    assert report["repeated"] == 0, f"answered twice: {report['repeated_ids']}"
    assert report["errors"] == 0
    assert report["exit_codes"] == [0, 0], "a worker did not stop cleanly"
    assert report["tracebacks"] == 0
    assert isinstance(report["priority_taken_back"], bool)

    for event in events.values():
        assert event["rebalances"] >= 1, event
        assert sum(worker["rebalances"] for worker in event["workers"]) >= 1, event
        assert {"answers_per_s", "steady_answers_per_s", "ratio", "shortfall_s", "seconds"} <= set(event)
    # The worker that stayed through the scale-up gave its partitions up and took some back: a pause it counted.
    assert events["scale_up"]["workers"][0]["paused_s"] > 0
    restarts = events["rolling_restart"]["restarts"]
    assert [restart["worker"] for restart in restarts] == ["worker-0", "worker-1"]
    assert all(restart["stop_s"] > 0 and restart["start_s"] > 0 for restart in restarts)
    # The shipped Deployment's rollout (surge): each worker's replacement joined before it stopped, and both
    # processes' pauses are counted; the replacements are the fleet the scale-down leaves.
    assert [worker["worker"] for worker in events["rolling_restart"]["workers"]] == [
        "worker-0", "worker-1", "worker-0'", "worker-1'"]
    assert [worker["worker"] for worker in events["scale_down"]["workers"]] == ["worker-0'"]
    assert len(report["timeline"]) > 0 and sum(report["timeline"]) <= report["sent"] + report["repeated"]
