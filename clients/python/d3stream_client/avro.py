"""The events in Avro, for a Schema Registry estate: schemas generated from the contract's Structs, and the
conversion of an event's JSON document to its Avro datum and back.

A site that runs its Kafka on a Schema Registry (the Confluent wire format: a zero byte, the schema's
registry id, the Avro binary) wants every topic's records in a registered schema, and Connect sinks that
store them as table rows. The JSON events stay the contract; this module gives each of them an Avro form
that cannot drift from it. :func:`avro_schema` walks ``msgspec.inspect.type_info`` of an event's Struct, so
a field added to a Struct is in its Avro schema the next time ``python -m d3stream_client.schemas schemas``
writes ``schemas/*.avsc`` (a test fails until it does). No Avro schema is written by hand.

The mapping: a Struct is a record named after its class, in the namespace ``d3stream.v<SCHEMA_VERSION>``;
a nested Struct is defined where it first appears and named after that. Fields carry their encode names
(``DeadLetter.value`` is ``value_base64``), their ``msgspec.Meta`` description as ``doc`` and their default
as the Avro default. ``str``, ``int``, ``float`` and ``bool`` are ``string``, ``long``, ``double`` and
``boolean``; ``X | None`` is ``["null", X]`` (null first when the default is None: an Avro union's default
is of its first branch); ``list[T]`` is an array, ``dict[str, T]`` a map; a ``Literal`` of strings is a
plain string (its values named in the doc), so a new priority or role is not a breaking schema change; a
union of scalars (a label's ``str | bool | int``) is an Avro union, which keeps ``true``, ``1`` and
``"1"`` apart. The constraints of the JSON contract (lengths, bounds) are not Avro's: the worker still
checks a request read from Avro as it checks one read from JSON.

Free-form JSON (a field typed ``Any``: a request's ``state``, ``metadata`` and each of its ``questions``,
each of an answer's ``answers``) travels as JSON text in an Avro ``string`` (``["null", "string"]`` where
the field may be null; its ``doc`` says "JSON text"). A question's or an answer's shape is the model's
business, not the contract's, so Avro gets no record for it, and a Connect sink stores such a field as a
text column a database can still query as JSON. :func:`to_avro` encodes those values and fills the fields
a JSON document leaves out with their defaults; :func:`from_avro` parses them back, and a text that is not
JSON is a ``ValueError`` naming the field (the worker answers such a request ``invalid_request``). Fields a
JSON document carries that its Struct does not know are dropped: Avro has nowhere to put them.

:func:`from_avro` gives the document the contract's own encoder writes for the event: every field of a
Struct, except where the Struct leaves fields at their default out (``omit_defaults``, as ``Answer`` and
``Label`` do); there a field equal to its default is left out. (msgspec compares a few defaults by identity,
so it may write a computed ``0.0`` that this leaves out; both decode to the same Struct.)

Generating a schema needs msgspec only. Writing Avro binary or the Confluent framing is a serializer's job
(fastavro, or confluent-kafka's ``AvroSerializer`` with ``to_dict`` calling :func:`to_avro`): install
``d3stream-client[registry]``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence

import msgspec
import msgspec.inspect as mi

from d3stream_client.contract import SCHEMA_VERSION, spoken_list

NAMESPACE = f"d3stream.v{SCHEMA_VERSION}"
# Avro's rule for record and field names.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALARS: dict[type[mi.Type], str] = {
    mi.StrType: "string", mi.IntType: "long", mi.FloatType: "double", mi.BoolType: "boolean", mi.NoneType: "null",
}


def avro_schema(event: type[msgspec.Struct]) -> dict[str, object]:
    """The Avro schema (its parsed JSON form) of an event's Struct, generated from its type information.

    TypeError when the Struct has a field Avro cannot carry as this module maps types (bytes, tuples, a
    union of two records, two Structs of one name)."""
    schema = _Generator().record(struct_info(event), "$", NAMESPACE)
    assert isinstance(schema, dict)  # the first record of a schema is always a definition
    return schema


def to_avro(document: Mapping[str, object], event: type[msgspec.Struct], *,
            fastavro_unions: bool = False) -> dict[str, object]:
    """The Avro datum of an event's JSON document (its ``msgspec.to_builtins`` form, or the parsed JSON of a
    record): free-form values as JSON text, absent fields at their defaults. ValueError naming the field
    when a required field is absent or a record, array or map is not an object or array; a scalar of the
    wrong type is left for the Avro writer to refuse.

    With ``fastavro_unions`` a record or map in a union is given as fastavro's ``(branch name, value)``
    tuple: fastavro's writer then skips validating the value against each branch to find its own, a third
    of its time for an answer. Only fastavro's writer (confluent-kafka's ``AvroSerializer`` uses it) reads
    that form."""
    datum = _record_converter(event, _TO_FASTAVRO if fastavro_unions else _TO)(document, "$")
    assert isinstance(datum, dict)  # a record's conversion makes a dict
    return datum


def from_avro(datum: Mapping[str, object], event: type[msgspec.Struct], *, lean: bool = False) -> dict[str, object]:
    """The JSON document of an event's Avro datum, as the contract's encoder writes it (module docstring); with
    ``lean``, every field at its default is left out, as a Struct that omits defaults does (a smaller document
    that decodes to the same event: what a reader that decodes it next wants). ValueError naming the field when
    a JSON-text field does not parse."""
    document = _record_converter(event, _FROM_LEAN if lean else _FROM)(datum, "$")
    assert isinstance(document, dict)  # as above
    return document


# ------------------------------------------------------------------------------------------ types


@functools.cache  # an event's type information is fixed, and building it costs more than converting a datum
def struct_info(event: type[msgspec.Struct]) -> mi.StructType:
    info = mi.type_info(event)
    if not isinstance(info, mi.StructType):
        raise TypeError(f"{event!r} is not a msgspec Struct")
    return info


def bare_type(kind: mi.Type) -> mi.Type:
    while isinstance(kind, mi.Metadata):
        kind = kind.type
    return kind


def field_type(field: mi.Field) -> mi.Type:
    """A field's type, where an ``Any`` field whose default is None counts as ``Any | None``: its null
    travels as an Avro null (not as the JSON text ``null``), as for any other optional field."""
    if isinstance(bare_type(field.type), mi.AnyType) and field.default is None:
        return mi.UnionType((field.type, mi.NoneType()))
    return field.type


def _members(union: mi.UnionType, path: str) -> tuple[bool, list[mi.Type]]:
    """Whether the union admits None, and its other members; TypeError for a union an Avro datum could not
    tell apart by the JSON value alone (two records, two containers, free-form JSON beside a scalar)."""
    others = [member for member in union.types if not isinstance(bare_type(member), mi.NoneType)]
    structured = [m for m in others if not isinstance(bare_type(m), (*_SCALARS, mi.LiteralType))]
    if len(structured) > 1 or (structured and len(others) > 1):
        raise TypeError(f"{path}: the union {union} has no Avro mapping here (one record, container or "
                        "free-form value, or scalars only)")
    return len(others) < len(union.types), others


def _json_default(field: mi.Field) -> object:
    """A field's default as the JSON document carries it."""
    if field.default is not msgspec.NODEFAULT:
        return msgspec.to_builtins(field.default)
    return msgspec.to_builtins(field.default_factory())


