"""``d3stream decide``: answer one request with a checkpoint, in process, and print the response."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from d3stream.cli.common import Refused, load_checkpoint, local_checkpoint
from d3stream.cli.shape import Command


def _read_request(source: str) -> dict[str, object]:
    """The request of ``--request``: a JSON object; Refused naming the file otherwise."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
        request = json.loads(text)
    except OSError as exc:
        raise Refused(f"--request {source}: cannot be read: {exc.strerror or exc}") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise Refused(f"--request {source}: not JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise Refused(f"--request {source}: the request must be a JSON object with state and questions")
    return request


def _listed(request: Mapping[str, object], key: str) -> list[object]:
    """The request's ``images`` or ``videos`` (absent or null: none); ValueError, in the runtime's words, when
    it is not a list."""
    value = request.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list of {key}")
    return value


def _decide(args: argparse.Namespace) -> int:
    request = _read_request(args.request)
    resolved = local_checkpoint(args.model)
    model = load_checkpoint(
        resolved.path,
        device=args.device,
        verify=args.verify,
        model_name=resolved.name,
        permutation_average=args.permutation_average or bool(request.get("permutation_average")),
    )
    questions = request.get("questions")
    try:
        images = _listed(request, "images") + list(args.image or [])
        videos = _listed(request, "videos") + list(args.video or [])
        response = model.system_one(
            state=request.get("state"),
            # none at all, or not an object: the runtime's "nonempty mapping" error
            questions=questions if isinstance(questions, Mapping) else {},
            images=images or None,
            videos=videos or None,
        )
    except ValueError as exc:
        print(json.dumps({"error": {"code": "invalid_request", "message": str(exc)}}, ensure_ascii=False))
        return 2
    print(json.dumps(response, ensure_ascii=False, indent=2))
    return 0


def add_arguments(decide: argparse.ArgumentParser) -> None:
    decide.add_argument("--model", required=True,
                        help="checkpoint directory or s3://bucket/prefix/ (settings of the environment: "
                        "D3STREAM_MODEL_ALLOWLIST, D3STREAM_S3_ENDPOINT_URL, D3STREAM_MODEL_CACHE_DIR)")
    decide.add_argument("--request", required=True, help="request JSON file ({state, questions, ...}) or - for stdin")
    decide.add_argument("--image", action="append", help="image file seen by every question (repeatable)")
    decide.add_argument("--video", action="append", help="video file seen by every question (repeatable)")
    decide.add_argument("--device", default=None, help="torch device (default: cuda:0 when present, else cpu)")
    decide.add_argument("--verify", choices=("fast", "full", "none"), default="fast", help="manifest check")
    decide.add_argument("--permutation-average", action="store_true", help="average choice options over both orders")


COMMAND = Command("decide", "answer one request with a checkpoint and print the response", add_arguments, _decide)
