"""Service-side commands: ``serve``, ``produce``, ``consume`` and ``demo``; registered by the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any, get_args

from d3stream.config import DeliveryMode

# The exit status of `d3stream serve` after a worker-fatal error (2 is a configuration error).
WORKER_FATAL_EXIT = 3


def _serve(args: argparse.Namespace) -> int:
    from d3stream.config import load_settings
    from d3stream.kafka.connection import check_connection
    from d3stream.ops.logs import configure_logging

    try:
        settings = load_settings(args)
        check_connection(settings)
    except ValueError as exc:
        print(f"d3stream serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    if not settings.model and not settings.model_source:
        print("d3stream serve: no checkpoint: set --model (or --model-source), D3STREAM_MODEL or model = ... in the "
              "settings file", file=sys.stderr)
        return 2
    from d3stream.models.checkpoints import CheckpointError
    from d3stream.ops.metrics import Metrics, serve_metrics
    from d3stream.service import Service

    # The endpoint comes up before the models are downloaded and loaded, so a liveness probe sees a live
    # process meanwhile.
    metrics = Metrics()
    server = serve_metrics(metrics, settings)
    try:
        models, shadow = _load_models(settings)
        service = Service(settings, models, metrics=metrics, shadow=shadow)
    except (CheckpointError, ValueError) as exc:  # also: two models of one name, prefix_reuse=on on a non-causal one
        print(f"d3stream serve: {exc}", file=sys.stderr)
        if server is not None:
            server.stop()
        return 2
    _log_kernel_notice([*models, *([shadow] if shadow is not None else [])])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, service.stop)
        await service.run()

    from d3stream.kafka.limits import WorkerFatal

    try:
        asyncio.run(main())
    except WorkerFatal as exc:  # e.g. no permission on the answer topic: a restart would not help by itself
        import structlog

        # A log line like every other (JSON with --log-format json), not a bare print.
        structlog.get_logger("d3stream.serve").error("d3stream serve stopped", error=str(exc),
                                                     exit_status=WORKER_FATAL_EXIT)
        return WORKER_FATAL_EXIT
    finally:
        if server is not None:
            server.stop()
    return 0


def _log_kernel_notice(models: list[Any]) -> None:
    """Say once, at ``info``, when the models run transformers' reference Gated DeltaNet kernels: the logging
    set-up puts transformers' own warnings about it at ``debug`` (ops/logs.py)."""
    import structlog

    from d3stream.ops.logs import kernel_notice

    notices = dict.fromkeys(kernel_notice(model.kernel_record(), str(model.device)) for model in models)
    for notice in notices:
        if notice:
            structlog.get_logger("d3stream.serve").info(notice)