def _avro_kind(value: object) -> str:
    """The Avro type a default's value is of, to find its branch in a union."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "long"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _branch_kind(branch: object) -> str:
    if isinstance(branch, str):
        return branch if branch in _SCALARS.values() else "object"  # a record's name
    assert isinstance(branch, dict)
    kind = branch["type"]
    return "array" if kind == "array" else "object"  # a map or a record


class _Generator:
    """One schema's walk: the records defined so far, so each is defined once and named afterwards."""

    def __init__(self) -> None:
        self.defined: dict[str, type] = {}

    def record(self, info: mi.StructType, path: str, namespace: str | None = None) -> dict[str, object] | str:
        cls = info.cls
        name = cls.__name__
        if name in self.defined:
            if self.defined[name] is not cls:
                raise TypeError(f"{path}: two Structs named {name} ({self.defined[name]!r}, {cls!r})")
            return name
        if not _NAME.fullmatch(name):
            raise TypeError(f"{path}: {name!r} is not an Avro name")
        if info.array_like or info.tag_field is not None:
            raise TypeError(f"{path}: {name} is array-like or tagged; its JSON form is not an Avro record")
        self.defined[name] = cls
        record: dict[str, object] = {"type": "record", "name": name}
        if namespace is not None:
            record["namespace"] = namespace
        if cls.__doc__:
            record["doc"] = " ".join(cls.__doc__.split())  # the docstring, on one line
        record["fields"] = [self.field(field, f"{path}.{field.encode_name}") for field in info.fields]
        return record

    def field(self, field: mi.Field, path: str) -> dict[str, object]:
        if not _NAME.fullmatch(field.encode_name):
            raise TypeError(f"{path}: {field.encode_name!r} is not an Avro field name")
        docs: list[str] = []
        avro_type = self.type(field_type(field), path, docs, "")
        entry: dict[str, object] = {"name": field.encode_name, "type": avro_type}
        if docs:
            entry["doc"] = "; ".join(docs)
        if not field.required:
            # A Struct-valued default (Provenance.batch, Answer.provenance) is the default Struct's record:
            # Avro allows a record default, and the field stays what it is in JSON, never null.
            default = _compile(field_type(field), _TO, path)(_json_default(field), path)
            if isinstance(avro_type, list):  # a union's default must be of its first branch
                kind = _avro_kind(default)
                first = next((b for b in avro_type if _branch_kind(b) == kind or (kind == "long" and b == "double")),
                             None)
                if first is None:
                    raise TypeError(f"{path}: the default {default!r} is none of {avro_type}")
                avro_type.remove(first)
                avro_type.insert(0, first)
            entry["default"] = default
        return entry

    def type(self, kind: mi.Type, path: str, docs: list[str], where: str) -> object:
        """The Avro type of ``kind``, adding what its descriptions say to ``docs`` (``where``: which part of
        the field they describe, empty for the field itself)."""
        while isinstance(kind, mi.Metadata):
            description = (kind.extra_json_schema or {}).get("description")
            if isinstance(description, str):
                docs.append(f"{where}: {description}" if where else description)
            kind = kind.type
        if type(kind) in _SCALARS:
            return _SCALARS[type(kind)]
        if isinstance(kind, mi.AnyType):
            docs.append(f"{where}: JSON text" if where else "JSON text")
            return "string"
        if isinstance(kind, mi.LiteralType):
            values = kind.values
            if all(isinstance(value, str) for value in values):
                docs.append(f"{where + ': ' if where else ''}one of {spoken_list([str(v) for v in values])}")
                return "string"
            if all(isinstance(value, int) for value in values):
                return "long"
            raise TypeError(f"{path}: a Literal of mixed types has no Avro mapping")
        if isinstance(kind, mi.ListType):
            return {"type": "array", "items": self.type(kind.item_type, f"{path}[]", docs, _inner(where, "each item"))}
        if isinstance(kind, mi.DictType):
            if not isinstance(bare_type(kind.key_type), mi.StrType):
                raise TypeError(f"{path}: an Avro map's keys are strings, not {kind.key_type}")
            return {"type": "map", "values": self.type(kind.value_type, f"{path}{{}}", docs, _inner(where, "each value"))}
        if isinstance(kind, mi.StructType):
            return self.record(kind, path)
        if isinstance(kind, mi.UnionType):
            nullable, others = _members(kind, path)
            branches = [self.type(member, path, docs, where) for member in others]
            if len({str(branch) for branch in branches}) < len(branches):  # int | Literal[1, 2]: long twice
                raise TypeError(f"{path}: {kind} maps to an Avro union with two branches of one type")
            return ["null", *branches] if nullable else branches
        raise TypeError(f"{path}: {kind} has no Avro mapping in d3stream_client.avro")


