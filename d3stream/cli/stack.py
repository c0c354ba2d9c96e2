"""``d3stream stack``: the embedded Kafka broker, S3 store and Schema Registry in the foreground, for your own stream.

``make demo`` starts these servers and stops them when it ends; the README's "Your own stream" needs a Kafka and
an S3 endpoint that stay up while ``serve``, ``produce`` and ``consume`` run in other terminals. This command is
that (as ``confluent local kafka start`` is for Confluent's CLI): it starts ``dev.infra.embedded_stack``, creates a
bucket and the request topics, prints the addresses as the ``export`` lines and the TOML keys those commands read
(``--env-file`` also writes the lines to a file a script can ``source``), then waits for Ctrl-C (SIGINT) or SIGTERM
and stops the servers cleanly: Kafka checkpoints its logs, so ``--data-dir`` keeps topics, offsets, objects and
schemas for the next run. The ports are picked afresh on every run; the printed lines are the ones to use.

Exit status: 0 when a signal stopped a stack that was ready, 128 + the signal's number when it came during the
start (nothing was ready to use), 1 when a server failed to start or exited on its own while running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from d3stream.cli.shape import Command

if TYPE_CHECKING:
    from d3stream.dev.infra import LocalStack

# How often the running stack checks that its servers are still there: a broker that died is said at once rather
# than discovered by the next `produce` that cannot connect.
_WATCH_INTERVAL_S = 1.0


class _Stopped(BaseException):
    """A SIGINT or SIGTERM arrived: stop the servers. A BaseException, like KeyboardInterrupt, so no ``except
    Exception`` on the way (a start-up retry, a probe) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`_Stopped` in the main thread, once: a second signal while the servers
    stop only says that they are stopping, so Ctrl-C pressed twice cannot leave a JVM half shut down (each
    server has a bounded grace, then SIGKILL). SIGTERM needs a handler of its own: by default it ends Python
    without unwinding, and the servers would only go when the kernel's parent-death signal reaches them."""

    def stopping(signum: int, frame: FrameType | None) -> None:
        print("d3stream stack: already stopping the servers", file=sys.stderr, flush=True)

    def stop(signum: int, frame: FrameType | None) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            signal.signal(each, stopping)
        raise _Stopped(signum)

    previous = {each: signal.signal(each, stop) for each in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def _split(values: list[str]) -> list[str]:
    """A repeatable option whose values may also be comma-separated, as the list settings are written."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def settings_of(stack: LocalStack, bucket: str) -> dict[str, str | list[str]]:
    """The settings that point ``serve``, ``produce`` and ``consume`` at this stack, by their setting names."""
    settings: dict[str, str | list[str]] = {
        "bootstrap_servers": stack.broker.bootstrap_servers,
        "s3_endpoint_url": stack.store.endpoint_url,
        "s3_region": stack.store.region,
        "media_allowlist": [bucket],
    }
    if stack.registry is not None:
        settings["schema_registry_url"] = stack.registry.url
    return settings


def export_lines(stack: LocalStack, bucket: str) -> list[str]:
    """``export NAME=value`` for each setting (its ``D3STREAM_*`` variable) and the store's AWS credentials,
    which d3stream reads only from the standard AWS chain."""
    from d3stream.settings.sources import env_name

    values = {env_name(name): ",".join(value) if isinstance(value, list) else value
              for name, value in settings_of(stack, bucket).items()}
    values |= {"AWS_ACCESS_KEY_ID": stack.store.access_key, "AWS_SECRET_ACCESS_KEY": stack.store.secret_key,
               "AWS_REGION": stack.store.region}
    return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def toml_lines(stack: LocalStack, bucket: str) -> list[str]:
    """The same settings as top-level keys of a settings file (``--config``, ``D3STREAM_CONFIG``); a JSON string
    or array of strings is a valid TOML value."""
    return [f"{name} = {json.dumps(value)}" for name, value in settings_of(stack, bucket).items()]


def _write_env_file(path: Path, lines: list[str]) -> None:
    """All at once (a temporary file renamed over it), so a script waiting for the file never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(partial, path)


def _print_ready(stack: LocalStack, args: argparse.Namespace, topics: list[str], data: str) -> None:
    store, registry = stack.store, stack.registry
    rows = [("Kafka", f"{stack.broker.bootstrap_servers}   topics {', '.join(topics)} ({args.partitions} partitions)"),
            ("S3 store", f"{store.endpoint_url}   bucket {args.bucket}, region {store.region}")]
    if registry is not None:
        rows.append(("Schema Registry", registry.url))
    rows.append(("data and logs", data))
    print("\n".join(f"{name:<17}{value}" for name, value in rows))
    where = f" (also in {args.env_file}: source it)" if args.env_file else ""
    print(f"\n# the environment of serve, produce and consume{where}")
    print("\n".join(export_lines(stack, args.bucket)))
    print("\n# or as a settings file (--config FILE or D3STREAM_CONFIG), with the AWS_* lines above in the environment;"
          "\n# produce --upload-media reads the endpoint from D3STREAM_S3_ENDPOINT_URL or its own flag")
    print("\n".join(toml_lines(stack, args.bucket)))
    print("\nCtrl-C stops them.", flush=True)


def _tail(path: Path, size: int = 4000) -> str:
    """The end of a server's log (its last ``size`` bytes)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - size))
            return log.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(unreadable: {exc})"


def _watch(stack: LocalStack) -> int:
    """Wait for a signal (raised out of the sleep as :class:`_Stopped`); 1 if a server exits on its own."""
    servers = [stack.broker, stack.store, *([stack.registry] if stack.registry is not None else [])]
    while True:
        for server in servers:
            if not server.running:
                # the tail too: without --data-dir the log goes with the temporary folder
                print(f"d3stream stack: {server.label} exited on its own; its log {server.log_path} ends:\n"
                      f"{_tail(server.log_path)}", file=sys.stderr, flush=True)
                return 1
        time.sleep(_WATCH_INTERVAL_S)


def _stack(args: argparse.Namespace) -> int:
    if args.data_dir:
        root = Path(args.data_dir).resolve()
        return _run(args, root, f"{root} (kept)")
    with tempfile.TemporaryDirectory(prefix="d3stream-stack-") as temporary:
        return _run(args, Path(temporary), f"{temporary} (deleted when stopped; --data-dir keeps it)")


def _run(args: argparse.Namespace, root: Path, data: str) -> int:
    """Start the stack in ``root``, make it ready for a stream, print how to reach it, wait, stop."""
    from d3stream.dev.infra import InfraError, embedded_stack
    from d3stream.ops.logs import configure_logging

    configure_logging("console" if sys.stderr.isatty() else "json", "warning")
    topics = _split(args.topics or ["d3.requests"])
    env_file = Path(args.env_file).resolve() if args.env_file else None
    ready, status = False, 1
    try:
        with _stop_on_signals():
            print("d3stream stack: starting Kafka, the S3 store"
                  f"{'' if args.no_registry else ' and the Schema Registry'}", file=sys.stderr, flush=True)
            with embedded_stack(root, partitions=args.partitions, progress=True,
                                registry=not args.no_registry) as stack:
                try:
                    stack.store.create_bucket(args.bucket)
                    for topic in topics:
                        stack.broker.create_topic(topic, args.partitions, exist_ok=True)
                    if env_file is not None:
                        _write_env_file(env_file, export_lines(stack, args.bucket))
                    _print_ready(stack, args, topics, data)
                    ready = True
                    status = _watch(stack)
                finally:  # the lines name servers about to stop: a script must not source them again
                    if env_file is not None:
                        env_file.unlink(missing_ok=True)
                    print("d3stream stack: stopping the servers", file=sys.stderr, flush=True)
    except _Stopped as stopped:
        print("d3stream stack: stopped", file=sys.stderr, flush=True)
        return 0 if ready else 128 + stopped.signum
    except InfraError as exc:  # a server that would not start: its log's path and tail say why
        print(f"d3stream stack: {exc}", file=sys.stderr)
        return 1
    return status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", metavar="DIR",
                        help="keep the servers' data and logs here across runs (default: a temporary folder, "
                             "deleted when stopped)")
    parser.add_argument("--partitions", type=int, default=4,
                        help="partitions of the request topics (the most workers that can share them) and of "
                             "topics created on first use")
    parser.add_argument("--bucket", default="d3-media",
                        help="bucket created at start, for produce --upload-media and the media allowlist")
    parser.add_argument("--topics", action="append", metavar="TOPIC[,TOPIC]",
                        help="request topics to create (repeatable, comma-separated; default: d3.requests)")
    parser.add_argument("--no-registry", action="store_true", help="no Schema Registry (one JVM less to start)")
    parser.add_argument("--env-file", metavar="PATH",
                        help="also write the export lines to this file once the servers are ready (removed when "
                             "they stop), for a script to source")


COMMAND = Command(
    "stack", "run the embedded Kafka, S3 store and Schema Registry in the foreground for your own stream",
    add_arguments, _stack,
    description="Run the embedded Kafka broker, S3 store (S3Proxy) and Schema Registry (Apicurio) in the foreground "
                "and print the settings and environment lines that serve, produce and consume take; Ctrl-C "
                "(or SIGTERM) stops them cleanly.",
)

