"""The JSON Schemas and Avro schemas of the events, generated from the contract's Structs.

``python -m d3stream_client.schemas FOLDER`` writes ``request``, ``answer``, ``dead-letter``, ``label`` and
``evaluation`` ``.schema.json`` files, and an ``.avsc`` file of each (its Avro schema, for a Schema Registry:
``d3stream_client.avro``); the repository keeps them in ``schemas/`` for producers in other languages, and a
test fails when the checked-in files drift from the Structs. :func:`registry_json_schema` is the JSON Schema
in the form a Schema Registry takes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from d3stream_client.avro import avro_schema
from d3stream_client.contract import SCHEMA_VERSION, Answer, DeadLetter, Evaluation, Label, Request

SCHEMAS: dict[str, type[msgspec.Struct]] = {
    "request": Request, "answer": Answer, "dead-letter": DeadLetter, "label": Label, "evaluation": Evaluation,
}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one event type, as checked in under ``schemas/``."""
    schema = msgspec.json.schema(SCHEMAS[name])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://d3stream.invalid/schemas/{name}.schema.json"
    schema["x-d3stream-schema-version"] = SCHEMA_VERSION
    return schema


def registry_json_schema(event: type[msgspec.Struct]) -> dict[str, object]:
    """The event's JSON Schema (as checked in under ``schemas/``) with its root definition at the top, the form
    registered with a Schema Registry: registries (Apicurio's among them) want the root to say its ``type``
    rather than ``$ref`` it. The worker registers its answers' and dead letters' schemas in this form, and the
    client its requests' (``d3stream_client.registry``), so both sides register the same text."""
    names = {struct: name for name, struct in SCHEMAS.items()}
    schema = json_schema(names[event])
    definitions = dict(schema.pop("$defs"))
    root = definitions.pop(event.__name__)
    schema.pop("$ref", None)
    return {**schema, **root, **({"$defs": definitions} if definitions else {})}


def event_avro_schema(name: str) -> dict[str, object]:
    """The Avro schema of one event type, as checked in under ``schemas/`` (``<name>.avsc``)."""
    return avro_schema(SCHEMAS[name])


def write_schemas(folder: Path) -> list[Path]:
    """Write every event's JSON Schema and Avro schema into ``folder``; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SCHEMAS:
        path = folder / f"{name}.schema.json"
        path.write_text(json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(path)
        # Not sorted: an Avro record's fields are in order, and the order is part of the binary form.
        path = folder / f"{name}.avsc"
        path.write_text(json.dumps(event_avro_schema(name), indent=2) + "\n", encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m d3stream_client.schemas FOLDER")
    for written in write_schemas(Path(sys.argv[1])):
        print(written)
