"""What several commands share: how an expected failure ends a command (one line, exit status 2), a checkpoint
made local from a ``--model`` value, and a Kafka client command's connection, Schema Registry and run.

Expected failures are the ones a newcomer meets in the first minutes (a wrong address, password or path, a port
that is taken, a topic name with a typo): each is one line on stderr, ``d3stream COMMAND: what failed, where,
and the setting or flag to change``, and exit status 2, with no traceback, which helps nobody who only mistyped
a flag (``--log-level debug`` or ``D3STREAM_LOG_LEVEL=debug`` prints it too). A command raises :class:`Refused`
for its own refusals; :func:`run_command` (what ``d3stream`` runs) prints them and the library's errors that
already name what to change. Anything else is a bug and keeps its traceback. Ctrl-C ends a command that did
not make SIGINT a stop request of its own (``serve``, ``evaluate`` and ``stack`` do) with exit status 130 and
no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from d3stream_client.registry import RegistryFormat, RequestFormat

    from d3stream.models.checkpoints import ResolvedModel
    from d3stream.runtime import D3
    from d3stream.settings import Settings

# The exit status of an expected failure (a configuration the command cannot work with), as argparse's own.
REFUSED_EXIT = 2
# The exit status after Ctrl-C (128 + SIGINT, as a shell reports a command SIGINT ended).
INTERRUPTED_EXIT = 130
# The exit status of a worker (serve, evaluate) after a worker-fatal error (2 is a configuration error).
WORKER_FATAL_EXIT = 3


class Refused(Exception):
    """An expected failure of a command: its message, naming what to change, is printed after
    ``d3stream COMMAND:`` on one line, and the command exits with status 2."""


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command: its exit status, or 2 after one line for an expected failure (module
    docstring), or 130 after Ctrl-C. An unexpected error goes on with its traceback."""
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:  # what it had done is done (each command's finally blocks ran); nothing to add
        return INTERRUPTED_EXIT
    except Exception as exc:
        message = expected_failure(exc)
        if message is None:
            raise
        if debugging(args):
            traceback.print_exception(exc, file=sys.stderr)
        named = " ".join(filter(None, (args.command, getattr(args, "action", None))))  # schemas register
        print(f"d3stream {named}: {message}", file=sys.stderr, flush=True)
        return REFUSED_EXIT


def expected_failure(exc: BaseException) -> str | None:
    """The one line of an expected failure, None for any other error. Expected: a :class:`Refused`, Kafka that
    cannot be reached (``kafka.connection`` names the setting), a checkpoint that cannot be found or read,
    and a metrics port that is taken. Their classes are looked up only now: ``d3stream --help`` stays light."""
    if isinstance(exc, Refused | ConnectionError):
        return str(exc)
    from d3stream.models.checkpoints import CheckpointError
    from d3stream.ops.metrics import MetricsPortTaken

    if isinstance(exc, CheckpointError | MetricsPortTaken):
        return str(exc)
    return None


def debugging(args: argparse.Namespace) -> bool:
    """Whether a traceback goes with an expected failure's line: ``--log-level debug`` (the commands that take
    it) or ``D3STREAM_LOG_LEVEL=debug``."""
    level = getattr(args, "log_level", None) or os.environ.get("D3STREAM_LOG_LEVEL", "")
    return str(level).strip().lower() == "debug"


def local_checkpoint(spec: str) -> ResolvedModel:
    """A ``--model`` / ``--answer-with`` value as a local directory (``checkpoints.ResolvedModel``); an
    ``s3://`` one is fetched with the object-storage settings of the environment or settings file
    (``D3STREAM_MODEL_ALLOWLIST``, ``D3STREAM_S3_ENDPOINT_URL``, ...). Refused with the reason otherwise."""
    from d3stream.models.checkpoints import CheckpointError, parse_model_spec, resolve_model
    from d3stream.ops.logs import configure_logging
    from d3stream.settings import load_settings

    try:
        settings = load_settings({}) if parse_model_spec(spec).in_object_store else None
        if settings is not None:  # the download's log lines go to stderr; stdout holds the command's output
            configure_logging(settings.observability.log_format, settings.observability.log_level)
        return resolve_model(spec, settings.storage if settings is not None else None)
    except (CheckpointError, ValueError) as exc:
        raise Refused(str(exc)) from exc


def checkpoint_folder(path: Path, given: str, flag: str = "--model") -> None:
    """Refused when ``path`` (what ``flag`` gave as ``given``, made local) is no checkpoint's folder: said before
    a command asks Kafka, since a typo in a path needs no broker to be seen."""
    from d3stream.runtime.loading import CONFIG_FILE

    build = "build one with `d3stream make-checkpoint`"
    if not path.is_dir():
        raise Refused(f"{flag} {given}: no checkpoint directory at {path} ({build})")
    if not (path / CONFIG_FILE).is_file():
        raise Refused(f"{flag} {given}: not a d3stream checkpoint ({CONFIG_FILE} is missing): {build}")


