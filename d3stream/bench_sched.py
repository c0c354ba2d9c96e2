"""``d3stream bench --scheduling``: the figures of docs/SCHEDULING.md, side by side in one run.

Over **the request pipeline alone** (``RequestPipeline.serve`` of a ``Service`` that is never started: no
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
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from .config import Settings
from .events import HEADERS

FETCH = 64  # records handed to the pipeline at once (a fetch)
INTERACTIVE_SHARE = 0.10
STEADY_SHARE = 0.30
QUESTION = {"type": "noul", "instructions": "Is anything unusual visible?"}


def _record(rid: str, offset: int, **fields: Any) -> SimpleNamespace:
    body = {"id": rid, "state": {"text": f"ticket {rid}: the parcel arrived late"}, "questions": {"a": QUESTION},
            **fields}
    return SimpleNamespace(topic="bench", partition=0, offset=offset, key=rid.encode(),
                           value=json.dumps(body).encode(), headers=HEADERS, timestamp=int(time.time() * 1000))


class _Run:
    """One pipeline, fed arrivals on a schedule; the answer time of every id."""

    def __init__(self, settings: Settings, model: Any):
        from .service import Service

        self.service = Service(settings, model)
        self.answered: dict[str, float] = {}
        self.arrived: dict[str, float] = {}

    async def _served(self, served: list[Any]) -> None:
        now = time.perf_counter()
        for item in served:
            self.answered[item.answer.id] = now

    async def feed(self, arrivals: list[tuple[float, SimpleNamespace]]) -> float:
        """Hand each record over at its arrival (seconds from now), in fetches; seconds until all answered."""
        started = time.perf_counter()
        steps = []
        index = 0
        while index < len(arrivals):
            at = arrivals[index][0]
            fetch = [record for when, record in arrivals[index:index + FETCH] if when <= at + 0.001]
            index += len(fetch)
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            for record in fetch:
                self.arrived[json.loads(record.value)["id"]] = now
            steps.append(asyncio.ensure_future(self.service.pipeline.serve(fetch, self._served)))
        await asyncio.gather(*steps)
        return time.perf_counter() - started

    def latencies(self, prefix: str) -> list[float]:
        return sorted(self.answered[rid] - at for rid, at in self.arrived.items() if rid.startswith(prefix))

    def close(self) -> None:
        self.service.pipeline.close()
        self.service.fetcher.close()


def _run(settings: Settings, model: Any, arrivals: list[tuple[float, SimpleNamespace]]) -> tuple[_Run, float]:
    run = _Run(settings, model)

    async def go() -> float:
        try:
            return await run.feed(arrivals)
        finally:
            await run.service.passes.close()

    seconds = asyncio.run(go())
    run.close()
    return run, seconds


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _steady(prefix: str, rate: float, seconds: float, **fields: Any) -> list[tuple[float, SimpleNamespace]]:
    count = max(2, int(rate * seconds))
    return [(n / rate, _record(f"{prefix}{n}", n, **fields)) for n in range(count)]


def _burst(prefix: str, count: int, **fields: Any) -> list[tuple[float, SimpleNamespace]]:
    return [(0.0, _record(f"{prefix}{n}", 100_000 + n, **fields)) for n in range(count)]


def _merged(*streams: list[tuple[float, SimpleNamespace]]) -> list[tuple[float, SimpleNamespace]]:
    return sorted((item for stream in streams for item in stream), key=lambda item: item[0])


def scheduling_bench(model: Any, *, seconds: float = 6.0, threads: int | None = 1,
                     expired: int = 200) -> dict[str, Any]:
    """All three figures on ``model`` (a loaded model or a checkpoint path), each stream ``seconds`` long."""
    if not hasattr(model, "forward"):
        from .runtime.model import D3

        model = D3.from_pretrained(Path(model), device="cpu")
    base = Settings(metrics_port=None, answer_topic="answers", dead_letter_topic="dead-letters",
                    torch_threads=threads, linger_ms=5, prefix_reuse="off", log_level="warning")

    def settings(**changes: Any) -> Settings:
        return msgspec.structs.replace(base, **changes)

    calibration = max(FETCH, int(20 * seconds))
    _, took = _run(settings(), model, _burst("cal", calibration))
    capacity = calibration / took  # requests/s the worker sustains on this model and machine
    report: dict[str, Any] = {"setup": {"path": "pipeline alone (no broker)", "seconds": seconds,
                                        "torch_threads": threads, "capacity_per_s": round(capacity, 1)}}

    interactive = _steady("hi", INTERACTIVE_SHARE * capacity, seconds, priority="high")
    flood = _burst("flood", int(capacity * seconds), priority="low")
    lanes: dict[str, Any] = {}
    for name, arrivals, lanes_on in (("alone", interactive, True), ("flood_lanes_on", _merged(interactive, flood), True),
                                     ("flood_lanes_off", _merged(interactive, flood), False)):
        run, _ = _run(settings(priority_lanes=lanes_on), model, arrivals)
        latency = run.latencies("hi")
        lanes[name] = {"p50_ms": round(1000 * _quantile(latency, 0.5), 1),
                       "p99_ms": round(1000 * _quantile(latency, 0.99), 1), "requests": len(latency)}
    report["lanes"] = lanes

    run, _ = _run(settings(), model, _burst("late", expired, deadline=1_000))
    report["expired"] = {"requests": expired, "passes_run": run.service.scheduler.passes_run,
                         "deadline_exceeded": len(run.answered)}

    steady = _steady("steady", STEADY_SHARE * capacity, seconds, tenant="steady")
    flooding = _burst("flood", int(capacity * seconds), tenant="flood")
    # A quota of about two fetches' tokens of these requests: enough for the steady tenant's arrivals.
    tokens = model.prepare(json.loads(steady[0][1].value)["state"], {"a": QUESTION}).input_tokens
    tenants: dict[str, Any] = {"quota_tokens": 2 * FETCH * tokens}
    for name, arrivals, quota in (("alone", steady, 0), ("flood_quotas_off", _merged(steady, flooding), 0),
                                  ("flood_quotas_on", _merged(steady, flooding), 2 * FETCH * tokens)):
        run, _ = _run(settings(tenant_max_inflight_tokens=quota), model, arrivals)
        # Its throughput: what was answered while it was sending (a backlog answered later does not count).
        first = min(at for rid, at in run.arrived.items() if rid.startswith("steady"))
        done = [run.answered[rid] for rid in run.arrived if rid.startswith("steady")]
        within = sum(1 for at in done if at <= first + seconds)
        tenants[name] = {"steady_per_s": round(within / seconds, 1),
                         "steady_p99_ms": round(1000 * _quantile(run.latencies("steady"), 0.99), 1)}
    for name in ("flood_quotas_off", "flood_quotas_on"):
        alone = tenants["alone"]["steady_per_s"]  # 0 only on runs too short to answer within the window
        tenants[name]["vs_alone"] = round(tenants[name]["steady_per_s"] / alone, 3) if alone else None
    report["tenants"] = tenants
    return report


def scheduling_markdown(report: dict[str, Any]) -> str:
    setup, lanes, expired, tenants = report["setup"], report["lanes"], report["expired"], report["tenants"]
    lines = [
        f"Scheduling, {setup['path']}, torch_threads={setup['torch_threads']}, capacity "
        f"{setup['capacity_per_s']:,.0f} requests/s, streams of {setup['seconds']:g} s:",
        "",
        "| high stream (10 % of capacity) | p50 ms | p99 ms |",
        "|---|---:|---:|",
        *(f"| {name.replace('_', ' ')} | {row['p50_ms']:,.1f} | {row['p99_ms']:,.1f} |" for name, row in lanes.items()),
        "",
        f"Expired burst: {expired['requests']} requests past their deadline, {expired['deadline_exceeded']} answered "
        f"deadline_exceeded, {expired['passes_run']} forward passes.",
        "",
        "| steady tenant (30 % of capacity) | answered/s in its window | vs alone | p99 ms |",
        "|---|---:|---:|---:|",
        *(f"| {name.replace('_', ' ')} | {row['steady_per_s']:,.1f} | {row.get('vs_alone', 1.0) or 0:.2f} | "
          f"{row['steady_p99_ms']:,.1f} |" for name, row in tenants.items() if isinstance(row, dict)),
        f"(quota: {tenants['quota_tokens']:,} tokens per tenant)",
    ]
    return "\n".join(lines) + "\n"
