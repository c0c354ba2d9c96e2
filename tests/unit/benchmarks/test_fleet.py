"""The parts of ``d3stream bench fleet`` (d3stream/benchmarks/fleet.py, fleet_worker.py) that need no broker and
no process: the stand-in model, reading the workers' series, counters summed over a worker's restarts, the answer
count's windows, the shape's checks and the table. tests/system/test_fleet.py runs a whole fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

from d3stream.benchmarks import fleet_worker
from d3stream.benchmarks.chaos import WorkerProcess
from d3stream.benchmarks.fleet import (
    AnswerCount,
    BacklogStream,
    FleetMember,
    FleetShape,
    fleet_markdown,
    is_settled,
    read_series,
    request_record,
    worker_settings,
)
from d3stream.runtime import Row

METRICS_TEXT = """\
# HELP d3stream_rebalances_total Rebalances this worker took part in.
# TYPE d3stream_rebalances_total counter
d3stream_rebalances_total 3.0
d3stream_rebalances_created 1.7e+09
d3stream_rebalance_paused_seconds_total 1.25
d3stream_partitions_owned 4.0
d3stream_group_generation 7.0
d3stream_consumer_lag{partition="0",topic="t"} 12.0
"""


def test_the_stand_in_model_waits_its_device_time_on_every_pass_and_answers_uniformly(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(fleet_worker.time, "sleep", slept.append)
    model = fleet_worker.SleepModel(0.04)
    prepared = model.prepare("a ticket", {"urgent": {"type": "noul"}})
    assert [row.key for row in prepared.rows] == ["urgent"] and not prepared.errors
    probabilities = model.forward([Row("a", [0], 2), Row("b", [0], 4)])
    assert probabilities == [[0.5, 0.5], [0.25] * 4]
    assert slept == [0.04], "one device time per pass, however many rows it carries"
    assert model.provenance()["kind"] == "sleep"


def test_the_workers_series_are_read_from_their_unlabelled_lines():
    found = read_series(METRICS_TEXT, ("d3stream_rebalances_total", "d3stream_partitions_owned",
                                       "d3stream_consumer_lag", "d3stream_revoked_requests_abandoned_total"))
    assert found == {"d3stream_rebalances_total": 3.0, "d3stream_partitions_owned": 4.0}


def _member(tmp_path: Path, name: str = "worker-0") -> FleetMember:
    return FleetMember(name, WorkerProcess({}, tmp_path / f"{name}.log"), port=0)


def test_a_workers_counters_are_summed_over_its_processes(tmp_path):
    member = _member(tmp_path)
    member.account(1, {"d3stream_rebalance_paused_seconds_total": 1.0, "d3stream_rebalances_total": 2})
    member.account(1, {"d3stream_rebalance_paused_seconds_total": 1.5, "d3stream_rebalances_total": 3})
    # Restarted: the new process counts from zero, and what it counts adds to what the first one counted.
    member.account(2, {"d3stream_rebalance_paused_seconds_total": 0.25, "d3stream_rebalances_total": 1})
    assert member.totals["d3stream_rebalance_paused_seconds_total"] == 1.75
    assert member.totals["d3stream_rebalances_total"] == 4


def test_the_group_is_settled_when_every_worker_joined_one_generation_and_all_partitions_are_owned(tmp_path):
    first, second = _member(tmp_path, "worker-0"), _member(tmp_path, "worker-1")

    def seen(member: FleetMember, generation: int, owned: int, rebalances: int = 1) -> None:
        member.latest = {"d3stream_group_generation": generation, "d3stream_partitions_owned": owned,
                         "d3stream_rebalances_total": rebalances}

    seen(first, 3, 2)
    seen(second, 3, 2)
    assert is_settled([first, second], 4)
    seen(second, 4, 2)  # a rebalance under way: one has the next generation already
    assert not is_settled([first, second], 4)
    seen(second, 3, 1)
    assert not is_settled([first, second], 4)
    seen(second, 3, 2, rebalances=0)  # up, not joined yet
    assert not is_settled([first, second], 4)
    second.latest = None  # down
    assert not is_settled([first, second], 4)


def test_the_answer_count_gives_the_answers_of_a_window():
    count = AnswerCount("127.0.0.1:1", "answers")
    count.times, count.cumulative = [1.0, 2.0, 2.5, 4.0], [10, 30, 35, 50]
    assert count.total == 50
    assert count.between(0.0, 10.0) == 50
    assert count.between(2.0, 4.0) == 25  # [2, 4): the fetches at 2.0 and 2.5
    assert count.between(4.5, 9.0) == 0
    assert count.per_second(1.0, 4.0) == [10, 25, 0]


def test_the_shape_refuses_what_it_cannot_run_and_sizes_the_backlog_from_the_capacity():
    shape = FleetShape()
    assert shape.capacity_per_worker == 200.0  # 8 rows per 40 ms
    assert shape.backlog_requests == 2400  # three seconds of four workers
    assert FleetShape(backlog=50).backlog_requests == 50
    with pytest.raises(ValueError, match="--scale-from"):
        FleetShape(workers=4, scale_from=5).check()
    with pytest.raises(ValueError, match="--partitions"):
        FleetShape(workers=4, partitions=3).check()
    with pytest.raises(ValueError, match="--rollout stop_first"):  # a replacement would take the static id
        FleetShape(static=True).check()
    with pytest.raises(ValueError, match="--rollout"):
        FleetShape(rollout="recreate").check()
    FleetShape(static=True, rollout="stop_first").check()


def test_the_workers_settings_leave_the_shells_own_out(monkeypatch):
    monkeypatch.setenv("D3STREAM_MAX_BATCH_TOKENS", "16")
    env = worker_settings("127.0.0.1:9092", {"requests": "r", "answers": "a", "dlq": "d", "prov": "p"}, "g",
                          FleetShape(delivery="at_least_once", batch_rows=4))
    assert "D3STREAM_MAX_BATCH_TOKENS" not in env
    assert (env["D3STREAM_DELIVERY"], env["D3STREAM_MAX_BATCH_ROWS"], env["D3STREAM_GROUP_ID"]) == (
        "at_least_once", "4", "g")


def test_the_backlog_is_kept_per_partition_so_an_unserved_partition_holds_its_share_only():
    stream = BacklogStream("127.0.0.1:1", "requests", partitions=3, backlog=30)
    stream.waiting = [10, 10, 10]
    stream.partition_of = {b"fleet-0000000": 0, b"fleet-0000001": 1}
    stream.answered(b"fleet-0000001")
    stream.answered(b"someone-elses")  # not published here: nothing to count
    assert stream.waiting == [10, 9, 10]


def test_a_request_of_the_stream_is_one_question_keyed_by_its_id():
    key, value = request_record(12)
    assert key == b"fleet-0000012" and b'"id": "fleet-0000012"' in value and value.count(b'"type"') == 1


def test_the_table_has_a_row_per_phase_with_its_ratio():
    worker = {"worker": "worker-0", "paused_s": 1.5, "rebalances": 2, "abandoned": 0}
    event = {"name": "rolling_restart", "workers_before": 2, "workers_after": 2, "started_at_s": 10.0, "seconds": 20.0,
             "answers": 3000, "answers_per_s": 150.0, "steady_answers_per_s": 200.0, "ratio": 0.75, "shortfall_s": 5.0, "rebalances": 4,
             "workers": [worker, dict(worker, worker="worker-1")],
             "restarts": [{"worker": "worker-0", "stop_s": 3.0, "start_s": 5.0, "settled_s": 6.0}]}
    report = {"delivery": "exactly_once", "static": False, "rollout": "surge", "keep_partitions": True, "heartbeat_ms": None, "workers": 2, "scale_from": 2, "partitions": 4,
              "device_ms": 40.0, "batch_rows": 8, "capacity_per_worker": 200.0, "backlog": 1200,
              "steady": [{"workers": 2, "seconds": 20.0, "answers": 4000, "answers_per_s": 200.0, "rebalances": 0}], "events": [event],
              "sent": 9000, "answered": 9000, "lost": 0, "repeated": 0, "errors": 0, "exit_codes": [0, 0],
              "tracebacks": 0, "seconds": 60.0, "load_average": (1.5, 2.0), "priority_taken_back": True}
    table = fleet_markdown(report)
    assert "| steady | 2 | 20 | 200 | 1.00 | | 0 | |" in table
    assert "| rolling restart | 2 | 20 | 150 | **0.75** | 5 | 4 | 1.5, 1.5 |" in table
    assert "worker-0 3.0 / 5.0 / 6.0" in table and "lost 0, repeated 0" in table
    assert "rolling restart new before old (maxSurge 1)" in table