def _inner(where: str, part: str) -> str:
    return f"{where}, {part}" if where else part


# ------------------------------------------------------------------------------------------ documents
#
# A conversion walks the event's type information once, into nested functions (a Convert per field), and
# is kept per event: walking msgspec's type information for every datum cost ten times the Avro codec.

Convert = Callable[[object, str], object]  # (value, its path for an error message) -> the converted value
_ENCODE_JSON = msgspec.json.Encoder()
# The directions of a conversion: to an Avro datum (plain, or with fastavro's union tuples), or from one (every
# field, or those not at their default).
_TO, _TO_FASTAVRO, _FROM, _FROM_LEAN = "to", "to fastavro", "from", "from, lean"
_FROMS = (_FROM, _FROM_LEAN)


@functools.cache
def _record_converter(event: type[msgspec.Struct], direction: str) -> Convert:
    return _compile(struct_info(event), direction, "$")


def _compile(kind: mi.Type, direction: str, path: str) -> Convert:
    """The conversion of a value of ``kind`` in ``direction``: to its Avro datum, or back to its document."""
    to = direction not in _FROMS
    kind = bare_type(kind)
    if isinstance(kind, mi.UnionType):
        return _compile_union(kind, direction, path)
    if isinstance(kind, mi.AnyType):
        return _json_text if to else _parsed_json_text
    if isinstance(kind, mi.StructType):
        return _compile_record(kind, direction, path)
    if isinstance(kind, mi.ListType):
        item = _compile(kind.item_type, direction, f"{path}[]")

        def array(value: object, where: str) -> object:
            return [item(each, f"{where}[{index}]") for index, each in enumerate(_sequence(value, where))]
        return array
    if isinstance(kind, mi.DictType):
        entry = _compile(kind.value_type, direction, f"{path}[]")

        def map_(value: object, where: str) -> object:
            return {key: entry(each, f"{where}[{key!r}]") for key, each in _mapping(value, where).items()}
        return map_
    return _as_is  # a scalar: Avro's writer checks it against the schema


