"""Which writer schemas a reader takes: Avro schemas from a Schema Registry, admitted before anything is read
with them.

A framed record names its writer schema by id, and anyone allowed to register a schema anywhere in the registry
chooses what that schema is. So a schema is a request's input like its payload, and is checked before it is
trusted, once per id:

* **Bounded.** Its JSON text is at most ``MAX_SCHEMA_BYTES`` and nests at most ``MAX_SCHEMA_NESTING`` levels;
  expanded (each named type written out where it is used) it has at most ``MAX_SCHEMA_TYPES`` types. A schema
  past these would cost more to compile than any record it frames.
* **Not recursive.** A record that contains itself, directly or not, lets a payload nest as deep as its bytes
  allow; a reader that follows it recurses until the interpreter crashes (fastavro does, from about 5,000
  levels). The compiled reader does not recurse at run time, and no recursive schema reaches it.
* **Every count bounded by bytes.** An array whose items take no bytes (nulls, an empty record) lets 48 bytes
  claim 80 million items; such a schema is refused, so that a count can be checked against the bytes left.
* **Resolvable against the reader's schema.** Avro reads a record through its writer schema resolved against
  the reader's: fields the reader does not know are skipped, a reader field the writer lacks takes its
  default, and a type that cannot be promoted (a string where a long is read) is refused. Apache Avro's own
  compatibility checker (``avro.compatibility``, the Java library's rules) decides, against the contract's
  schema of the event read (``avro.avro_schema``), so a refusal names the place in the schema.
* **Compilable.** What is admitted is compiled into the reader (``avro_binary.compile_reader``), which then
  reads every record framed with it.

A refusal is an answer, not an outage: :class:`SchemaRefused` says why, and its reader remembers it for the id.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from d3stream_client import avro, avro_binary

# The contract's own schemas are 1.8 KB (a request) and 4.5 KB (an answer), nesting 5 and 12 levels as JSON,
# with 30 and 86 types. A schema of MAX_SCHEMA_TYPES costs about 20 MB to compile and keeps
# under 1 MB of code (a fuzz test holds admission to 64 MB).
MAX_SCHEMA_BYTES = 65_536
MAX_SCHEMA_NESTING = 64
MAX_SCHEMA_TYPES = 500

# The bytes an Avro value takes at least: a count or length is never believed beyond the bytes left divided by it.
_LEAST_BYTES = {"null": 0, "boolean": 1, "int": 1, "long": 1, "float": 4, "double": 8, "string": 1, "bytes": 1}


class SchemaRefused(ValueError):
    """A writer schema that no record is read with: the reason, naming the limit or the place in the schema."""


def admit(text: str, event: type[msgspec.Struct]) -> dict[str, object]:
    """fastavro's parsed form of the Avro writer schema ``text``, once it is admitted for reading ``event``
    records (the module docstring's rules); SchemaRefused saying why not."""
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise SchemaRefused(f"the schema is {size:,} bytes, over {MAX_SCHEMA_BYTES:,}")
    try:
        document = json.loads(text)
    except RecursionError as exc:
        raise SchemaRefused(f"the schema nests deeper than {MAX_SCHEMA_NESTING} levels") from exc
    except ValueError as exc:
        raise SchemaRefused(f"the schema is not JSON: {exc}") from exc
    if _nesting(document) > MAX_SCHEMA_NESTING:
        raise SchemaRefused(f"the schema nests deeper than {MAX_SCHEMA_NESTING} levels")
    parsed = _parsed(document)
    _check_shape(parsed)
    _check_resolves(document, event)
    try:  # the lean reader is the worker's; the full one takes the same types
        avro_binary.compile_reader(parsed, event, lean=True)
    except avro_binary.NotCompilable as exc:
        raise SchemaRefused(f"the schema cannot be read: {exc}") from exc
    return parsed


def record_name(text: str) -> str | None:
    """The name an Avro schema's JSON text gives its top-level record, when it is one within the size limit
    (which event a reader reads it as); None otherwise (``admit`` says why)."""
    document = _small_json(text)
    name = document.get("name") if isinstance(document, dict) else None
    return name if isinstance(name, str) else None


def schema_name(text: str) -> str | None:
    """The full name a schema gives itself, as a record name strategy names its subject: an Avro record's
    namespace and name, a JSON Schema's title; None for a schema without one or over the size limit."""
    document = _small_json(text)
    if not isinstance(document, dict):
        return None
    name, namespace, title = document.get("name"), document.get("namespace"), document.get("title")
    if isinstance(name, str):
        return f"{namespace}.{name}" if isinstance(namespace, str) and namespace and "." not in name else name
    return title if isinstance(title, str) else None


def _small_json(text: str) -> object:
    if len(text) > MAX_SCHEMA_BYTES:
        return None
    try:
        return json.loads(text)
    except (RecursionError, ValueError):
        return None


def _nesting(document: object) -> int:
    """How deep JSON arrays and objects nest in ``document`` (counted without recursion)."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        current, depth = stack.pop()
        if isinstance(current, dict):
            deepest = max(deepest, depth)
            stack.extend((value, depth + 1) for value in current.values())
        elif isinstance(current, list):
            deepest = max(deepest, depth)
            stack.extend((value, depth + 1) for value in current)
    return deepest


def _parsed(document: object) -> dict[str, object]:
    """fastavro's parsed form of a schema document that must be a record; SchemaRefused for anything fastavro
    cannot parse (an array without items raises KeyError there, not a parse error)."""
    import fastavro  # the registry extra's, as everything that reads framed records

    try:
        parsed = fastavro.parse_schema(document)  # type: ignore[arg-type]  # any JSON: refused below if wrong
    except Exception as exc:  # noqa: BLE001 - whatever fastavro raises, the schema is not one to read with
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise SchemaRefused(f"the schema is not a valid Avro schema ({reason})") from exc
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        raise SchemaRefused("the schema is not an Avro record (an event is one)")
    return parsed


def _check_shape(parsed: dict[str, object]) -> None:
    """SchemaRefused for a recursive schema, one too large once expanded, or an array of items that take no
    bytes. The walk follows named references with the records open on its path, and counts what it visits."""
    named: dict[str, Any] = parsed.get("__named_schemas", {})  # type: ignore[assignment]
    visited = 0

    def least(schema: object, path: str, open_records: tuple[str, ...]) -> int:
        nonlocal visited
        visited += 1
        if visited > MAX_SCHEMA_TYPES:
            raise SchemaRefused(f"the schema has over {MAX_SCHEMA_TYPES:,} types once its named types are written "
                                "out where they are used")
        if isinstance(schema, str):
            if schema in _LEAST_BYTES:
                return _LEAST_BYTES[schema]
            if schema in open_records:
                raise SchemaRefused(f"the schema is recursive: the record {schema} contains itself (at {path})")
            if schema not in named:
                raise SchemaRefused(f"the schema names an unknown type {schema!r} (at {path})")
            return least(named[schema], path, open_records)
        if isinstance(schema, list):
            if not schema:
                raise SchemaRefused(f"the schema has a union of no types (at {path})")
            return 1 + min(least(branch, path, open_records) for branch in schema)  # the index, then the branch
        if not isinstance(schema, dict):
            raise SchemaRefused(f"the schema has {schema!r} where a type goes (at {path})")
        kind = schema.get("type")
        if kind == "record":
            name = str(schema.get("name"))
            if name in open_records:
                raise SchemaRefused(f"the schema is recursive: the record {name} contains itself (at {path})")
            fields = schema.get("fields")
            assert isinstance(fields, list)  # fastavro parsed it
            return sum(least(field["type"], f"{path}.{field['name']}", (*open_records, name)) for field in fields)
        if kind == "array":
            if least(schema["items"], f"{path}[]", open_records) == 0:
                raise SchemaRefused(f"the schema has an array whose items take no bytes (at {path}): its count "
                                    "could not be checked against the bytes of a record")
            return 1
        if kind == "map":
            least(schema["values"], f"{path}{{}}", open_records)
            return 1  # every entry has a key of one byte at least
        if kind == "enum":
            return 1
        if kind == "fixed":
            size = schema.get("size")
            return size if isinstance(size, int) else 0
        if kind in _LEAST_BYTES:  # a primitive with a logical type
            return _LEAST_BYTES[str(kind)]
        return least(kind, path, open_records)

    least(parsed, "$", ())


def _check_resolves(document: object, event: type[msgspec.Struct]) -> None:
    """SchemaRefused, naming where, unless Avro's resolution rules read a record written with ``document`` as
    the contract's ``event`` schema (Apache Avro's checker: the Java library's ``SchemaCompatibility``)."""
    import avro.compatibility  # Apache Avro, which confluent-kafka's avro extra brings
    import avro.schema

    try:
        writer = avro.schema.parse(json.dumps(document))
    except Exception as exc:  # noqa: BLE001 - fastavro took it, Avro's reference parser did not: not readable
        raise SchemaRefused(f"the schema is not a valid Avro schema ({type(exc).__name__}: {exc})") from exc
    reader = avro.schema.parse(json.dumps(_contract_schema(event)))
    result = avro.compatibility.ReaderWriterCompatibilityChecker().get_compatibility(reader, writer)
    if result.compatibility is not avro.compatibility.SchemaCompatibilityType.compatible:
        if writer.fullname != reader.fullname and writer.name != reader.name:  # type: ignore[attr-defined]
            raise SchemaRefused(f"the schema's record is named {writer.fullname}, not {reader.fullname} "  # type: ignore[attr-defined]
                                f"(Avro resolves records by name)")
        places = sorted(location for location in result.locations if location != "/")
        reasons = "; ".join(sorted(result.messages))
        raise SchemaRefused(f"the schema does not resolve against the {event.__name__} schema read here: {reasons}"
                            + (f" (at {', '.join(places)})" if places else ""))


_CONTRACT_SCHEMAS: dict[type[msgspec.Struct], dict[str, object]] = {}


def _contract_schema(event: type[msgspec.Struct]) -> dict[str, object]:
    known = _CONTRACT_SCHEMAS.get(event)
    if known is None:
        known = _CONTRACT_SCHEMAS[event] = avro.avro_schema(event)
    return known
