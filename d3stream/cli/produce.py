"""``d3stream produce TOPIC FILE``: publish request events from a JSON-lines file (media files named by
requests uploaded first with ``--upload-media``), or label events with ``--labels``, as plain JSON or checked
and framed for a Schema Registry with ``--format avro|json_schema``.

Every line is checked before anything is sent (or uploaded), with the client's own checks
(``d3stream_client.validation``: what a worker would refuse without its model): a line that is not a valid
request is listed with its line number and the worker's reason, and nothing is published (exit status 2), so a
malformed file never reaches the topic half sent. ``--skip-invalid`` publishes the valid lines and lists the
others (exit status 1: not everything was sent); ``--unchecked`` publishes every line as it stands (to see how
a worker answers what is not a request).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from d3stream.cli.common import (
    CLIENT_REGISTRY_HELP,
    Refused,
    closing,
    connection,
    reach_kafka,
    registry_fields,
    registry_format,
    run_kafka,
)
from d3stream.cli.shape import Command

# The exit status when --skip-invalid left lines out: the valid ones were published, not everything was.
SKIPPED_EXIT = 1
# Invalid lines listed one by one; the rest are counted (a file of the wrong kind would fill the terminal).
LISTED_INVALID = 20


class Line(NamedTuple):
    """One nonblank line of the file: its number (1-based, blank lines counted) and its text."""

    number: int
    text: str


class Invalid(NamedTuple):
    """A line that is not a valid event: where it is, the worker's error code and its reason."""

    line: Line
    code: str
    reason: str


def _record(line: str) -> tuple[bytes | None, bytes]:
    """(key, value) of one JSON line, keyed by its ``id``; a line that is not a JSON object is sent verbatim
    without a key (``--unchecked`` publishes what the file holds: the worker answers what is not a request)."""
    try:
        document = json.loads(line)
    except json.JSONDecodeError:
        return None, line.encode("utf-8", "surrogateescape")
    key = document.get("id") if isinstance(document, dict) else None
    return (str(key).encode() if key is not None else None), line.encode("utf-8", "surrogateescape")