def _compile_union(kind: mi.UnionType, direction: str, path: str) -> Convert:
    nullable, others = _members(kind, path)
    if len(others) > 1:  # scalars only (_members): the Avro writer picks the branch
        return _as_is
    inner = _compile(others[0], direction, path)
    branch = _branch_name(others[0]) if direction == _TO_FASTAVRO else None
    if branch is not None:
        named = inner

        def inner(value: object, where: str) -> object:
            return (branch, named(value, where))
    if not nullable:
        return inner

    def optional(value: object, where: str) -> object:
        return None if value is None else inner(value, where)
    return optional


def _branch_name(kind: mi.Type) -> str | None:
    """The name fastavro knows a union's record or map branch by (None for a scalar or free-form JSON, which
    its writer tells apart cheaply). Every record is in the one namespace (:func:`avro_schema`)."""
    kind = bare_type(kind)
    if isinstance(kind, mi.StructType):
        return f"{NAMESPACE}.{kind.cls.__name__}"
    return "map" if isinstance(kind, mi.DictType) else "array" if isinstance(kind, mi.ListType) else None


def _compile_record(info: mi.StructType, direction: str, path: str) -> Convert:
    to = direction not in _FROMS
    fields = [FieldPlan(field, _compile(field_type(field), direction, f"{path}.{field.encode_name}"))
              for field in info.fields]
    omit_defaults = (bool(info.cls.__struct_config__.omit_defaults) or direction == _FROM_LEAN) and not to

    def record(value: object, where: str) -> object:
        entries = _mapping(value, where)
        out: dict[str, object] = {}
        for plan in fields:
            name = plan.name
            if name in entries:
                value = entries[name]
                converted = value if plan.as_is else plan.convert(value, f"{where}.{name}")
            elif plan.required:
                raise ValueError(f"`{where}.{name}` is required")
            elif to:
                converted = plan.convert(plan.default(), f"{where}.{name}")
            else:  # a datum of an earlier schema, read without resolution
                converted = plan.default()
            if not (omit_defaults and plan.at_default(converted)):
                out[name] = converted
        return out
    return record


class FieldPlan:
    """One field of a record conversion: its name, its conversion, and its default as a document has it."""

    __slots__ = ("name", "required", "convert", "as_is", "_field", "_default", "_fresh")

    def __init__(self, field: mi.Field, convert: Convert | None = None) -> None:
        self.name = field.encode_name
        self.required = field.required
        self.convert = convert or _as_is
        self.as_is = self.convert is _as_is  # a scalar, taken without a call
        self._field = field
        self._default = None if field.required else _json_default(field)
        # A default that is a container is made anew each time: a document must not share it.
        self._fresh = isinstance(self._default, list | dict)

    def default(self) -> object:
        return _json_default(self._field) if self._fresh else self._default

    def at_default(self, value: object) -> bool:
        """Whether the encoder of a Struct that omits defaults leaves this value of the field out: equal to a
        plain default (and of its type: 0 is not False), or an empty list or dict of a list or dict factory.
        A default made by another factory (a Struct) msgspec always writes."""
        field = self._field
        if field.required:
            return False
        if field.default is msgspec.NODEFAULT:
            factory = field.default_factory
            return factory in (list, dict) and isinstance(value, factory) and not value
        return type(value) is type(self._default) and value == self._default


def _as_is(value: object, where: str) -> object:
    return value


def _json_text(value: object, where: str) -> object:
    return _ENCODE_JSON.encode(value).decode()


def _parsed_json_text(value: object, where: str) -> object:
    if not isinstance(value, str):
        raise ValueError(f"`{where}` should be JSON text, not {type(value).__name__}")
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError as error:
        raise ValueError(f"`{where}` is not JSON text: {error}") from error


def _sequence(value: object, path: str) -> Sequence[object]:
    if type(value) is list:  # the common case, without isinstance's subclass walk
        return value
    if not isinstance(value, list | tuple):
        raise ValueError(f"`{path}` should be an array, not {type(value).__name__}")
    return value


def _mapping(value: object, path: str) -> Mapping[str, object]:
    if type(value) is dict:  # the common case, without the abstract class's isinstance check
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"`{path}` should be an object, not {type(value).__name__}")
    return value
