"""``d3stream replay``: answer a range of a request topic with a checkpoint, into a topic of its own or a file
(jobs/replay.py runs it; this reads the flags, refuses a live or request topic as the target, and prints the
summary)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from d3stream.cli.common import Refused, checkpoint_folder, load_checkpoint, reach_kafka
from d3stream.cli.shape import Command

if TYPE_CHECKING:  # the jobs import the Kafka client and the service: only when the command runs
    from d3stream.core.seams import DecisionModel
    from d3stream.jobs.replay import ReplayRange, ReplaySummary
    from d3stream.settings import Settings


def _replay_command(args: argparse.Namespace) -> int:
    settings, checkpoint = _command_settings(args)
    plan = _command_range(args)
    model = _load_checkpoint(checkpoint, settings)
    summary = _run_command(args, settings, model, plan)
    _print_summary(summary, as_json=args.json)
    return 0


def _command_settings(args: argparse.Namespace) -> tuple[Settings, str]:
    """The replay's settings (with --to-topic as its answer topic) and its one checkpoint; logging is
    configured. A target that is a live or request topic, or a --model other than one, is refused."""
    from d3stream.kafka.connection import check_connection
    from d3stream.ops.logs import configure_logging
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
        check_connection(settings.connection)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    configure_logging(settings.observability.log_format, "warning" if settings.observability.log_level == "info" else settings.observability.log_level)
    from d3stream.jobs.replay import live_topic_refusal

    refusal = live_topic_refusal(args.to_topic, settings.delivery.answer_topic, allowed=args.allow_live_answer_topic,
                                 request_topics=[args.from_topic, *settings.delivery.request_topics])
    if refusal:
        raise Refused(refusal)
    if not settings.models.checkpoints:
        raise Refused("no checkpoint: set --model or D3STREAM_MODEL")
    if len(settings.models.checkpoints) > 1:  # a replay answers a range with one model; compare two replays to compare models
        raise Refused(f"--model names {len(settings.models.checkpoints)} checkpoints; a replay runs one (replay once per "
                       "model and compare the answer sets)")
    [checkpoint] = settings.models.checkpoints
    if args.to_topic:

        settings = settings.replaced(answer_topic=args.to_topic)
    return settings, checkpoint


def _command_range(args: argparse.Namespace) -> ReplayRange:
    """The range the flags name: the topic, its partitions (default: all), and offset or time bounds."""
    from d3stream.jobs.replay import ReplayRange, parse_time

    return ReplayRange(
        topic=args.from_topic,
        partitions=[int(p) for p in args.partitions.split(",")] if args.partitions else None,
        start_offset=args.start_offset,
        end_offset=args.end_offset,
        start_time=parse_time(args.start_time),
        end_time=parse_time(args.end_time),
    )


def _load_checkpoint(checkpoint: str, settings: Settings) -> DecisionModel:
    """The checkpoint the replay runs, resolved (a path, or a name in a model source) and, once Kafka has
    answered (a wrong address or password is said before the seconds of the load), loaded."""
    from d3stream.models.checkpoints import CheckpointError, model_name_for, resolve_model

    try:
        resolved = resolve_model(checkpoint, settings.storage)
        model_name = model_name_for(resolved, settings.models.model_name)
    except CheckpointError as exc:
        raise Refused(str(exc)) from exc
    checkpoint_folder(resolved.path, checkpoint)
    reach_kafka(settings)
    return load_checkpoint(resolved.path, device=settings.models.device, verify=settings.models.verify,
                           model_name=model_name, permutation_average=settings.models.permutation_average)


def _run_command(args: argparse.Namespace, settings: Settings, model: DecisionModel,
                 plan: ReplayRange) -> ReplaySummary:
    """Replay the range into the --to-topic or --out target; the summary, with the drift from recorded
    answers under ``drift`` when --compare-with names them."""
    import sys

    from d3stream.jobs.replay import replay_drift, run_replay

    out = Path(args.out) if args.out else None
    try:
        summary = asyncio.run(run_replay(settings, model, plan, replay_id=args.replay_id, out_file=out,
                                         deterministic=args.deterministic, rows_per_pass=args.rows_per_pass,
                                         progress=not args.json and sys.stderr.isatty()))
    except (ValueError, ConnectionError) as exc:
        raise Refused(str(exc)) from exc
    if args.compare_with:
        from d3stream.jobs.compare import SourceError

        try:
            summary["drift"] = replay_drift(args.compare_with,
                                            str(out) if out else f"kafka:{settings.delivery.answer_topic}", settings)
        except (OSError, ValueError, SourceError) as exc:
            raise Refused(f"--compare-with: {exc}") from exc
    return summary


def _print_summary(summary: ReplaySummary, *, as_json: bool) -> None:
    """One JSON object (--json), or one aligned line per field."""
    if as_json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:<16}{json.dumps(value) if isinstance(value, dict) else value}")


def add_arguments(replay: argparse.ArgumentParser) -> None:
    from d3stream.settings import add_arguments as add_settings

    replay.add_argument("--from-topic", required=True, help="request topic to replay")
    replay.add_argument("--replay-id", required=True, help="names the replay: resume and split work by reusing it")
    replay.add_argument("--partitions", default=None, help="comma-separated partition numbers (default: all)")
    replay.add_argument("--start-offset", type=int, default=None, help="first offset of every partition")
    replay.add_argument("--end-offset", type=int, default=None, help="offset to stop before, every partition")
    replay.add_argument("--start-time", default=None, help="ISO 8601 time or epoch ms: first request at or after it")
    replay.add_argument("--end-time", default=None, help="ISO 8601 time or epoch ms: stop before requests from then")
    # Required, with no default: a replay written into the live answer topic by accident would mix its
    # answers into what downstream consumers take for the live model's.
    target = replay.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-topic", default=None,
                        help="topic for the replayed answers (never the live answer_topic, unless "
                        "--allow-live-answer-topic)")
    target.add_argument("--out", default=None, help="JSON-lines file for the replayed answers instead of a topic")
    replay.add_argument("--allow-live-answer-topic", action="store_true",
                        help="let --to-topic name the live answer topic (the answer_topic setting)")
    replay.add_argument("--deterministic", action="store_true",
                        help="passes cut from source order, --rows-per-pass rows each: bit-reproducible")
    replay.add_argument("--rows-per-pass", type=int, default=8)
    replay.add_argument("--compare-with", default=None,
                        help="recorded answers (JSONL file or kafka:TOPIC) to measure the replay's drift against")
    replay.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_settings(replay)


COMMAND = Command("replay", "answer a range of a request topic with a checkpoint (resumable, parallel, optionally "
                  "deterministic)", add_arguments, _replay_command)
