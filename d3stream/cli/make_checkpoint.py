"""``d3stream make-checkpoint DIR``: a complete random-weight D3 checkpoint, or with ``--train demo`` a small
trained one, built offline (dev/build_checkpoint.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from d3stream.cli.shape import Command


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


def add_arguments(make: argparse.ArgumentParser) -> None:
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
    make.add_argument("--train-steps", type=int, default=None, help="training steps of --train (default 3000)")


COMMAND = Command("make-checkpoint", "write a complete random-weight D3 checkpoint, or with --train demo a small "
                  "trained one (offline)", add_arguments, _make_checkpoint)
