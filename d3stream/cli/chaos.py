"""``d3stream chaos``: the reliability report (benchmarks/chaos.py): a stream served while workers are killed,
the broker restarted and the object store taken down, every answer counted."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import get_args

from d3stream.cli.shape import Command
from d3stream.settings import DeliveryName


def _chaos(args: argparse.Namespace) -> int:
    from d3stream.benchmarks.chaos import delivery_costs, iter_table, run_chaos
    from d3stream.ops.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    if args.delivery_costs:
        rows = asyncio.run(delivery_costs(requests=args.requests, rate=args.rate))
        if args.json:
            print(json.dumps(rows))
        else:
            print("| mode | stream | answers/s | latency p50 (ms) | latency p99 (ms) |\n|---|---|---|---|---|")
            for row in rows:
                stream = "flood" if row["rate"] is None else f"{row['rate']:g} req/s"
                print(f"| {row['mode']} | {row['requests']} requests, {stream} | {row['answers_per_s']} | "
                      f"{row['latency_ms_p50']} | {row['latency_ms_p99']} |")
        return 0
    report = asyncio.run(run_chaos(requests=args.requests, fuzzed=args.fuzzed, kills=args.kills, mode=args.mode,
                                   seed=args.seed, timeout_s=args.timeout,
                                   progress=not args.json and sys.stderr.isatty()))
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(iter_table(report)))
    from d3stream.kafka.commits import DELIVERY_MODES

    # Nothing may be lost in any mode; a transactional mode also promises no duplicates.
    promise_kept = report["lost"] == 0 and (not DELIVERY_MODES[args.mode].transactional or report["duplicated"] == 0)
    return 0 if promise_kept else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10_000, help="valid requests in the stream")
    parser.add_argument("--fuzzed", type=int, default=10_000, help="hostile or malformed events in the stream")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILL/restart cycles of the worker")
    parser.add_argument("--mode", choices=get_args(DeliveryName), default="exactly_once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for every answer")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--delivery-costs", action="store_true",
                        help="instead: measure both delivery modes on the same stream (throughput, latency)")
    parser.add_argument("--rate", type=float, default=100.0, help="arrival rate for the latency run of --delivery-costs")


COMMAND = Command("chaos", "reliability report: serve a stream while killing workers, restarting the broker and "
                  "taking the object store down; count every answer", add_arguments, _chaos)