def load_checkpoint(path: object, *, flag: str = "--model", **options: object) -> D3:
    """``D3.from_pretrained(path, **options)``; a directory that is not a loadable checkpoint (files missing,
    unreadable or not of the format) is refused naming it and the ``flag`` that gave it."""
    from d3stream.runtime import D3

    build = "build one with `d3stream make-checkpoint`"
    try:
        return D3.from_pretrained(path, **options)  # type: ignore[arg-type]  # from_pretrained's own keywords
    except FileNotFoundError as exc:  # a folder, but not a checkpoint's
        missing = os.path.basename(str(exc.filename)) if exc.filename else str(exc)
        raise Refused(f"{flag} {path}: not a d3stream checkpoint ({missing} is missing): {build}") from exc
    except (OSError, ValueError) as exc:  # ValueError: the runtime's refusals (no folder, a manifest that differs)
        reason = str(exc) if "make-checkpoint" in str(exc) else f"{exc} ({build})"
        raise Refused(f"{flag} {path}: cannot load the checkpoint: {reason}") from exc


def connection(args: argparse.Namespace) -> Settings:
    """The Kafka connection settings of a client command (flags, environment, settings file); Refused,
    naming the setting, when they are unusable."""
    from d3stream.kafka.connection import check_connection
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
        check_connection(settings.connection)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    return settings


def reach_kafka(settings: Settings) -> set[str]:
    """The cluster's topic names, before a command loads a model or reads a file: a ConnectionError naming
    the setting to change when Kafka does not answer (``kafka.connection.reach``)."""
    from d3stream.kafka.connection import reach

    return asyncio.run(reach(settings.connection))


def run_kafka(settings: Settings, step: Callable[[Callable[[], bool]], Awaitable[object]],
              check: Callable[[set[str]], None] | None = None) -> int:
    """Run a client command's coroutine, made by ``step(stop_asked)``, once Kafka has answered
    (``kafka.connection.reach``) and ``check`` has seen the cluster's topics (it raises Refused for a topic that is
    missing); a refusal on the way is Refused or a ConnectionError, which ``run_command`` prints with the setting
    to change.

    Ctrl-C cancels the coroutine and makes ``stop_asked()`` true, and the command ends as interrupted (status
    130). Both, because a cancellation can be lost: aiokafka closes a client's background task under
    ``suppress(CancelledError)``, which swallows a cancellation that arrives meanwhile too, and a reader then
    went on to its one-hour ``--timeout``. A loop that checks ``stop_asked()`` ends either way."""
    from d3stream.kafka.connection import connecting, reach

    interrupted = False

    def stop_asked() -> bool:
        return interrupted

    async def reached() -> object:
        main = asyncio.current_task()
        assert main is not None

        def on_ctrl_c() -> None:
            nonlocal interrupted
            interrupted = True
            main.cancel()

        with _handling(signal.SIGINT, on_ctrl_c):
            topics = await reach(settings.connection)
            if check is not None:
                check(topics)
            return await connecting(settings.connection, step(stop_asked))

    try:
        asyncio.run(reached())
    except asyncio.CancelledError:
        if not interrupted:
            raise
    except ValueError as exc:  # a refused schema (``closing``), an option aiokafka refused
        raise Refused(str(exc)) from exc
    if interrupted:
        raise KeyboardInterrupt  # run_command's status 130, as for a command without a loop of its own
    return 0


@contextlib.contextmanager
def _handling(signum: int, handler: Callable[[], None]) -> Iterator[None]:
    """``handler`` runs on the event loop for ``signum`` while the block runs (where the loop can take signals:
    the main thread of a process; elsewhere the signal keeps its handling)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signum, handler)
    except (RuntimeError, ValueError):  # not the main thread
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signum)


async def reach_registry(registry: RegistryFormat) -> None:
    """One request to the Schema Registry (its subjects), before a command that would otherwise wait out an
    outage as a worker does: Refused, naming the setting to change, when it does not answer or refuses."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        await registry.client.get_subjects()
    except SchemaRegistryError as exc:
        status = exc.http_status_code
        hint = ("check schema_registry_basic_auth or schema_registry_bearer_token" if status in (401, 403)
                else "check schema_registry_url (--schema-registry-url): the path of the registry's API included, "
                "e.g. .../apis/ccompat/v7 for Apicurio")
        raise Refused(f"the Schema Registry at {registry.url} refused (HTTP {status}: {exc.error_message}): "
                      f"{hint}") from exc
    except Exception as exc:  # noqa: BLE001 - httpx's and the TLS layer's errors are many; each means "not reached"
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise Refused(f"the Schema Registry at {registry.url} did not answer ({cause}): check schema_registry_url "
                      "(--schema-registry-url), that the registry runs, and its TLS settings "
                      "(schema_registry_ssl_cafile)") from exc
    finally:
        await registry.aclose()


def missing_topic(topic: str, topics: Iterable[str], servers: str, wait_flag: str) -> str:
    """The refusal of a topic the cluster does not have: where it was looked for, the names closest to it, and
    the flag that waits for it instead. (A topic the credentials may not describe is left out of the metadata
    as well: the line says so.)"""
    import difflib

    close = difflib.get_close_matches(topic, sorted(name for name in topics if not name.startswith("__")), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (f"topic {topic} does not exist at {servers}{hint}: check the name (and that these credentials may "
            f"describe it), or pass {wait_flag} to wait until it is created")


# The worker's registry settings a client command has no use for: how it writes answers, how long it waits.
_WORKER_ONLY_REGISTRY = ("answer_format", "schema_registry_backoff_max_s")
_WRITER_ONLY_REGISTRY = ("subject_name_strategy", "schema_auto_register")


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
    refuses becomes a ValueError, which ``run_kafka`` makes the command's one-line refusal."""
    if registry is None:
        return await step
    from d3stream_client.registry import RegistryError

    try:
        return await step
    except RegistryError as exc:
        raise ValueError(str(exc)) from exc
    finally:
        await registry.aclose()
