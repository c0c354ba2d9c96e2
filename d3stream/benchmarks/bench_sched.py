"""``d3stream bench scheduling``: the figures of docs/SCHEDULING.md, side by side in one run.

Over **the request pipeline alone** (``RequestPipeline.answer`` of a ``Service`` that is never started: no
broker, no consume loop) with a real model (default: the tiny random demo checkpoint, ``torch_threads=1``).
Records are handed to the pipeline at their arrival times, a fetch of up to ``FETCH`` records at a time, and
each answer's latency is measured from its arrival to its answer. Without the consume loop there is no
worker-wide backpressure and no partition pause: a flood is in flight all at once (the worst case for the
scheduler), and a tenant quota acts by holding requests in the pipeline only. Figures:

* **lanes**: a steady ``high`` stream at ``INTERACTIVE_SHARE`` of the measured capacity, its p50/p99 latency
  alone, under a ``low`` flood that saturates the worker with lanes on, and with lanes off;
* **expired**: a burst of requests already past their deadline: the forward passes they cost;
* **tenants**: a steady tenant at ``STEADY_SHARE`` of capacity, its throughput (answers within its sending
  window, per second) alone and beside a flooding tenant, quotas off and on (``tenant_max_inflight_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

from d3stream_client.contract import HEADERS

from d3stream.core.batching import BatchScheduler
from d3stream.kafka.consume import RESUME_AT, backpressure_pauses
from d3stream.runtime import D3
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.core.record import RequestRecord
    from d3stream.core.seams import DecisionModel

POLL_S = 0.1  # the consume loop's getmany timeout: how often a paused worker looks again
INTERACTIVE_SHARE = 0.10
STEADY_SHARE = 0.30
QUESTION = {"type": "noul", "instructions": "Is anything unusual visible?"}
# Where a high request's time goes (ms each): waiting to be read (backpressure), on the event loop before its
# prepare trip, prepare (its trips on the prepare thread, queued ones included), waiting in the scheduler
# (linger, the pass running when it came, passes ahead), its own pass, and after the pass until answered.
STAGES = ("read_wait", "before_prepare", "prepare", "scheduler_wait", "own_pass", "after_pass")


@dataclass(frozen=True)
class BenchRecord:
    """A request as the pipeline reads it from a topic (``seams.InputRecord``), made without a broker."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    headers: Sequence[tuple[str, bytes]]
    timestamp: int


# A stream: each record with its arrival, in seconds from the start of the run.
Arrivals = list[tuple[float, BenchRecord]]


def _record(rid: str, offset: int, partition: int = 0, **fields: object) -> BenchRecord:
    body = {"id": rid, "state": {"text": f"ticket {rid}: the parcel arrived late"}, "questions": {"a": QUESTION},
            **fields}
    return BenchRecord(topic="bench", partition=partition, offset=offset, key=rid.encode(),
                       value=json.dumps(body).encode(), headers=HEADERS, timestamp=int(time.time() * 1000))