def _load_models(settings: Any) -> tuple[list[Any], Any | None]:
    """Every ``--model`` of serve, the first the default, and a ``--shadow NAME=PATH`` checkpoint (None: no
    shadow, or a served model's name): made local (s3:// fetched and verified), their weights checked to fit
    the device together (``model_memory_bytes``) before any is loaded, then loaded (and warmed up with
    ``warmup``). With ``model_source`` its pointer's current checkpoint (and canary) come first, the default
    (rollout.py). CheckpointError / ValueError name what is wrong."""
    from d3stream.models.checkpoints import (
        check_models_fit,
        checkpoint_memory_bytes,
        model_name_for,
        parse_model_specs,
        resolve_model,
    )
    from d3stream.models.shadow import parse_shadow
    from d3stream.runtime import D3

    specs = parse_model_specs(settings.model)  # a name given twice is refused before any download
    shadow = parse_shadow(settings.shadow) if settings.shadow else None
    texts = list(settings.model)
    if shadow is not None and shadow.location is not None:  # a checkpoint of its own: loaded and checked alike
        specs.append(parse_model_specs([settings.shadow])[0])
        texts.append(settings.shadow)
    resolved = [resolve_model(text, settings) for text in texts]
    names: list[str | None] = [each.name for each in resolved]
    if settings.model and not settings.model_source:  # model_name names the default; a source's names itself
        names[0] = model_name_for(resolved[0], settings.model_name)
    device = settings.device or ("cuda:0" if _cuda_available() else "cpu")
    check_models_fit({name or spec.location: checkpoint_memory_bytes(each.path)
                      for name, spec, each in zip(names, specs, resolved, strict=True)},
                     device, settings.model_memory_bytes)
    models = []
    if settings.model_source:
        from d3stream.models.rollout import load_source_models

        models.extend(load_source_models(settings, beside=[each.path for each in resolved]))
    for name, each in zip(names, resolved, strict=True):
        models.append(D3.from_pretrained(each.path, device=settings.device, verify=settings.verify,
                                         model_name=name, permutation_average=settings.permutation_average))
    if settings.warmup:
        for model in models:
            model.warmup()
    if len(texts) > len(settings.model):  # the last one loaded is the shadow's checkpoint
        return models[:-1], models[-1]
    return models, None


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _connection(command: str, args: argparse.Namespace) -> Any:
    """The Kafka connection settings of a client command (flags, environment, settings file); None after
    printing why they are unusable."""
    from d3stream.config import load_settings
    from d3stream.kafka.connection import check_connection

    try:
        settings = load_settings(args)
        check_connection(settings)
        return settings
    except ValueError as exc:
        print(f"d3stream {command}: {exc}", file=sys.stderr)
        return None


