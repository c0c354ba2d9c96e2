"""``d3stream demo-task DIR``: the held-out set of the demo task, and each checkpoint's answers to it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from d3stream.cli.common import load_checkpoint, local_checkpoint
from d3stream.cli.shape import Command


def _demo_task(args: argparse.Namespace) -> int:
    from d3stream.dev import tasks

    seed = tasks.HELDOUT_SEED if args.seed is None else args.seed
    examples = tasks.draw(seed, args.tickets, args.pictures, prefix="heldout" if args.seed is None else None)
    requests, labels = tasks.write_task(args.out, examples)
    print(requests)
    print(labels)
    if args.answer_with:
        for spec in args.answer_with:
            resolved = local_checkpoint(spec)
            model = load_checkpoint(resolved.path, flag="--answer-with", device=args.device, model_name=resolved.name)
            out = Path(args.out) / f"answers-{model.model_name}.jsonl"
            records = tasks.answer_records(model, examples).values()
            out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
            print(out)
    return 0


def add_arguments(task: argparse.ArgumentParser) -> None:
    task.add_argument("out", help="directory to write")
    task.add_argument("--seed", type=int, default=None,
                      help="draw another set (default: the held-out seed, never trained on)")
    task.add_argument("--tickets", type=int, default=60)
    task.add_argument("--pictures", type=int, default=20)
    task.add_argument("--answer-with", action="append", metavar="CHECKPOINT",
                      help="answer the set with this checkpoint (a directory or s3://bucket/prefix/) in process "
                      "(repeatable): answers-<model name>.jsonl")
    task.add_argument("--device", default=None, help="torch device (default: cuda:0 when present, else cpu)")


COMMAND = Command("demo-task", "write the held-out set of the demo task (requests.jsonl, labels.jsonl) and, with "
                  "--answer-with, each checkpoint's answers to it, for `d3stream compare --labels`", add_arguments,
                  _demo_task)
