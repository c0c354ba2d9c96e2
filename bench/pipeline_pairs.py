"""The null-model pipeline's CPU per request, two checkouts side by side at the same time: a change of a few percent
that sequential runs on a shared 2-core machine cannot see (its speed moves by a fifth from hour to hour).

Each pair runs two processes at once, one per checkout (``PYTHONPATH`` set to it), so whatever slows the machine
slows both. Each process answers ``--requests`` small requests of ``d3stream bench kafka`` through the request
pipeline alone (``RequestPipeline.answer`` of a ``Service`` that is never started: no broker), with the null model,
in fetches of 4,096 as the Kafka path reads them, two fetches in flight, ``--repeats`` times, and keeps the least
CPU per request of all but the first repetition (process CPU: the event loop, the prepare and model threads). An
A/A pair (one checkout against itself) differed by 1-2 % on the 2-core machine (docs/MEASUREMENTS.md, session 27).

    python bench/pipeline_pairs.py BASE [NEW] [--pairs 3] [--requests 20000] [--repeats 8]

``BASE`` and ``NEW`` are checkouts of this repository (a ``git worktree add`` of the commit to compare against;
``NEW`` defaults to this one). Prints each pair's figures and the median change.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

FETCH = 4096  # records a fetch brings at most in bench kafka (max_inflight_requests)


def measure(requests: int, repeats: int) -> float:
    """Least CPU µs per request of the pipeline alone over ``repeats`` repetitions, the first left out (in the
    checkout this process imports)."""
    from d3stream_client.contract import HEADERS

    from d3stream.benchmarks.bench_sched import BenchRecord
    from d3stream.benchmarks.bench_service import NullModel, small_requests
    from d3stream.core.record import RequestRecord
    from d3stream.service import Service
    from d3stream.settings import Settings

    now = int(time.time() * 1000)
    records = [BenchRecord("bench", n % 4, n // 4, key, value, HEADERS, now)
               for n, (key, value) in enumerate(small_requests(requests))]
    settings = Settings.from_flat(bootstrap_servers="127.0.0.1:1", request_topics=["bench"], answer_topic="answers",
                                  metrics_port=None, log_level="warning", max_inflight_requests=FETCH, linger_ms=2)
    drops = hasattr(RequestRecord, "drop_delivered")  # as FetchHandler._deliver does, where the checkout has it

    async def run() -> list[float]:
        service = Service(settings, NullModel())
        pipeline = service.pipeline

        async def fetch(chunk: list[BenchRecord]) -> None:
            async for answered in pipeline.answer(chunk):
                service.ledger.delivered(answered)
                if drops:
                    for record in answered:
                        record.drop_delivered()

        figures = []
        for _ in range(repeats):
            started = time.process_time()
            pending: list[asyncio.Future[None]] = []
            for at in range(0, requests, FETCH):
                pending.append(asyncio.ensure_future(fetch(records[at:at + FETCH])))
                if len(pending) >= 2:
                    await pending.pop(0)
            for each in pending:
                await each
            figures.append(1e6 * (time.process_time() - started) / requests)
        return figures

    gc.freeze()  # as a serving worker does (ops/collector.py)
    gc.set_threshold(1_000_000)
    figures = asyncio.run(run())
    return min(figures[1:] or figures)


def _pair(base: Path, new: Path, requests: int, repeats: int) -> tuple[float, float]:
    processes = []
    for checkout in (base, new):
        environment = dict(os.environ, PYTHONPATH=f"{checkout}{os.pathsep}{checkout / 'clients' / 'python'}")
        processes.append(subprocess.Popen(
            [sys.executable, __file__, "--child", "--requests", str(requests), "--repeats", str(repeats)],
            env=environment, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    figures = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"a measuring process failed (exit status {process.returncode})")
        figures.append(float(json.loads(out.strip().splitlines()[-1])["cpu_us_per_request"]))
    return figures[0], figures[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", type=Path, help="the checkout to compare against")
    parser.add_argument("new", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout with the change (default: this one)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"cpu_us_per_request": measure(args.requests, args.repeats)}))
        return
    if args.base is None:
        parser.error("name the checkout to compare against (BASE)")
    changes = []
    print(f"pipeline alone, null model, {args.requests:,} requests, CPU µs per request (least of {args.repeats - 1}):")
    for number in range(1, args.pairs + 1):
        before, after = _pair(args.base.resolve(), args.new.resolve(), args.requests, args.repeats)
        changes.append(after / before - 1)
        print(f"  pair {number}: base {before:.1f}, new {after:.1f} ({100 * changes[-1]:+.1f} %)", flush=True)
    print(f"median change: {100 * statistics.median(changes):+.1f} %")


if __name__ == "__main__":
    main()