class _Run:
    """One pipeline, fed the way the consume loop feeds it; the arrival and answer time of every id.

    Records become readable at their arrival times, each stream on a partition of its own. Like
    ``consume.ConsumeLoop`` the feeder reads at most ``max_inflight_requests`` less what is in flight; at
    ``max_inflight_requests`` / ``max_inflight_tokens`` it stops reading the partitions ``backpressure_pauses``
    names until the work drains below ``RESUME_AT`` of them (looking again when a record arrives on a partition
    it reads, at least every ``POLL_S``, as ``getmany``'s timeout does), and does not read a partition with a
    request held by a tenant quota. A fetch takes the readable partitions' records in turn (a small stream is not
    queued behind a flood's backlog on another partition, as Kafka's fetches are per partition). Latency runs
    from a record's arrival (it was readable) to its answer, so the wait to be read counts."""

    def __init__(self, settings: Settings, model: DecisionModel, watch: str = ""):
        from d3stream.service import Service

        self.service = Service(settings, model)
        self.settings = settings
        self.watch = watch  # ids with this prefix get the stage breakdown
        self.answered: dict[str, float] = {}
        self.arrived: dict[str, float] = {}
        self.stages: list[dict[str, float]] = []
        self.loop_lag: list[float] = []
        self.per_partition: dict[int, int] = {}  # requests in flight by partition (what backpressure weighs)

    async def _answer(self, records: list[BenchRecord]) -> None:
        """The pipeline answers one fetch; each group of answers is taken as it is ready (as delivery does)."""
        async for answered in self.service.pipeline.answer(records):
            self._served(answered)

    def _served(self, records: list[RequestRecord]) -> None:
        now = time.perf_counter()
        self.service.ledger.delivered(records)
        for record in records:
            self.per_partition[record.source.partition] -= 1
            assert record.answer is not None  # the pipeline hands on answered requests only
            rid = record.answer.id
            self.answered[rid] = now
            if self.watch and rid.startswith(self.watch):
                self.stages.append(self._stages(record, self.arrived[rid], now))

    @staticmethod
    def _stages(record: RequestRecord, arrived: float, answered: float) -> dict[str, float]:
        timings = record.timings
        passes_done = record.submitted_at + (timings.queued + timings.forward) / 1000
        return {"read_wait": 1000 * (record.received - arrived),
                "before_prepare": 1000 * (record.prepare_at - record.received),
                "prepare": 1000 * (record.submitted_at - record.prepare_at),
                "scheduler_wait": timings.queued, "own_pass": timings.forward,
                "after_pass": 1000 * (answered - passes_done)}

    async def _watch_loop(self) -> None:
        """How late the event loop wakes a 1 ms sleep: the interpreter's and the loop's own backlog."""
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            self.loop_lag.append(time.perf_counter() - before - 0.001)

    def _pressure(self, paused: set[int] | None) -> set[int] | None:
        """``consume.ConsumeLoop._apply_backpressure``'s rule on the pipeline's in-flight counts: the partitions
        backpressure pauses now, or None when it is off."""
        settings, work = self.settings, self.service.in_flight
        requests, tokens = work.requests - work.held_requests, work.tokens - work.held_tokens
        full = requests >= settings.batching.max_inflight_requests or tokens >= settings.batching.max_inflight_tokens
        drained = (requests < RESUME_AT * settings.batching.max_inflight_requests
                   and tokens < RESUME_AT * settings.batching.max_inflight_tokens)
        if paused is not None and drained:
            return None
        if paused is None and not full:
            return None
        return (paused or set()) | backpressure_pauses(self.per_partition, requests, tokens,
                                                       settings.batching.max_inflight_requests, settings.batching.max_inflight_tokens)

    def _fetch(self, queues: dict[int, deque[tuple[float, BenchRecord]]], now: float, room: int,
               readable: list[int]) -> Arrivals:
        """Up to ``room`` records arrived on the ``readable`` partitions (with their arrival), taking turns."""
        fetch: Arrivals = []
        while len(fetch) < room:
            taken = [queues[partition].popleft() for partition in readable
                     if queues[partition] and queues[partition][0][0] <= now]
            if not taken:
                break
            fetch.extend(taken[:room - len(fetch)])
        return fetch

    async def feed(self, arrivals: Arrivals) -> float:
        """Serve every record from its arrival (seconds from now); seconds until all are answered."""
        started = time.perf_counter()
        watcher = asyncio.ensure_future(self._watch_loop())
        queues: dict[int, deque[tuple[float, BenchRecord]]] = {}
        for when, record in arrivals:
            queues.setdefault(record.partition, deque()).append((when, record))
            self.per_partition.setdefault(record.partition, 0)
        steps = []
        paused: set[int] | None = None
        in_flight = self.service.in_flight
        while any(queues.values()):
            paused = self._pressure(paused)
            held = {partition for _, partition in self.service.ledger.quotas.held_partitions()}
            readable = [partition for partition in queues if partition not in held and partition not in (paused or ())]
            now = time.perf_counter() - started
            room = max(1, self.settings.batching.max_inflight_requests - in_flight.requests + in_flight.held_requests)
            fetch = self._fetch(queues, now, room, readable)
            if not fetch:  # getmany waits for a record on a readable partition, at most POLL_S
                upcoming = [queues[partition][0][0] for partition in readable if queues[partition]]
                await asyncio.sleep(max(0.0, min([*upcoming, now + POLL_S]) - now))
                continue
            for when, record in fetch:
                self.arrived[json.loads(record.value)["id"]] = started + when
                self.per_partition[record.partition] += 1
            self.service.ledger.read(len(fetch))
            records = [record for _, record in fetch]
            steps.append(asyncio.ensure_future(self._answer(records)))
            await asyncio.sleep(0)  # the loop runs the fetch's first stage before reading again, as getmany does
        await asyncio.gather(*steps)
        watcher.cancel()
        return time.perf_counter() - started

    def latencies(self, prefix: str) -> list[float]:
        return sorted(self.answered[rid] - at for rid, at in self.arrived.items() if rid.startswith(prefix))

    def close(self) -> None:
        self.service.pipeline.close()
        self.service.fetcher.close()


