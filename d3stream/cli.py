"""The ``d3stream`` command line: one sub-command per job.

Heavy imports (torch, transformers, aiokafka) happen inside the commands, so ``d3stream --help`` is
instant and a command only pays for what it uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _make_checkpoint(args: argparse.Namespace) -> int:
    from d3stream.dev.build_checkpoint import build_checkpoint

    out = build_checkpoint(
        Path(args.out),
        backbone=args.backbone,
        vision=not args.no_vision,
        attention_mode=args.attention_mode,
        size=args.size,
        seed=args.seed,
        max_length=args.max_length,
        progress=sys.stderr.isatty() or args.progress,
        train=args.train,
        train_steps=args.train_steps,
    )
    print(out)
    return 0


def _demo_task(args: argparse.Namespace) -> int:
    from d3stream.dev import tasks

    seed = tasks.HELDOUT_SEED if args.seed is None else args.seed
    examples = tasks.draw(seed, args.tickets, args.pictures, prefix="heldout" if args.seed is None else None)
    requests, labels = tasks.write_task(args.out, examples)
    print(requests)
    print(labels)
    if args.answer_with:
        from d3stream.runtime import D3

        for spec in args.answer_with:
            resolved = _local_checkpoint(spec)
            model = D3.from_pretrained(resolved.path, device=args.device, model_name=resolved.name)
            out = Path(args.out) / f"answers-{model.model_name}.jsonl"
            records = tasks.answer_records(model, examples).values()
            out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
            print(out)
    return 0


def _local_checkpoint(spec: str) -> Any:
    """A ``--model`` / ``--answer-with`` value as a local directory (``checkpoints.ResolvedModel``); an
    ``s3://`` one is fetched with the object-storage settings of the environment or settings file
    (``D3STREAM_MODEL_ALLOWLIST``, ``D3STREAM_S3_ENDPOINT_URL``, ...). Exits with the reason otherwise."""
    from d3stream.config import load_settings
    from d3stream.models.checkpoints import CheckpointError, parse_model_spec, resolve_model
    from d3stream.ops.logs import configure_logging

    try:
        settings = load_settings({}) if parse_model_spec(spec).in_object_store else None
        if settings is not None:  # the download's log lines go to stderr; stdout holds the command's output
            configure_logging(settings.log_format, settings.log_level)
        return resolve_model(spec, settings)
    except (CheckpointError, ValueError) as exc:
        raise SystemExit(f"d3stream: {exc}") from exc


def _read_request(source: str) -> dict[str, Any]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    request = json.loads(text)
    if not isinstance(request, dict):
        raise SystemExit("the request must be a JSON object with state and questions")
    return request


def _decide(args: argparse.Namespace) -> int:
    from d3stream.runtime import D3

    request = _read_request(args.request)
    resolved = _local_checkpoint(args.model)
    model = D3.from_pretrained(
        resolved.path,
        device=args.device,
        verify=args.verify,
        model_name=resolved.name,
        permutation_average=args.permutation_average or bool(request.get("permutation_average")),
    )
    images = list(request.get("images") or []) + list(args.image or [])
    videos = list(request.get("videos") or []) + list(args.video or [])
    try:
        response = model.system_one(
            state=request.get("state"),
            questions=request.get("questions") or {},  # none at all: the runtime's "nonempty mapping" error
            images=images or None,
            videos=videos or None,
        )
    except ValueError as exc:
        print(json.dumps({"error": {"code": "invalid_request", "message": str(exc)}}, ensure_ascii=False))
        return 2
    print(json.dumps(response, ensure_ascii=False, indent=2))
    return 0


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every command: each option's default after its help, where it has one.

    argparse's ArgumentDefaultsHelpFormatter appends "(default: None)" to options whose default is "not
    given" (the settings, whose unset flags fall back to the environment, the file, then the setting's own
    default, which their help states) and repeats defaults the help already names. This one shows a
    default only when there is one to show and the help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _has_default(action) or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _has_default(action: argparse.Action) -> bool:
    """An option with a default worth showing: not "not given" (None), an off switch or a suppressed one."""
    unshown = action.default is None or action.default is False or action.default == argparse.SUPPRESS
    return bool(action.option_strings) and not unshown


def _describe_commands(commands: argparse._SubParsersAction) -> None:
    """Every command's ``--help`` with the shared formatter, and its one-line summary as its description."""
    summaries = {choice.dest: choice.help for choice in commands._choices_actions}  # noqa: SLF001
    for name, command in commands.choices.items():
        command.formatter_class = HelpFormatter
        if command.description is None:
            command.description = summaries.get(name)
        for action in command._actions:  # noqa: SLF001
            if action.help is None and _has_default(action):  # argparse prints no help line at all for None
                action.help = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    from d3stream import __version__

    parser = argparse.ArgumentParser(
        prog="d3stream",
        description="Typed D3 decisions at streaming scale: Kafka requests in, answers with provenance out.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_make_checkpoint(commands)
    _add_demo_task(commands)
    _add_decide(commands)
    from d3stream import commands as service_commands

    service_commands.register(commands)
    _describe_commands(commands)
    return parser




def _add_make_checkpoint(commands: argparse._SubParsersAction) -> None:
    make = commands.add_parser(
        "make-checkpoint",
        help="write a complete random-weight D3 checkpoint, or with --train demo a small trained one (offline)",
    )
    make.add_argument("out", help="directory to write (created; existing files are replaced)")
    make.add_argument("--backbone", choices=("qwen3_5", "qwen3_vl"), default="qwen3_5")
    make.add_argument("--no-vision", action="store_true", help="leave out the vision tower (text-only)")
    make.add_argument(
        "--attention-mode", choices=("causal", "noncausal_full_attention"), default="causal"
    )
    make.add_argument("--size", choices=("tiny", "0.8b"), default="tiny", help="tiny for tests, 0.8b for GPUs")
    make.add_argument("--seed", type=int, default=0, help="weights are a deterministic function of the seed")
    make.add_argument("--max-length", type=int, default=None, help="input limit written to decision_config.json")
    make.add_argument("--progress", action="store_true", help="show a progress bar even when not on a terminal")
    make.add_argument("--train", choices=("demo",), default=None,
                      help="then fit it on the synthetic support-ticket task (about a minute on a CPU; tiny qwen3_5)")
    make.add_argument("--train-steps", type=int, default=None, help="training steps of --train (default 1000)")
    make.set_defaults(run=_make_checkpoint)


def _add_demo_task(commands: argparse._SubParsersAction) -> None:
    task = commands.add_parser(
        "demo-task",
        help="write the held-out set of the demo task (requests.jsonl, labels.jsonl) and, with --answer-with, "
        "each checkpoint's answers to it, for `d3stream compare --labels`",
    )
    task.add_argument("out", help="directory to write")
    task.add_argument("--seed", type=int, default=None,
                      help="draw another set (default: the held-out seed, never trained on)")
    task.add_argument("--tickets", type=int, default=60)
    task.add_argument("--pictures", type=int, default=20)
    task.add_argument("--answer-with", action="append", metavar="CHECKPOINT",
                      help="answer the set with this checkpoint (a directory or s3://bucket/prefix/) in process "
                      "(repeatable): answers-<model name>.jsonl")
    task.add_argument("--device", default=None, help="torch device (default: cuda:0 when present, else cpu)")
    task.set_defaults(run=_demo_task)


def _add_decide(commands: argparse._SubParsersAction) -> None:
    decide = commands.add_parser("decide", help="answer one request with a checkpoint and print the response")
    decide.add_argument("--model", required=True,
                        help="checkpoint directory or s3://bucket/prefix/ (settings of the environment: "
                        "D3STREAM_MODEL_ALLOWLIST, D3STREAM_S3_ENDPOINT_URL, D3STREAM_MODEL_CACHE_DIR)")
    decide.add_argument("--request", required=True, help="request JSON file ({state, questions, ...}) or - for stdin")
    decide.add_argument("--image", action="append", help="image file seen by every question (repeatable)")
    decide.add_argument("--video", action="append", help="video file seen by every question (repeatable)")
    decide.add_argument("--device", default=None, help="torch device (default: cuda:0 when present, else cpu)")
    decide.add_argument("--verify", choices=("fast", "full", "none"), default="fast", help="manifest check")
    decide.add_argument("--permutation-average", action="store_true", help="average choice options over both orders")
    decide.set_defaults(run=_decide)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