def _run_kafka(command: str, settings: Any, step: Any) -> int:
    """Run a client command's coroutine; a connection refusal prints the setting to change, exit status 2."""
    from d3stream.kafka.connection import connecting

    try:
        asyncio.run(connecting(settings, step))
    except (ConnectionError, ValueError) as exc:
        print(f"d3stream {command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _record(line: str) -> tuple[bytes | None, bytes]:
    """(key, value) of one JSON line, keyed by its ``id``; a line that is not a JSON object is sent verbatim
    without a key (``produce`` publishes what the file holds: the worker answers what is not a request)."""
    try:
        document = json.loads(line)
    except json.JSONDecodeError:
        return None, line.encode("utf-8", "surrogateescape")
    key = document.get("id") if isinstance(document, dict) else None
    return (str(key).encode() if key is not None else None), line.encode("utf-8")


def _produce(args: argparse.Namespace) -> int:
    from d3stream_client.media import rewrite_media
    from d3stream_client.publisher import produce
    from tqdm import tqdm

    from d3stream.kafka.connection import client_options

    settings = _connection("produce", args)
    if settings is None:
        return 2
    source = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
    with source:
        lines = [line for line in (raw.rstrip("\n") for raw in source) if line.strip()]
    client = None
    if args.upload_media:
        import boto3

        client = boto3.client("s3", endpoint_url=args.s3_endpoint_url)
    base = Path(args.file).parent if args.file != "-" else Path.cwd()
    records = []
    for line in lines:
        key, value = _record(line)
        if client is not None and key is not None:
            request = rewrite_media(json.loads(value), client, args.upload_media, base)
            value = json.dumps(request, ensure_ascii=False).encode()
        records.append((key, value))
    bar = tqdm(total=len(records), desc=f"produce {args.topic}", unit="req", file=sys.stderr,
               disable=not sys.stderr.isatty())
    options = client_options(settings, "producer", client_id=settings.client_id)
    servers = options.pop("bootstrap_servers")
    status = _run_kafka("produce", settings, produce(servers, args.topic, records, security=options,
                                                     on_sent=bar.update))
    bar.close()
    if status == 0:
        print(f"published {len(records)} records to {args.topic}", file=sys.stderr)
    return status


def _consume(args: argparse.Namespace) -> int:
    from d3stream_client.subscriber import consume_answers

    from d3stream.kafka.connection import client_options

    settings = _connection("consume", args)
    if settings is None:
        return 2
    options = client_options(settings, "consumer", client_id=settings.client_id)
    servers = options.pop("bootstrap_servers")

    def show(answer: dict) -> None:
        print(json.dumps(answer, ensure_ascii=False), flush=True)

    return _run_kafka("consume", settings, consume_answers(servers, args.topic, expected=args.max,
                                                           timeout_s=args.timeout, idle_s=args.idle,
                                                           security=options, on_record=show))


def _brief(value: dict) -> str:
    """One answer slot as a short text: the choice with its probability, p(true), the score, or the error."""
    if "error" in value:
        return value["error"]
    if value.get("type") == "choice":
        return f"{value['choice']} ({value['probabilities'][value['choice']]:.2f})"
    if value.get("type") == "noul":
        return f"p(true) {value['noul']:.2f}"
    return f"{value.get('score', 0):.2f} of {len(value.get('probabilities') or {}) - 1}"


def _print_reevaluation(figures: dict) -> None:
    trained, baseline = figures["checkpoints"]
    print(f"\nre-evaluation: the {figures['labelled']} labelled questions replayed through a second checkpoint"
          f" and compared with their labels (as `d3stream compare --labels` does)")
    print(f"{'checkpoint':<36}{'accuracy':>10}{'Brier':>8}{'ECE':>8}")
    for index, name in enumerate((trained, baseline)):
        print(f"{name:<36}{figures['accuracy'][index]:>10.3f}{figures['brier'][index]:>8.3f}"
              f"{figures['ece'][index]:>8.3f}")
    print(f"better: {figures['better']} (the two agree on {figures['agreement']:.0%} of the decisions)")


def _print_live_evaluation(live: dict, offline: dict, same: bool) -> None:
    """The live evaluation (d3stream evaluate) of the served checkpoint beside its offline re-evaluation (the
    two must agree: the same answers and labels)."""
    served = offline["checkpoints"][0]
    model = next((m for m in live["models"] if m["model"] == served and m["role"] == "live"), None)
    print(f"\nlive evaluation: d3stream evaluate joined {live['evaluations']} answers with labels that came before "
          "and after them")
    print(f"{'':<36}{'accuracy':>10}{'Brier':>8}{'ECE':>8}{'log loss':>10}")
    if model is None:
        print("no live evaluation of the served checkpoint")
        return
    print(f"{'live (d3stream evaluate)':<36}{model['accuracy']:>10.3f}{model['brier']:>8.3f}{model['ece']:>8.3f}"
          f"{model['log_loss']:>10.3f}")
    print(f"{'offline (compare --labels)':<36}{offline['accuracy'][0]:>10.3f}{offline['brier'][0]:>8.3f}"
          f"{offline['ece'][0]:>8.3f}{offline['log_loss'][0]:>10.3f}")
    print("the same figures, live and offline" if same else "the live and offline figures differ")


def _demo(args: argparse.Namespace) -> int:
    from d3stream.dev.demo import run_demo
    from d3stream.dev.infra import InfraError
    from d3stream.ops.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    try:
        summary = asyncio.run(run_demo(progress=not args.json and sys.stderr.isatty(), timeout_s=args.timeout))
    except InfraError as exc:  # a local server that would not start: its log's path and tail say why
        print(f"d3stream demo: {exc}", file=sys.stderr)
        return 1
    answers = summary.pop("answers")
    labelled = set(summary.pop("labelled_ids"))
    if args.json:
        print(json.dumps(summary))
    else:
        from d3stream.dev.tasks import showcase

        texts = {e.id: e.request["state"]["text"] for e in showcase() if isinstance(e.request["state"], dict)}
        shown = [a for a in answers if not a["id"].startswith("heldout-")]
        for answer in sorted(shown, key=lambda a: a["id"]):
            if answer["id"] in texts:
                print(f"{answer['id']:<20} \"{texts[answer['id']]}\"")
            error = answer.get("error")
            brief = error["code"] if error else "  ".join(
                f"{key}: {_brief(value)}" for key, value in (answer.get("answers") or {}).items()
            )
            print(f"{answer['id']:<20} {brief}")
        held = len([a for a in answers if a["id"].startswith("heldout-")])
        print(f"(and {held} requests drawn from the held-out set; {len(labelled)} labelled requests in all)")
        _print_reevaluation(summary["reevaluation"])
        _print_live_evaluation(summary["live_evaluation"], summary["reevaluation"], summary["live_equals_offline"])
        print(f"\npublished {summary['published']}, answered {summary['answered']}, error answers "
              f"{summary['errors']}, dead letters {summary['dead_letters']}, replayed {summary['replayed']}, "
              f"{summary['seconds']} s")
    every = summary["answered"] == summary["published"] == summary["replayed"]
    return 0 if every and summary["live_equals_offline"] else 1


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


def _env_default(name: str, fallback: str | None) -> str | None:
    import os

    return os.environ.get(name, fallback)


def register(commands: argparse._SubParsersAction) -> None:
    """Add the service commands to the CLI's sub-command table."""
    from d3stream.config import CONNECTION_FIELDS, add_arguments

    serve = commands.add_parser("serve", help="run the service: answer requests from Kafka",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(serve)
    serve.set_defaults(run=_serve)

    produce = commands.add_parser("produce", help="publish request events from a JSON-lines file")
    produce.add_argument("topic")
    produce.add_argument("file", help="JSON lines, one request per line (- for stdin)")
    produce.add_argument("--upload-media", metavar="BUCKET",
                         help="upload local media files named by requests and rewrite them to s3:// references")
    produce.add_argument("--s3-endpoint-url", default=_env_default("D3STREAM_S3_ENDPOINT_URL", None))
    add_arguments(produce, only=CONNECTION_FIELDS)
    produce.set_defaults(run=_produce)

    consume = commands.add_parser("consume", help="print answer events as JSON lines")
    consume.add_argument("topic")
    consume.add_argument("--max", type=int, default=None, help="stop after this many distinct request ids")
    consume.add_argument("--timeout", type=float, default=3600.0, help="stop after this many seconds")
    consume.add_argument("--idle", type=float, default=None, help="stop after this many seconds without a record")
    add_arguments(consume, only=CONNECTION_FIELDS)
    consume.set_defaults(run=_consume)

    demo = commands.add_parser("demo", help="run everything locally: broker, object store, a tiny trained model, sample requests, "
                                "and a labelled re-evaluation against a random checkpoint")
    demo.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all answers")
    demo.set_defaults(run=_demo)

    chaos = commands.add_parser("chaos", help="reliability report: serve a stream while killing workers, "
                                "restarting the broker and taking the object store down; count every answer")
    chaos.add_argument("--requests", type=int, default=10_000, help="valid requests in the stream")
    chaos.add_argument("--fuzzed", type=int, default=10_000, help="hostile or malformed events in the stream")
    chaos.add_argument("--kills", type=int, default=20, help="SIGKILL/restart cycles of the worker")
    chaos.add_argument("--mode", choices=get_args(DeliveryMode), default="exactly_once")
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for every answer")
    chaos.add_argument("--json", action="store_true", help="print the report as one JSON object")
    chaos.add_argument("--delivery-costs", action="store_true",
                       help="instead: measure both delivery modes on the same stream (throughput, latency)")
    chaos.add_argument("--rate", type=float, default=100.0, help="arrival rate for the latency run of --delivery-costs")
    chaos.set_defaults(run=_chaos)

    from d3stream.benchmarks import bench
    from d3stream.jobs import compare, evaluate, replay

    bench.register(commands)
    compare.register(commands)
    evaluate.register(commands)
    replay.register(commands)
