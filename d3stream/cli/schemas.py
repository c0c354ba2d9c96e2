"""``d3stream schemas``: the event schemas a Schema Registry holds, shown or registered ahead of a deployment.

In production the worker does not register its schemas (``schema_auto_register`` off): whoever owns the
registry registers them once, here, and the registry's compatibility checks decide whether a new release's
schemas may replace the old ones. A worker then finds them at start, or stops there saying which subject is
missing. ``show`` prints a schema as it would be registered, for a review or a producer in another language.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from d3stream.cli.common import Refused, reach_registry, registry_format
from d3stream.cli.shape import Command

# The topics whose records a deployment writes or reads through the registry, by the event each carries.
_TOPIC_SETTINGS = ("request_topics", "answer_topic", "dead_letter_topic", "shadow_topic", "evaluation_topic",
                   "label_topic", "label_dead_letter_topic")


def _show(args: argparse.Namespace) -> int:
    from d3stream_client import avro
    from d3stream_client.schemas import SCHEMAS

    from d3stream.kafka.registry import registry_json_schema

    event = SCHEMAS[args.event]
    schema = avro.avro_schema(event) if args.format == "avro" else registry_json_schema(event)
    print(json.dumps(schema, indent=2))
    return 0


def _register(args: argparse.Namespace) -> int:
    import msgspec
    from d3stream_client.contract import Answer, DeadLetter, Evaluation, Label, Request

    from d3stream.kafka.registry import Registry
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
    except ValueError as exc:
        raise Refused(str(exc)) from exc
    chosen = settings.registry
    client_format = registry_format(settings)
    if client_format is None or chosen.answer_format == "json":
        raise Refused("set schema_registry_url and answer_format (avro or json_schema): the format the schemas are "
                      "registered in")
    # One request first: the worker's registry client waits out an outage, which here would be a hang.
    asyncio.run(reach_registry(client_format))
    delivery, evaluation = settings.delivery, settings.evaluation
    topics: dict[str, type[msgspec.Struct]] = {topic: Request for topic in delivery.request_topics}
    topics.update({delivery.answer_topic: Answer, delivery.dead_letter_topic: DeadLetter})
    if settings.models.shadow_topic:
        topics[settings.models.shadow_topic] = Answer
    if args.evaluation:
        topics.update({evaluation.label_topic: Label, evaluation.evaluation_topic: Evaluation,
                       evaluation.label_dead_letter_topic: DeadLetter})
    registry = Registry(msgspec.structs.replace(chosen, schema_auto_register=True))
    try:
        written = asyncio.run(registry.writers_for(topics))
    except RuntimeError as exc:
        print(f"d3stream schemas register: {exc}", file=sys.stderr)
        return 1
    for topic, (schema_id, event) in written.schemas.items():
        print(f"{topic}\t{event.__name__}\tschema id {schema_id}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import SETTINGS
    from d3stream.settings import add_arguments as add_settings

    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print one event's schema as it is registered")
    show.add_argument("format", choices=["avro", "json_schema"])
    show.add_argument("event", choices=["request", "answer", "dead-letter", "label", "evaluation"])
    register = actions.add_parser(
        "register", help="register the request, answer and dead-letter schemas under their topics' subjects")
    register.add_argument("--evaluation", action="store_true",
                          help="also the label, evaluation and label dead-letter schemas (d3stream evaluate)")
    registry_settings = tuple(name for name, setting in SETTINGS.items() if setting.section == "registry")
    add_settings(register, only=registry_settings + _TOPIC_SETTINGS)


def _run(args: argparse.Namespace) -> int:
    return _show(args) if args.action == "show" else _register(args)


COMMAND = Command(
    "schemas", "show or register the event schemas in a Schema Registry", add_arguments, _run,
    description=__doc__.split("\n\n")[0] if __doc__ else None,
)
