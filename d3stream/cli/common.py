"""What several commands share: a checkpoint made local from a ``--model`` value, and a Kafka client
command's connection, Schema Registry and run, each failing with the setting to change and exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d3stream_client.registry import RegistryFormat, RequestFormat

    from d3stream.models.checkpoints import ResolvedModel
    from d3stream.settings import Settings

# The worker's registry settings a client command has no use for: how it writes answers, how long it waits.
_WORKER_ONLY_REGISTRY = ("answer_format", "schema_registry_backoff_max_s")
_WRITER_ONLY_REGISTRY = ("subject_name_strategy", "schema_auto_register")


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


def registry_fields(*, writing: bool) -> tuple[str, ...]:
    """The registry settings a client command takes as flags: where the registry is and how to reach it, and,
    for a command that writes (``writing``), which subject and whether to register. The worker's own, less
    what only a worker uses; a reader decodes by the schema id in each record and names no subject."""
    from d3stream.settings.catalog import SETTINGS

    left_out = _WORKER_ONLY_REGISTRY + (() if writing else _WRITER_ONLY_REGISTRY)
    return tuple(name for name, setting in SETTINGS.items() if setting.section == "registry" and name not in left_out)


# What the registry settings mean to a client command, where the worker's description (of answers it writes)
# would mislead.
CLIENT_REGISTRY_HELP = {
    "schema_registry_url": "Schema Registry URL (Confluent's API, e.g. http://registry:8081 or Apicurio's "
                           ".../apis/ccompat/v7): requests are framed for it, framed answers decoded through it",
    "subject_name_strategy": "the subject the request schema is under: topic (<topic>-value), record "
                             "(d3stream.v2.Request) or topic_record (<topic>-d3stream.v2.Request)",
    "schema_auto_register": "register the request schema under its subject on first use; off: it must be "
                            "registered already (d3stream schemas register)",
}


def registry_format(settings: Settings, request_format: RequestFormat = "avro") -> RegistryFormat | None:
    """The client's Schema Registry format from the registry settings; None without ``schema_registry_url``."""
    registry = settings.registry
    if not registry.schema_registry_url:
        return None
    from d3stream_client.registry import RegistryFormat

    auth, token = registry.schema_registry_basic_auth, registry.schema_registry_bearer_token
    return RegistryFormat(
        registry.schema_registry_url, request_format=request_format,
        subject_name_strategy=registry.subject_name_strategy, schema_auto_register=registry.schema_auto_register,
        schema_registry_basic_auth=auth.reveal() if auth is not None else None,
        schema_registry_bearer_token=token.reveal() if token is not None else None,
        schema_registry_ssl_cafile=registry.schema_registry_ssl_cafile,
        schema_registry_ssl_certfile=registry.schema_registry_ssl_certfile,
        schema_registry_ssl_keyfile=registry.schema_registry_ssl_keyfile,
        schema_registry_timeout_s=registry.schema_registry_timeout_s)


async def closing(registry: RegistryFormat | None, step: Awaitable[object]) -> object:
    """Await a client command's step, then close its registry connections; a schema the registry lacks or
    refuses becomes a ValueError, which ``run_kafka`` prints as the command's refusal."""
    if registry is None:
        return await step
    from d3stream_client.registry import RegistryError

    try:
        return await step
    except RegistryError as exc:
        raise ValueError(str(exc)) from exc
    finally:
        await registry.aclose()