def _run(settings: Settings, model: DecisionModel, arrivals: Arrivals, watch: str = "") -> tuple[_Run, float]:
    run = _Run(settings, model, watch)

    async def go() -> float:
        try:
            return await run.feed(arrivals)
        finally:
            await run.service.default.passes.close()

    seconds = asyncio.run(go())
    run.close()
    return run, seconds


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _steady(prefix: str, rate: float, seconds: float, partition: int = 0, **fields: object) -> Arrivals:
    count = max(2, int(rate * seconds))
    return [(n / rate, _record(f"{prefix}{n}", n, partition, **fields)) for n in range(count)]


def _burst(prefix: str, count: int, partition: int = 1, **fields: object) -> Arrivals:
    return [(0.0, _record(f"{prefix}{n}", n, partition, **fields)) for n in range(count)]


def _merged(*streams: Arrivals) -> Arrivals:
    return sorted((item for stream in streams for item in stream), key=lambda item: item[0])


def _within(run: _Run, prefix: str, seconds: float) -> float:
    """Requests of ``prefix`` answered per second in the first ``seconds`` of the run."""
    arrived = [at for rid, at in run.arrived.items() if rid.startswith(prefix)]
    if not arrived:
        return 0.0
    start = min(arrived)
    done = sum(1 for rid in run.arrived if rid.startswith(prefix) and run.answered[rid] <= start + seconds)
    return round(done / seconds, 1)


class Quantiles(TypedDict):
    """Median and 99th percentile, in ms."""

    p50: float
    p99: float


class LaneFigures(TypedDict):
    """One lanes run: the high stream's latency and where it went, the loop's lag, the flood's throughput."""

    p50_ms: float
    p99_ms: float
    requests: int
    flood_per_s: float
    flood_answered: int
    passes: int
    padded_tokens_per_pass: int
    stages_ms: dict[str, Quantiles]  # by STAGES
    loop_lag_ms: Quantiles


class Expired(TypedDict):
    """The expired burst: its requests, the passes they cost, the deadline_exceeded answers."""

    requests: int
    passes_run: int
    deadline_exceeded: int


class TenantRun(TypedDict):
    """The steady tenant in one run; beside the flood, its throughput over its throughput alone."""

    steady_per_s: float
    steady_p99_ms: float
    vs_alone: NotRequired[float | None]


TenantRunName = Literal["alone", "flood_quotas_off", "flood_quotas_on"]


class Tenants(TypedDict):
    """The steady tenant alone and beside a flooding tenant, quotas off and on; the quota."""

    quota_tokens: int
    alone: TenantRun
    flood_quotas_off: TenantRun
    flood_quotas_on: TenantRun


class SchedulingSetup(TypedDict):
    """The run's path, settings and measured capacity (``_lanes`` adds the flood's size)."""

    path: str
    seconds: float
    torch_threads: int | None
    capacity_per_s: float
    max_inflight_requests: int
    inflight_drain_s: float
    lane_pass_tokens: int | None
    flood_requests: NotRequired[int]


class SchedulingReport(TypedDict):
    """``d3stream bench scheduling``."""

    setup: SchedulingSetup
    lanes: dict[str, LaneFigures]
    expired: Expired
    tenants: Tenants


def _lane_figures(run: _Run, seconds: float) -> LaneFigures:
    """The high stream's latency and where it went, the loop's lag and the flood's throughput in one run."""
    latency = run.latencies("hi")
    scheduler = run.service.default.passes.rows
    assert isinstance(scheduler, BatchScheduler)  # serving, not a replay's ordered passes
    stages: dict[str, Quantiles] = {stage: {"p50": round(_quantile(sorted(each[stage] for each in run.stages), 0.5), 1),
                      "p99": round(_quantile(sorted(each[stage] for each in run.stages), 0.99), 1)}
              for stage in STAGES}
    lag = sorted(run.loop_lag)
    return {"p50_ms": round(1000 * _quantile(latency, 0.5), 1), "p99_ms": round(1000 * _quantile(latency, 0.99), 1),
            "requests": len(latency), "flood_per_s": _within(run, "flood", seconds),
            # The flood in all (a run's answers are every request's, however long they took).
            "flood_answered": sum(1 for rid in run.answered if rid.startswith("flood")),
            "passes": scheduler.passes_run,
            "padded_tokens_per_pass": round(scheduler.padded_tokens / max(scheduler.passes_run, 1)),
            "stages_ms": stages,
            "loop_lag_ms": {"p50": round(1000 * _quantile(lag, 0.5), 1), "p99": round(1000 * _quantile(lag, 0.99), 1)}}


