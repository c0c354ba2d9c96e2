"""``d3stream bench BENCHMARK``: one subcommand per benchmark (``d3stream/benchmarks/``, one module each).

    d3stream bench workloads         the reference per-request path against batching and prefix reuse
    d3stream bench kafka [N]         the Kafka path with a null model against raw aiokafka
    d3stream bench soak [N]          RSS over N small requests
    d3stream bench soak-images [N]   RSS over N large-image requests, then three at once, then idle
    d3stream bench evaluate [N]      d3stream evaluate's join rate and its state per 100,000 answers
    d3stream bench evaluate-volume [N]   the evaluator at production volume: ingest, join, restart, restore
    d3stream bench ask [N]           the client's ask() against a worker, both delivery modes
    d3stream bench head-of-line [S]  text requests behind slow-store image requests
    d3stream bench stream [N]        an operator's stream through d3stream against aiokafka + system_one
    d3stream bench scheduling [S]    priority lanes, deadlines and tenant quotas over the pipeline
    d3stream bench too-large [N]     one request of N questions whose answer is too large for its topic
    d3stream bench host              the worker's host path with a stand-in backbone: CPU per question by stage
    d3stream bench fleet             a fleet of workers through a rolling restart and a scale 2 -> 4 -> 2

Each prints its table (``--json``: one JSON object; ``--out FILE`` keeps it). Figures and their history:
docs/MEASUREMENTS.md; what each measures: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from d3stream.cli.shape import Command, HelpFormatter, show_defaults
from d3stream.dev.progress import Progress

# What a benchmark's run returns: its report (a JSON object) and its table.
Outcome = tuple[Mapping[str, object], str]


@dataclass(frozen=True)
class Benchmark:
    """One ``d3stream bench`` subcommand: its name, help, arguments and what it runs (a report and its text)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Outcome]


# ------------------------------------------------------------------------------------------- shared


def _common(parser: argparse.ArgumentParser, *, checkpoint: bool = True, threads: bool = True) -> None:
    """The options every benchmark has: --json, --out, --no-progress; most take a checkpoint and threads."""
    if checkpoint:
        parser.add_argument("--checkpoint", metavar="DIR",
                            help="checkpoint directory (default: the tiny demo checkpoint)")
    if threads:
        parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON report here")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(progress=sys.stderr.isatty())


def _count(parser: argparse.ArgumentParser, default: float, what: str, kind: type[int] | type[float] = int) -> None:
    parser.add_argument("count", type=kind, nargs="?", default=default, metavar="N" if kind is int else "SECONDS",
                        help=what)


def _checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    from d3stream.dev.demo import demo_checkpoint

    return demo_checkpoint(progress=args.progress)


class _Bar(Progress, Protocol):
    """A tqdm bar as the commands below use it: also in a with-block, and its count and total read."""

    n: float
    total: float

    def __enter__(self) -> _Bar: ...

    def __exit__(self, *exc: object) -> None: ...


def _stepper(bar: Progress) -> Callable[[str], None]:
    """A progress callback called as each run or step of a benchmark starts: the previous one is done."""
    started: list[str] = []

    def step(name: str) -> None:
        bar.update(1 if started else 0)
        started.append(name)
        bar.set_postfix_str(name)

    return step


def _bar(args: argparse.Namespace, total: int, desc: str, unit: str = "step") -> _Bar:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not args.progress)


# -------------------------------------------------------------------------------------- the workloads


