"""``d3stream produce TOPIC FILE``: publish request events from a JSON-lines file (media files named by
requests uploaded first with ``--upload-media``), as they stand, or checked and framed for a Schema Registry
with ``--format avro|json_schema``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from d3stream.cli.common import (
    CLIENT_REGISTRY_HELP,
    closing,
    connection,
    registry_fields,
    registry_format,
    run_kafka,
)
from d3stream.cli.shape import Command


def _record(line: str) -> tuple[bytes | None, bytes]:
    """(key, value) of one JSON line, keyed by its ``id``; a line that is not a JSON object is sent verbatim
    without a key (``produce`` publishes what the file holds: the worker answers what is not a request)."""
    try:
        document = json.loads(line)
    except json.JSONDecodeError:
        return None, line.encode("utf-8", "surrogateescape")
    key = document.get("id") if isinstance(document, dict) else None
    return (str(key).encode() if key is not None else None), line.encode("utf-8")


def _produce(args: argparse.Namespace) -> int:
    from d3stream_client.media import rewrite_media
    from d3stream_client.publisher import produce
    from tqdm import tqdm

    from d3stream.kafka.connection import client_options

    settings = connection("produce", args)
    if settings is None:
        return 2
    registry = None if args.format == "json" else registry_format(settings, args.format)
    if args.format != "json" and registry is None:
        print(f"d3stream produce: --format {args.format} writes through a Schema Registry: set "
              "--schema-registry-url", file=sys.stderr)
        return 2
    source = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
    with source:
        lines = [line for line in (raw.rstrip("\n") for raw in source) if line.strip()]
    client = None
    endpoint = args.s3_endpoint_url or settings.storage.s3_endpoint_url
    if args.upload_media:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name=settings.storage.s3_region)
    base = Path(args.file).parent if args.file != "-" else Path.cwd()
    records = []
    for line in lines:
        key, value = _record(line)
        if client is not None and key is not None:
            try:
                request = rewrite_media(json.loads(value), client, args.upload_media, base)
            except Exception as exc:  # noqa: BLE001 - botocore's errors are many; each is the store's answer
                print(f"d3stream produce: could not upload the media of {key.decode(errors='replace')} to bucket "
                      f"{args.upload_media!r} at {endpoint or 'AWS'}: {exc}; check --upload-media, "
                      "--s3-endpoint-url (s3_endpoint_url) and the store's credentials", file=sys.stderr)
                return 2
            value = json.dumps(request, ensure_ascii=False).encode()
        records.append((key, value))
    bar = tqdm(total=len(records), desc=f"produce {args.topic}", unit="req", file=sys.stderr,
               disable=not sys.stderr.isatty())
    options = client_options(settings.connection, "producer", client_id=settings.connection.client_id)
    servers = options.pop("bootstrap_servers")
    status = run_kafka("produce", settings, closing(registry, produce(servers, args.topic, records, security=options,
                                                                      on_sent=bar.update, registry=registry)))
    bar.close()
    if status == 0:
        print(f"published {len(records)} records to {args.topic}", file=sys.stderr)
    return status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import CONNECTION_FIELDS
    from d3stream.settings import add_arguments as add_settings

    parser.add_argument("topic")
    parser.add_argument("file", help="JSON lines, one request per line (- for stdin)")
    parser.add_argument("--upload-media", metavar="BUCKET",
                        help="upload local media files named by requests and rewrite them to s3:// references")
    parser.add_argument("--s3-endpoint-url", default=os.environ.get("D3STREAM_S3_ENDPOINT_URL"),
                        help="the object store --upload-media writes to (default: s3_endpoint_url of the settings "
                             "file, else AWS)")
    parser.add_argument("--format", choices=("json", "avro", "json_schema"), default="json",
                        help="json: each line as it stands (default); avro or json_schema: each line checked as a "
                             "request and framed for the Schema Registry (--schema-registry-url)")
    add_settings(parser, only=CONNECTION_FIELDS + registry_fields(writing=True), described=CLIENT_REGISTRY_HELP)


COMMAND = Command("produce", "publish request events from a JSON-lines file", add_arguments, _produce)