def _with(settings: Settings, **changes: object) -> Settings:
    """A copy of ``settings`` for one run (a run's service never shares its settings object with another)."""
    return settings.replaced(**changes)


def _capacity(settings: Settings, model: DecisionModel, seconds: float) -> float:
    """Requests/s the worker sustains on this model and machine: a burst served as fast as it goes."""
    calibration = max(64, int(20 * seconds))
    _, took = _run(_with(settings), model, _burst("cal", calibration))
    return calibration / took


def _lanes(settings: Settings, model: DecisionModel, capacity: float, seconds: float,
           setup: SchedulingSetup) -> dict[str, LaneFigures]:
    """The high stream alone, and under a low flood with lanes on (capped and not) and off."""
    interactive = _steady("hi", INTERACTIVE_SHARE * capacity, seconds, priority="high")
    # Floods twice as long as the streams, so the worker is saturated for the whole window.
    flood = _burst("flood", int(2 * capacity * seconds), priority="low")
    setup["flood_requests"] = len(flood)
    flooded = _merged(interactive, flood)
    lanes: dict[str, LaneFigures] = {}
    runs: tuple[tuple[str, Arrivals, dict[str, object]], ...] = (
        ("alone", interactive, {}),
        ("flood_lanes_on", flooded, {}),
        ("flood_lanes_on_uncapped", flooded, {"lane_pass_tokens": 0}),
        ("flood_lanes_off", flooded, {"priority_lanes": False}),
    )
    for name, arrivals, changes in runs:
        run, _ = _run(_with(settings, **changes), model, arrivals, watch="hi")
        lanes[name] = _lane_figures(run, seconds)
    return lanes


def _expired(settings: Settings, model: DecisionModel, expired: int) -> Expired:
    """A burst of requests already past their deadline: the passes they cost (none, if refused in time)."""
    run, _ = _run(_with(settings), model, _burst("late", expired, deadline=1_000))
    return {"requests": expired, "passes_run": run.service.default.passes.rows.passes_run,
            "deadline_exceeded": len(run.answered)}


def _tenants(settings: Settings, model: DecisionModel, capacity: float, seconds: float) -> Tenants:
    """A steady tenant's throughput alone and beside a flooding tenant, quotas off and on."""
    steady = _steady("steady", STEADY_SHARE * capacity, seconds, tenant="steady")
    flooding = _burst("flood", int(2 * capacity * seconds), tenant="flood")
    # A quota of about two fetches of 64 of these requests: enough for the steady tenant's arrivals.
    tokens = model.prepare(json.loads(steady[0][1].value)["state"], {"a": QUESTION}).input_tokens
    quota = 2 * 64 * tokens
    runs: tuple[tuple[TenantRunName, Arrivals, int], ...] = (
        ("alone", steady, 0), ("flood_quotas_off", _merged(steady, flooding), 0),
        ("flood_quotas_on", _merged(steady, flooding), quota))
    tenants: dict[TenantRunName, TenantRun] = {}
    for name, arrivals, limit in runs:
        run, _ = _run(_with(settings, tenant_max_inflight_tokens=limit), model, arrivals)
        # Its throughput: what was answered while it was sending (a backlog answered later does not count).
        tenants[name] = {"steady_per_s": _within(run, "steady", seconds),
                         "steady_p99_ms": round(1000 * _quantile(run.latencies("steady"), 0.99), 1)}
    for name in ("flood_quotas_off", "flood_quotas_on"):
        alone = tenants["alone"]["steady_per_s"]  # 0 only on runs too short to answer within the window
        tenants[name]["vs_alone"] = round(tenants[name]["steady_per_s"] / alone, 3) if alone else None
    return {"quota_tokens": quota, "alone": tenants["alone"], "flood_quotas_off": tenants["flood_quotas_off"],
            "flood_quotas_on": tenants["flood_quotas_on"]}


