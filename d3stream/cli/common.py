"""What several commands share: a checkpoint made local from a ``--model`` value, and a Kafka client
command's connection and run, each failing with the setting to change and exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d3stream.models.checkpoints import ResolvedModel
    from d3stream.settings import Settings


def local_checkpoint(spec: str) -> ResolvedModel:
    """A ``--model`` / ``--answer-with`` value as a local directory (``checkpoints.ResolvedModel``); an
    ``s3://`` one is fetched with the object-storage settings of the environment or settings file
    (``D3STREAM_MODEL_ALLOWLIST``, ``D3STREAM_S3_ENDPOINT_URL``, ...). Exits with the reason otherwise."""
    from d3stream.models.checkpoints import CheckpointError, parse_model_spec, resolve_model
    from d3stream.ops.logs import configure_logging
    from d3stream.settings import load_settings

    try:
        settings = load_settings({}) if parse_model_spec(spec).in_object_store else None
        if settings is not None:  # the download's log lines go to stderr; stdout holds the command's output
            configure_logging(settings.observability.log_format, settings.observability.log_level)
        return resolve_model(spec, settings.storage if settings is not None else None)
    except (CheckpointError, ValueError) as exc:
        raise SystemExit(f"d3stream: {exc}") from exc


def connection(command: str, args: argparse.Namespace) -> Settings | None:
    """The Kafka connection settings of a client command (flags, environment, settings file); None after
    printing why they are unusable."""
    from d3stream.kafka.connection import check_connection
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
        check_connection(settings.connection)
        return settings
    except ValueError as exc:
        print(f"d3stream {command}: {exc}", file=sys.stderr)
        return None


def run_kafka(command: str, settings: Settings, step: Awaitable[object]) -> int:
    """Run a client command's coroutine; a connection refusal prints the setting to change, exit status 2."""
    from d3stream.kafka.connection import connecting

    try:
        asyncio.run(connecting(settings.connection, step))
    except (ConnectionError, ValueError) as exc:
        print(f"d3stream {command}: {exc}", file=sys.stderr)
        return 2
    return 0