def _workloads_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.benchmarks.bench import DEFAULT_RATE_SHARE, H200_BF16_PEAK_TFLOPS, VARIANTS, WORKLOADS

    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    parser.add_argument("--calibrate", action="store_true",
                        help="sweep more batch shapes, print the best max_batch_tokens for the device and use it")
    parser.add_argument("--sweep", choices=("quick", "default"), default="default",
                        help="calibration grid without --calibrate (quick: 4 shapes, for smoke tests)")
    parser.add_argument("--requests", type=int, default=None, help="requests per workload (default: per workload)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the default request counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="throughput rounds per path, interleaved; each path reports its fastest round")
    parser.add_argument("--rate", type=float, default=None,
                        help=f"arrival rate in requests/s (default: {DEFAULT_RATE_SHARE * 100:.0f} %% of what path a sustains)")
    parser.add_argument("--linger-ms", type=float, default=5.0, help="scheduler linger for paths b and c")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="padded tokens per pass for b and c (default: the service's default for the device)")
    parser.add_argument("--max-batch-rows", type=int, default=64)
    parser.add_argument("--verify-every", type=int, default=0,
                        help="path c: also run every Nth question from scratch (exact-replay check)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help=f"device peak for MFU (default on CUDA: H200 bf16 dense, {H200_BF16_PEAK_TFLOPS:g})")
    parser.add_argument("--variant", dest="variants", action="append", choices=tuple(VARIANTS), default=[],
                        help="also run path b this way, throughput side by side with b (repeatable): "
                        + "; ".join(f"{name}: {text}" for name, text in VARIANTS.items()))
    parser.add_argument("--markdown", metavar="FILE", help="also write the Markdown tables here")
    _common(parser)


def _workloads(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench import markdown, report_of, run_bench

    runs, calibration = run_bench(args)
    table = markdown(runs, calibration if args.calibrate else None)
    if args.markdown:
        Path(args.markdown).write_text(table, encoding="utf-8")
    if args.calibrate:
        print(f"best max_batch_tokens for {runs[next(iter(runs))].setup['device']}: "
              f"{calibration['max_batch_tokens']} (serve with --max-batch-tokens {calibration['max_batch_tokens']})",
              file=sys.stderr)
    return report_of(runs), table


# -------------------------------------------------------------------------------- on the embedded stack


def _kafka(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks import bench_service

    with _bar(args, 4, "kafka", "run") as bar:
        report = bench_service.kafka_overhead(args.count, progress=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, bench_service.kafka_markdown(report)


def _soak(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks import bench_service

    root = _checkpoint(args)
    with _bar(args, args.count, "soak", "req") as bar:
        def tick(answered: int) -> None:
            bar.update(answered - bar.n)

        soak = bench_service.rss_soak(root, args.count, threads=args.threads or 1, tick=tick)
    return soak, (
        f"RSS soak, {soak['requests']:,} requests ({soak['events_per_s']:,.0f}/s): "
        f"{soak['rss_mb_first_tenth']:,.0f} MB after the first tenth, {soak['rss_mb_halfway']:,.0f} MB halfway, "
        f"{soak['rss_mb_at_end']:,.0f} MB at the end: second half {soak['growth_second_half']:+.1%} "
        f"({'flat' if soak['flat_within_5pct'] else 'NOT flat'} within 5 %), since the first tenth "
        f"{soak['growth_since_first_tenth']:+.1%}.")


def _soak_images(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_memory import image_soak, image_soak_markdown, progress_steps

    root = _checkpoint(args)
    with _bar(args, progress_steps(args.count), "soak-images") as bar:
        def stage(name: str) -> None:
            bar.update(1)
            bar.set_postfix_str(name)

        report = image_soak(root, args.count, tick=stage)
    return report, image_soak_markdown(report)


def _evaluate(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_evaluate import evaluate_bench, evaluate_markdown

    report = evaluate_bench(args.count)
    return report, evaluate_markdown(report)


def _evaluate_volume(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_evaluate import volume_bench, volume_markdown

    with _bar(args, 5, "evaluate-volume") as bar:
        report = volume_bench(args.count, tick=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, volume_markdown(report)


def _ask(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_ask import ask_latency, ask_markdown

    report = ask_latency(_checkpoint(args), args.count, threads=args.threads or 1)
    return report, ask_markdown(report)


def _head_of_line(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_ordering import head_of_line, head_of_line_markdown

    report = head_of_line(_checkpoint(args), seconds=args.count, threads=args.threads or 1)
    return report, head_of_line_markdown(report)


def _stream_arguments(parser: argparse.ArgumentParser) -> None:
    _count(parser, 300, "requests in the stream, 1 in 10 with images")
    parser.add_argument("--repeat", type=int, default=2, help="measured rounds of each run, after a warm-up (2 or more)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=1, metavar="K", help="each image request carries 1 to K images")
    _common(parser)


def _stream(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_stream import RUNS, stream_bench, stream_markdown

    rounds = max(2, args.repeat)
    with _bar(args, len(RUNS) * (rounds + 1), "stream", "run") as bar:
        report = stream_bench(_checkpoint(args), args.count, rounds=rounds, seed=args.seed, threads=args.threads,
                              images_per_request=args.images, progress=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, stream_markdown(report)


def _scheduling(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks import bench_sched

    report = bench_sched.scheduling_bench(_checkpoint(args), seconds=args.count, threads=args.threads or 1)
    return report, bench_sched.scheduling_markdown(report).rstrip("\n")


def _too_large(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_too_large import too_large_bench, too_large_markdown

    report = too_large_bench(_checkpoint(args), args.count, threads=args.threads or 1)
    return report, too_large_markdown(report).rstrip("\n")


def _host_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.benchmarks.bench_host import DEFAULT_REQUESTS, GPU_BATCH_TOKENS, WORKLOADS

    defaults = ", ".join(f"{name} {count:,}" for name, count in DEFAULT_REQUESTS.items())
    parser.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all",
                        help="small: text-only small requests; shared: long shared states; images: a mix with images")
    parser.add_argument("--requests", type=int, default=None, help=f"requests per workload (default: {defaults})")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the default request counts")
    parser.add_argument("--delivery", choices=("exactly_once", "at_least_once", "both"), default="both")
    parser.add_argument("--format", choices=("json", "avro", "both"), default="both",
                        help="requests and answers as JSON, or as Avro through the embedded Schema Registry")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="device time of each backbone call, spent sleeping (0: hidden states at once)")
    parser.add_argument("--device-tokens-per-s", type=float, default=0.0, metavar="RATE",
                        help="also sleep each call's padded tokens at this rate (250000: an H100 on the 0.8B "
                        "backbone; 0: off)")
    parser.add_argument("--max-batch-tokens", type=int, default=GPU_BATCH_TOKENS,
                        help="padded tokens per pass (default: the worker's GPU default)")
    parser.add_argument("--rounds", type=int, default=1, help="measured runs of each configuration, in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the unmeasured run per workload and format")
    _common(parser)


def _host(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_host import (
        DEFAULT_REQUESTS,
        DELIVERIES,
        FORMATS,
        WORKLOADS,
        host_bench,
        host_markdown,
    )

    workloads = tuple(WORKLOADS) if args.workload == "all" else (args.workload,)
    deliveries = DELIVERIES if args.delivery == "both" else (args.delivery,)
    formats = FORMATS if args.format == "both" else (args.format,)
    requests = {name: args.requests or max(1, round(DEFAULT_REQUESTS[name] * args.scale)) for name in workloads}
    runs = len(workloads) * len(formats) * (len(deliveries) * args.rounds + (1 if args.warm_up else 0))
    checkpoint = _checkpoint(args)
    with _bar(args, runs, "host", "run") as bar:
        report = host_bench(checkpoint, workloads=workloads, deliveries=deliveries, formats=formats,
                            requests=requests, device_ms=args.device_ms, device_tokens_per_s=args.device_tokens_per_s,
                            rounds=args.rounds, seed=args.seed, threads=args.threads or 1,
                            max_batch_tokens=args.max_batch_tokens, warm_up=args.warm_up, progress=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, host_markdown(report)


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.benchmarks.fleet import FleetShape

    shape = FleetShape()
    parser.add_argument("--workers", type=int, default=shape.workers,
                        help="workers at full size; the rolling restart restarts each")
    parser.add_argument("--scale-from", type=int, default=shape.scale_from,
                        help="workers before the scale-up and after the scale-down (--workers: no scale events)")
    parser.add_argument("--partitions", type=int, default=shape.partitions, help="partitions of the request topic")
    parser.add_argument("--device-ms", type=float, default=shape.device_ms,
                        help="device time of one forward pass (the stand-in model sleeps it)")
    parser.add_argument("--batch-rows", type=int, default=shape.batch_rows,
                        help="rows (here: requests) per pass (max_batch_rows)")
    parser.add_argument("--max-inflight", type=int, default=shape.max_inflight,
                        help="requests in flight per worker (max_inflight_requests)")
    parser.add_argument("--steady-s", type=float, default=shape.steady_s, help="seconds of each steady window")
    parser.add_argument("--backlog", type=int, default=None,
                        help="requests kept published and unanswered (default: 3 s of the whole fleet's capacity)")
    parser.add_argument("--delivery", choices=("exactly_once", "at_least_once"), default=shape.delivery)
    parser.add_argument("--static", action="store_true",
                        help="static membership: each worker keeps a group_instance_id across its restarts")
    parser.add_argument("--rollout", choices=("surge", "stop_first"), default=None,
                        help="how the rolling restart replaces a worker: surge starts the new process before the old "
                        "one stops (deploy/k8s: maxSurge 1, maxUnavailable 0); stop_first stops it first (maxSurge 0, "
                        "maxUnavailable 1). Default: surge, stop_first with --static (a replacement beside the "
                        "worker would take its group_instance_id)")
    parser.add_argument("--keep", dest="keep_partitions", action=argparse.BooleanOptionalAction,
                        default=shape.keep_partitions,
                        help="the workers keep what a rebalance hands back (rebalance_keep_partitions, their "
                        "default; exactly_once only: at_least_once drains); --no-keep: they drain and close every "
                        "partition at every rebalance")
    parser.add_argument("--heartbeat-ms", type=int, default=None,
                        help="the workers' heartbeat_interval_ms (default: theirs, 3 s)")
    parser.add_argument("--session-timeout-ms", type=int, default=shape.session_timeout_ms)
    parser.add_argument("--commit-interval-ms", type=int, default=shape.commit_interval_ms)
    parser.add_argument("--load-s", type=float, default=shape.load_s,
                        help="seconds each worker start spends as a checkpoint's load would")
    parser.add_argument("--logs", metavar="DIR", help="the workers' logs go here (default: a temporary folder)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning"), default=shape.log_level,
                        help="the workers' log level (debug: aiokafka's requests too, to chase a fault)")
    _common(parser, checkpoint=False, threads=False)


def _fleet(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.fleet import FleetShape, fleet_bench, fleet_markdown

    shape = FleetShape(workers=args.workers, scale_from=args.scale_from, partitions=args.partitions,
                       device_ms=args.device_ms, batch_rows=args.batch_rows, max_inflight=args.max_inflight,
                       steady_s=args.steady_s, backlog=args.backlog, delivery=args.delivery, static=args.static,
                       rollout=args.rollout or ("stop_first" if args.static else FleetShape.rollout),
                       keep_partitions=args.keep_partitions, heartbeat_ms=args.heartbeat_ms,
                       session_timeout_ms=args.session_timeout_ms, commit_interval_ms=args.commit_interval_ms,
                       load_s=args.load_s, log_level=args.log_level)
    folder = Path(args.logs) if args.logs else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    with _bar(args, 8, "fleet") as bar:
        report = fleet_bench(shape, folder=folder, progress=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, fleet_markdown(report)


def _servers(args: argparse.Namespace) -> Outcome:
    from d3stream.benchmarks.bench_servers import RUNS, SERVERS, servers_bench, servers_markdown

    with _bar(args, len(SERVERS) * len(RUNS), "servers") as bar:
        report = servers_bench(args.count, progress=_stepper(bar))
        bar.update(bar.total - bar.n)
    return report, servers_markdown(report)


def _counted(default: float, what: str, kind: type[int] | type[float] = int,
             **common: bool) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        _count(parser, default, what, kind)
        _common(parser, **common)

    return add


BENCHMARKS = (
    Benchmark("workloads", "the reference per-request path against d3stream's batching and shared-prefix reuse, "
              "on synthetic workloads (bench/README.md)", _workloads_arguments, _workloads),
    Benchmark("kafka", "the Kafka path with a null model against raw aiokafka consume->produce, on an embedded "
              "broker", _counted(20_000, "small requests", checkpoint=False, threads=False), _kafka),
    Benchmark("soak", "serve small requests with the checkpoint and report whether the resident set size stays flat",
              _counted(100_000, "small requests"), _soak),
    Benchmark("soak-images", "requests of six 16-megapixel PNGs one at a time, then three at once, on one worker "
              "with the default settings: its RSS at each peak, after each answer and at idle (docs/MEMORY.md)",
              _counted(20, "large-image requests", threads=False), _soak_images),
    Benchmark("evaluate", "d3stream evaluate's join rate on an embedded broker, and its state per 100,000 waiting "
              "answers", _counted(20_000, "answers and their labels", checkpoint=False, threads=False), _evaluate),
    Benchmark("evaluate-volume", "d3stream evaluate at production volume: one worker with the default settings takes "
              "in answers stamped over three days, joins labels spread over them, restarts cleanly and restores "
              "after a crash; rates, memory and disk",
              _counted(2_000_000, "answers", checkpoint=False, threads=False), _evaluate_volume),
    Benchmark("ask", "asks (20/s) of the client's ask() against a worker on an embedded broker, beside the worker's "
              "own end-to-end latency, in both delivery modes", _counted(300, "asks"), _ask),
    Benchmark("head-of-line", "text requests behind slow-store image requests on the same partitions: ordering key "
              "and partition against a fast store", _counted(20.0, "seconds of each stream", float), _head_of_line),
    Benchmark("stream", "an operator's stream through d3stream against an aiokafka loop calling system_one per "
              "request, text only and mixed, on an embedded broker and store", _stream_arguments, _stream),
    Benchmark("scheduling", "priority lanes, expired requests and tenant quotas over the request pipeline (no "
              "broker; docs/SCHEDULING.md)", _counted(6.0, "seconds of each stream", float), _scheduling),
    Benchmark("too-large", "one request of N questions whose answer is over the answer topic's limit, through the "
              "pipeline (no broker): seconds to its answer_too_large answer, the model's share of them, and what "
              "sizing the answer costs in JSON and Avro", _counted(12_000, "questions in the request"), _too_large),
    Benchmark("host", "the worker's real host path (Kafka, checks, media, prompts and tokenizing, packing, readout, "
              "answers, framing) with a stand-in for the backbone's forward: CPU per question by stage, the "
              "stand-in's busy share and the rate an H100 would need (docs/GPU.md)", _host_arguments, _host),
    Benchmark("fleet", "a fleet of worker processes with a model that sleeps a fixed device time per pass, through "
              "a rolling restart and a scale 2 -> 4 -> 2 on an embedded broker: each event's throughput over "
              "steady, seconds each worker was paused, rebalances, lost and repeated answers",
              _fleet_arguments, _fleet),
    Benchmark("servers", "each embedded server (Kafka, S3Proxy, the Schema Registry) started and stopped without and "
              "with a class-data archive of its classes: CPU and seconds per start, as the test suite's sixty "
              "starts pay them (d3stream/dev/infra/class_data.py)",
              _counted(3, "starts of each server without and with its archive", checkpoint=False, threads=False),
              _servers),
)


# -------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for benchmark in BENCHMARKS:
        sub = benchmarks.add_parser(benchmark.name, help=benchmark.help, description=benchmark.help,
                                    formatter_class=HelpFormatter)
        benchmark.add_arguments(sub)
        sub.set_defaults(benchmark_run=benchmark.run)
        show_defaults(sub)


def _run(args: argparse.Namespace) -> int:
    from d3stream.ops.logs import configure_logging

    configure_logging(level="warning")  # a line per commit would drown the figures
    report, table = args.benchmark_run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report) if args.json else table.rstrip("\n"))
    return 0


COMMAND = Command("bench", "measure: one subcommand per benchmark (d3stream bench BENCHMARK --help)", add_arguments,
                  _run, description="Measure: one subcommand per benchmark, each a module of d3stream/benchmarks/. "
                  "Each prints its table; --json prints the report as one JSON object, --out FILE keeps it.")