def _read_lines(source: str) -> list[Line]:
    """The nonblank lines of the file (- for stdin), numbered as an editor numbers them; Refused when the file
    cannot be read."""
    try:
        stream = sys.stdin if source == "-" else open(source, encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
        with stream:
            return [Line(number, raw.rstrip("\n")) for number, raw in enumerate(stream, 1) if raw.strip()]
    except OSError as exc:
        raise Refused(f"cannot read {source}: {exc.strerror or exc}") from exc


def validator(labels: bool) -> Callable[[bytes], object]:
    """The client's check of one record value: a request's (``validate_request``) or a label's."""
    from d3stream_client.validation import validate_label, validate_request

    return validate_label if labels else validate_request


def invalid_lines(lines: list[Line], *, labels: bool) -> list[Invalid]:
    """The lines a worker (or d3stream evaluate, for labels) would refuse, with its code and reason."""
    from d3stream_client.validation import EventError

    check = validator(labels)
    invalid = []
    for line in lines:
        try:
            check(line.text.encode("utf-8", "surrogateescape"))
        except EventError as exc:
            invalid.append(Invalid(line, exc.code, str(exc)))
    return invalid


def _look_like_labels(invalid: list[Invalid]) -> bool:
    """Whether the lines refused as requests are all labels (``--labels`` forgotten)."""
    return not invalid_lines([each.line for each in invalid], labels=True)


def _report(invalid: list[Invalid], source: str, total: int, *, labels: bool, skipping: bool) -> None:
    """Each invalid line (up to ``LISTED_INVALID``) as FILE:LINE: code: reason; then, unless ``skipping``,
    Refused saying that nothing was sent."""
    where = "stdin" if source == "-" else source
    for each in invalid[:LISTED_INVALID]:
        print(f"d3stream produce: {where}:{each.line.number}: {each.code}: {each.reason}", file=sys.stderr)
    if len(invalid) > LISTED_INVALID:
        print(f"d3stream produce: ... and {len(invalid) - LISTED_INVALID} more", file=sys.stderr)
    if skipping:
        return
    counted, verb = ("line" if total == 1 else "lines"), ("is" if len(invalid) == 1 else "are")
    count = f"{len(invalid)} of {total} {counted} {verb} not a valid {'label' if labels else 'request'}"
    hint = ("; they are label events: pass --labels" if not labels and _look_like_labels(invalid)
            else " (--skip-invalid sends the valid ones, --unchecked every line as it stands)")
    raise Refused(f"{count}; nothing was sent{hint}")


def _produce(args: argparse.Namespace) -> int:
    from d3stream_client.media import rewrite_media
    from d3stream_client.publisher import produce
    from tqdm import tqdm

    from d3stream.kafka.connection import client_options

    settings = connection(args)
    registry = None if args.format == "json" else registry_format(settings, args.format)
    if args.format != "json" and registry is None:
        raise Refused(f"--format {args.format} writes through a Schema Registry: set --schema-registry-url")
    if args.format != "json" and args.labels:
        raise Refused(f"--format {args.format} frames requests; labels are published as JSON (leave --format out)")
    lines = _read_lines(args.file)
    invalid = [] if args.unchecked else invalid_lines(lines, labels=args.labels)
    if invalid:
        _report(invalid, args.file, len(lines), labels=args.labels, skipping=args.skip_invalid)
        left_out = {each.line.number for each in invalid}
        lines = [line for line in lines if line.number not in left_out]
    client = None
    endpoint = args.s3_endpoint_url or settings.storage.s3_endpoint_url
    if args.upload_media:
        import boto3

        reach_kafka(settings)  # nothing uploaded for a topic that cannot be written
        client = boto3.client("s3", endpoint_url=endpoint, region_name=settings.storage.s3_region)
    base = Path(args.file).parent if args.file != "-" else Path.cwd()
    records = []
    for line in lines:
        key, value = _record(line.text)
        if client is not None and key is not None and not args.labels:
            try:
                request = rewrite_media(json.loads(value), client, args.upload_media, base)
            except Exception as exc:  # noqa: BLE001 - botocore's errors are many; each is the store's answer
                raise Refused(f"could not upload the media of {key.decode(errors='replace')} to bucket "
                              f"{args.upload_media!r} at {endpoint or 'AWS'}: {exc}; check --upload-media, "
                              "--s3-endpoint-url (s3_endpoint_url) and the store's credentials") from exc
            value = json.dumps(request, ensure_ascii=False).encode()
        records.append((key, value))
    bar = tqdm(total=len(records), desc=f"produce {args.topic}", unit="req", file=sys.stderr,
               disable=not sys.stderr.isatty())
    options = client_options(settings.connection, "producer", client_id=settings.connection.client_id)
    servers = options.pop("bootstrap_servers")
    try:
        run_kafka(settings, lambda _stop_asked: closing(registry, produce(
            servers, args.topic, records, security=options, on_sent=bar.update, registry=registry)))
    finally:
        bar.close()
    skipped = f"; {len(invalid)} invalid {'line' if len(invalid) == 1 else 'lines'} left out (listed above)"
    print(f"published {len(records)} records to {args.topic}{skipped if invalid else ''}", file=sys.stderr)
    return SKIPPED_EXIT if invalid else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import CONNECTION_FIELDS
    from d3stream.settings import add_arguments as add_settings

    parser.add_argument("topic")
    parser.add_argument("file", help="JSON lines, one request (or label, --labels) per line (- for stdin)")
    parser.add_argument("--upload-media", metavar="BUCKET",
                        help="upload local media files named by requests and rewrite them to s3:// references")
    parser.add_argument("--s3-endpoint-url", default=os.environ.get("D3STREAM_S3_ENDPOINT_URL"),
                        help="the object store --upload-media writes to (default: s3_endpoint_url of the settings "
                             "file, else AWS)")
    parser.add_argument("--format", choices=("json", "avro", "json_schema"), default="json",
                        help="json: each line as it stands (default); avro or json_schema: each line framed for "
                             "the Schema Registry (--schema-registry-url)")
    parser.add_argument("--labels", action="store_true",
                        help="the lines are label events (d3stream evaluate's), checked as labels, not requests")
    checking = parser.add_mutually_exclusive_group()
    checking.add_argument("--skip-invalid", action="store_true",
                          help="publish the valid lines and list the others (exit status 1); without it, one "
                               "invalid line means nothing is sent (exit status 2)")
    checking.add_argument("--unchecked", action="store_true",
                          help="publish every line as it stands, requests or not (to see what a worker answers "
                               "to what is not a request)")
    add_settings(parser, only=CONNECTION_FIELDS + registry_fields(writing=True), described=CLIENT_REGISTRY_HELP)


COMMAND = Command("produce", "publish request events from a JSON-lines file, each line checked first",
                  add_arguments, _produce)
