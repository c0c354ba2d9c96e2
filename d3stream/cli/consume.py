"""``d3stream consume TOPIC``: print answer events as JSON lines (each request id once); with
``--schema-registry-url``, records framed by the registry (Avro, JSON Schema) decoded beside plain ones.

A topic the cluster does not have is refused at once, with the names closest to it (``d3.answerz`` is most
likely a typo of ``d3.answers``, and waiting an hour for it helps no one); ``--wait-for-topic`` waits for a
topic that a worker will create."""

from __future__ import annotations

import argparse
import json

from d3stream.cli.common import (
    CLIENT_REGISTRY_HELP,
    Refused,
    closing,
    connection,
    missing_topic,
    registry_fields,
    registry_format,
    run_kafka,
)
from d3stream.cli.shape import Command


def _consume(args: argparse.Namespace) -> int:
    from d3stream_client.subscriber import consume_answers

    from d3stream.kafka.connection import client_options

    settings = connection(args)
    options = client_options(settings.connection, "consumer", client_id=settings.connection.client_id)
    servers = options.pop("bootstrap_servers")

    def show(answer: dict) -> None:
        print(json.dumps(answer, ensure_ascii=False), flush=True)

    def topic_exists(topics: set[str]) -> None:
        """A topic the cluster lacks (a typo, most often) is said at once, not waited for until --timeout."""
        if args.topic not in topics and not args.wait_for_topic:
            raise Refused(missing_topic(args.topic, topics, servers, "--wait-for-topic"))

    registry = registry_format(settings)
    return run_kafka(settings, lambda stop_asked: closing(registry, consume_answers(
        servers, args.topic, expected=args.max, timeout_s=args.timeout, idle_s=args.idle, security=options,
        on_record=show, stop=stop_asked, registry=registry)), check=topic_exists)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import CONNECTION_FIELDS
    from d3stream.settings import add_arguments as add_settings

    parser.add_argument("topic")
    parser.add_argument("--max", type=int, default=None, help="stop after this many distinct request ids")
    parser.add_argument("--timeout", type=float, default=3600.0, help="stop after this many seconds")
    parser.add_argument("--idle", type=float, default=None, help="stop after this many seconds without a record")
    parser.add_argument("--wait-for-topic", action="store_true",
                        help="a topic that does not exist yet is waited for (until --timeout); without it, the "
                             "command stops at once saying so (exit status 2)")
    add_settings(parser, only=CONNECTION_FIELDS + registry_fields(writing=False), described=CLIENT_REGISTRY_HELP)


COMMAND = Command("consume", "print answer events as JSON lines", add_arguments, _consume)