def scheduling_bench(model: DecisionModel | str | os.PathLike[str], *, seconds: float = 6.0,
                     threads: int | None = 1, expired: int = 200) -> SchedulingReport:
    """All three figures on ``model`` (a loaded model or a checkpoint path), each stream ``seconds`` long."""
    if isinstance(model, (str, os.PathLike)):
        model = D3.from_pretrained(Path(model), device="cpu")
    base = Settings.from_flat(metrics_port=None, answer_topic="answers", dead_letter_topic="dead-letters",
                    torch_threads=threads, linger_ms=5, prefix_reuse="off", log_level="warning")
    capacity = _capacity(base, model, seconds)
    setup: SchedulingSetup = {"path": "pipeline alone (no broker), consume loop's admission",
                             "seconds": seconds, "torch_threads": threads,
                             "capacity_per_s": round(capacity, 1),
                             "max_inflight_requests": base.batching.max_inflight_requests,
                             # How long the in-flight work takes to drain: past lane_ageing_ms, aged
                             # flood rows reach the high lane (docs/SCHEDULING.md).
                             "inflight_drain_s": round(base.batching.max_inflight_requests / capacity, 2),
                             "lane_pass_tokens": base.batching.lane_pass_tokens}
    return {"setup": setup, "lanes": _lanes(base, model, capacity, seconds, setup),  # which adds to setup
            "expired": _expired(base, model, expired), "tenants": _tenants(base, model, capacity, seconds)}


def scheduling_markdown(report: SchedulingReport) -> str:
    setup, lanes, expired, tenants = report["setup"], report["lanes"], report["expired"], report["tenants"]
    cap = setup["lane_pass_tokens"]
    lines = [
        f"Scheduling, {setup['path']} (max_inflight_requests={setup['max_inflight_requests']}), "
        f"torch_threads={setup['torch_threads']}, capacity {setup['capacity_per_s']:,.0f} requests/s, streams of "
        f"{setup['seconds']:g} s, lane_pass_tokens={'default' if cap is None else cap}, in-flight work drains in "
        f"{setup['inflight_drain_s']:g} s:",
        "",
        "| high stream (10 % of capacity) | p50 ms | p99 ms | flood answered/s | passes | padded tokens/pass |",
        "|---|---:|---:|---:|---:|---:|",
        *(f"| {name.replace('_', ' ')} | {row['p50_ms']:,.1f} | {row['p99_ms']:,.1f} | {row['flood_per_s']:,.1f} | "
          f"{row['passes']:,} | {row['padded_tokens_per_pass']:,} |" for name, row in lanes.items()),
        "",
        "Where the high stream's time goes, ms p50 / p99 of each stage (and the event loop's lag waking a 1 ms sleep):",
        "",
        f"| run | {' | '.join(stage.replace('_', ' ') for stage in STAGES)} | loop lag |",
        f"|---|{'---:|' * (len(STAGES) + 1)}",
        *(f"| {name.replace('_', ' ')} | "
          + " | ".join(f"{row['stages_ms'][stage]['p50']:,.1f} / {row['stages_ms'][stage]['p99']:,.1f}"
                       for stage in STAGES)
          + f" | {row['loop_lag_ms']['p50']:,.1f} / {row['loop_lag_ms']['p99']:,.1f} |" for name, row in lanes.items()),
        "",
        f"Expired burst: {expired['requests']} requests past their deadline, {expired['deadline_exceeded']} answered "
        f"deadline_exceeded, {expired['passes_run']} forward passes.",
        "",
        "| steady tenant (30 % of capacity) | answered/s in its window | vs alone | p99 ms |",
        "|---|---:|---:|---:|",
        *(f"| {name.replace('_', ' ')} | {row['steady_per_s']:,.1f} | {row.get('vs_alone', 1.0) or 0:.2f} | "
          f"{row['steady_p99_ms']:,.1f} |" for name, row in _tenant_runs(tenants)),
        f"(quota: {tenants['quota_tokens']:,} tokens per tenant)",
    ]
    return "\n".join(lines) + "\n"


def _tenant_runs(tenants: Tenants) -> list[tuple[str, TenantRun]]:
    """The steady tenant's runs in the report's order, by name."""
    return [("alone", tenants["alone"]), ("flood_quotas_off", tenants["flood_quotas_off"]),
            ("flood_quotas_on", tenants["flood_quotas_on"])]
