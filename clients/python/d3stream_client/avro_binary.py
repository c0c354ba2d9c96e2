"""Avro binary written and read by code compiled for one writer schema and one event: the registry path's codec.

An answer written through the registry used to be converted to fastavro's datum (:func:`avro.to_avro`) and then
written by fastavro, walking the schema for every record: about 30 µs an answer, a third of the whole Kafka path
of a plain JSON answer. The issue that brought the registry in allows schema handling a tenth of that path. So
here each (writer schema, event) pair is compiled once into a Python function that does the conversion and the
encoding in one pass, with no schema walk left at run time: the fields in their schema order, a JSON-text field
encoded straight to its bytes, a field the document leaves out written as its default's bytes (encoded once, by
fastavro), small lengths and counts looked up rather than computed. Reading is compiled the same way, from the
writer schema to the event's JSON document (``avro.from_avro``'s document).

**fastavro stays the reference.** The compiled code takes only what it is sure of: the values a JSON document
or the contract's Structs hold, written as fastavro writes them (a value Python's own operations refuse, such
as a float where a long goes or a number where a string goes, raises; a union's branch, a boolean and an array
are checked by type), well-formed binary, and the Avro types the contract's schemas use (records, arrays, maps,
unions of null and one other type or of scalars, and the primitive types but bytes). Anything else (a value of
another type, a truncated payload, a schema with an enum, a fixed, a logical type or a recursive record) goes
to the general path, ``to_avro`` or ``from_avro`` and fastavro (``registry.AvroCodec`` does this), so what is
accepted, written and refused, and the messages of a refusal, are fastavro's. A test writes and reads generated
events both ways and compares the bytes and documents.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Mapping
from typing import Any

import fastavro
import msgspec
import msgspec.inspect as mi

from d3stream_client import avro

Writer = Callable[[Any], bytes]  # a JSON document (a Mapping), or an event's Struct
Reader = Callable[[bytes, int], dict[str, object]]  # (data, where the payload starts) -> the document

# Zigzag varints of 0 .. 8191 (one or two bytes): the lengths, counts and small longs an event is full of.
_SMALL = 8192


def _unsigned_varint(folded: int) -> bytes:
    out = bytearray()
    while folded > 0x7F:
        out.append((folded & 0x7F) | 0x80)
        folded >>= 7
    out.append(folded)
    return bytes(out)


# Varints of 0 .. 16383 (the last group of any varint), and 14-bit groups followed by more (two bytes each).
_LAST = [_unsigned_varint(n) for n in range(1 << 14)]
_GROUPS = [bytes(((n & 0x7F) | 0x80, (n >> 7) | 0x80)) for n in range(1 << 14)]
_VARLONGS = _LAST[:2 * _SMALL:2]  # zigzag of 0 .. 8191 is 0, 2, 4 ...


def _varlong(value: int) -> bytes:
    """A long as Avro writes it: zigzag, then a little-endian base-128 varint (14 bits a lookup: a timestamp
    in milliseconds is three)."""
    if not -(2**63) <= value < 2**63:
        raise OverflowError(f"{value} is out of Avro's long range")
    folded = (value << 1) ^ (value >> 63)
    out = b""
    while folded >= 1 << 14:
        out += _GROUPS[folded & 0x3FFF]
        folded >>= 14
    return out + _LAST[folded]


def _read_long(data: bytes, position: int, first: int) -> tuple[int, int]:
    """The rest of a varint whose first byte (``first``, above 0x7F) came before ``position``."""
    folded, shift = first & 0x7F, 7
    while True:
        byte = data[position]
        position += 1
        folded |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (folded >> 1) ^ -(folded & 1), position
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than a long")


class _Mismatch(Exception):
    """A value or a payload the compiled code does not take: the general path decides."""


class NotCompilable(Exception):
    """A schema the compiled code does not cover (the general path serves it)."""


# --------------------------------------------------------------------------------------------- compiling


class _Source:
    """The text of one compiled function, and the constants its code names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.constants: dict[str, object] = {
            "_VARLONGS": _VARLONGS, "_varlong": _varlong, "_read_long": _read_long, "_Mismatch": _Mismatch,
            "_MISSING": _MISSING, "_json": msgspec.json.Encoder().encode, "_parse": msgspec.json.decode,
            "_raw": msgspec.json.Decoder(msgspec.Raw).decode,
            "_DOUBLE": struct.Struct("<d").pack, "_FLOAT": struct.Struct("<f").pack,
            "_UNDOUBLE": struct.Struct("<d").unpack_from, "_UNFLOAT": struct.Struct("<f").unpack_from,
        }
        self._names = 0

    def name(self, prefix: str = "v") -> str:
        self._names += 1
        return f"{prefix}{self._names}"

    def constant(self, value: object, prefix: str = "_c") -> str:
        name = self.name(prefix)
        self.constants[name] = value
        return name

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def function(self, name: str, argument: str) -> Callable[..., Any]:
        text = f"def {name}({argument}):\n" + "\n".join(self.lines) + "\n"
        namespace = dict(self.constants)
        try:
            code = compile(text, f"<avro {name}>", "exec")
        except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:  # Python's own limits: "too many
            # statically nested blocks" past about 20 containers and unions, one inside the other
            raise NotCompilable(f"the schema nests too deep for its code ({type(exc).__name__}: {exc})") from exc
        exec(code, namespace)  # noqa: S102 - our own generated text
        function = namespace[name]
        assert callable(function)
        return function


_MISSING = object()
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "string"}


def _resolve(schema: object, named: Mapping[str, object]) -> object:
    """A schema with a named reference replaced by its definition and ``{"type": "long"}`` by ``"long"``."""
    if isinstance(schema, str) and schema not in _PRIMITIVES:
        if schema not in named:
            raise NotCompilable(f"the type {schema!r} is not a primitive or a known name")
        return named[schema]
    if isinstance(schema, dict) and set(schema) <= {"type", "doc"} and schema.get("type") in _PRIMITIVES:
        return schema["type"]
    return schema


def _read_type(schema: object, named: Mapping[str, object]) -> object:
    """A schema as a reader reads it: a named reference replaced by its definition, and a primitive written with
    a logical type (a timestamp's long, a uuid's string, a decimal's bytes) read as that primitive."""
    if isinstance(schema, str) and schema == "bytes":
        return schema
    if isinstance(schema, dict) and schema.get("type") == "bytes" and "name" not in schema:
        return "bytes"
    if isinstance(schema, dict) and schema.get("type") in _PRIMITIVES and "name" not in schema:
        return schema["type"]
    return _resolve(schema, named)


def _kind(kind: mi.Type | None) -> mi.Type | None:
    return None if kind is None else avro.bare_type(kind)


def _is_text(kind: mi.Type | None) -> bool:
    """Whether the contract has free-form JSON here (carried as JSON text)."""
    return isinstance(_kind(kind), mi.AnyType)


def _nullable_inner(kind: mi.Type | None) -> mi.Type | None:
    """The member of a contract union that is not None (for a union of null and one other type)."""
    kind = _kind(kind)
    if isinstance(kind, mi.UnionType):
        others = [member for member in kind.types if not isinstance(avro.bare_type(member), mi.NoneType)]
        return others[0] if len(others) == 1 else None
    return kind


def _contract_fields(kind: mi.Type | None) -> dict[str, mi.Field]:
    kind = _kind(kind)
    return {field.encode_name: field for field in kind.fields} if isinstance(kind, mi.StructType) else {}


def _default_bytes(field_type: object, default: object, named: Mapping[str, object]) -> bytes:
    """A field's schema default as Avro binary, written once by fastavro."""
    wrapper = {"type": "record", "name": "d3stream_compiled_default", "fields": [{"name": "v", "type": field_type}]}
    known: dict[str, Any] = dict(named)  # parse_schema adds to it
    parsed = fastavro.parse_schema(wrapper, named_schemas=known)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed, {"v": default})
    return out.getvalue()


class _Compiler:
    """What writing and reading compile alike: one function's source, the schema's named types, and the records
    being compiled (a reference back to one of them is recursion, which the compiled code does not cover)."""

    def __init__(self, named: Mapping[str, object]) -> None:
        self.source = _Source()
        self.named = named
        self.open: set[str] = set()

    def enter(self, schema: dict[str, object]) -> str:
        """The record's name, now being compiled."""
        name = str(schema.get("name"))
        if name in self.open:
            raise NotCompilable(f"the record {name} refers to itself")
        self.open.add(name)
        return name


class _WriterCompiler(_Compiler):
    """Source for writing one event's document with one writer schema."""

    def __init__(self, named: Mapping[str, object], from_struct: bool) -> None:
        super().__init__(named)
        self.from_struct = from_struct  # records are the contract's Structs (else: a JSON document's dicts)

    def value(self, schema: object, kind: mi.Type | None, value: str, depth: int) -> None:
        """Lines writing ``value`` (a local's name) of ``schema``; ``kind``: the contract's type there."""
        emit = self.source.emit
        schema = _resolve(schema, self.named)
        if isinstance(schema, list):
            self.union(schema, kind, value, depth)
        elif schema == "string" and _is_text(kind):
            data = self.source.name("b")
            emit(depth, f"{data} = _json({value})")
            self.size(f"len({data})", depth)
            emit(depth, f"buf += {data}")
        elif schema == "string":
            data = self.source.name("b")  # .encode(): only a str has it, among a JSON document's values
            emit(depth, f"{data} = {value}.encode()")
            self.size(f"len({data})", depth)
            emit(depth, f"buf += {data}")
        elif schema in ("long", "int"):
            # No type check: a bool is written as fastavro writes it (0 or 1), anything else is no index
            # into the table and no comparison with an int, and raises.
            if schema == "int":
                emit(depth, f"if not -2147483648 <= {value} <= 2147483647: raise _Mismatch")
            self.size(value, depth, signed=True)
        elif schema in ("double", "float"):
            emit(depth, f"buf += {'_DOUBLE' if schema == 'double' else '_FLOAT'}({value})")  # a non-number raises
        elif schema == "boolean":
            emit(depth, f"if {value} is True: buf += b'\\x01'")
            emit(depth, f"elif {value} is False: buf += b'\\x00'")
            emit(depth, "else: raise _Mismatch")
        elif schema == "null":
            emit(depth, f"if {value} is not None: raise _Mismatch")
        elif isinstance(schema, dict) and schema.get("type") == "array":
            self.array(schema, kind, value, depth)
        elif isinstance(schema, dict) and schema.get("type") == "map":
            self.map(schema, kind, value, depth)
        elif isinstance(schema, dict) and schema.get("type") == "record":
            self.record(schema, kind, value, depth)
        else:
            raise NotCompilable(f"the Avro type {schema!r}")

    def size(self, value: str, depth: int, signed: bool = False) -> None:
        """Lines writing a long (a length or count when not ``signed``: never negative); ``value`` a local's
        name or an expression, computed once."""
        if not value.isidentifier():
            named = self.source.name("n")
            self.source.emit(depth, f"{named} = {value}")
            value = named
        low = f"0 <= {value} < {_SMALL}" if signed else f"{value} < {_SMALL}"
        self.source.emit(depth, f"buf += _VARLONGS[{value}] if {low} else _varlong({value})")

    def union(self, branches: list[object], kind: mi.Type | None, value: str, depth: int) -> None:
        emit = self.source.emit
        resolved = [_resolve(branch, self.named) for branch in branches]
        null = resolved.index("null") if "null" in resolved else None
        others = [(index, branch) for index, branch in enumerate(resolved) if branch != "null"]
        structured = [(index, branch) for index, branch in others if not isinstance(branch, str)]
        if structured and len(others) > 1:
            raise NotCompilable("a union of a record, array or map with another type")
        first = "if"
        if null is not None:
            emit(depth, f"if {value} is None: buf += {_VARLONGS[null]!r}")
            first = "elif"
        if structured or (len(others) == 1 and (_is_text(_nullable_inner(kind)) or others[0][1] in ("double", "float"))):
            # One other branch: everything not None is written in it (its own lines check the type).
            index, branch = others[0]
            emit(depth, "else:" if first == "elif" else "if True:")
            emit(depth + 1, f"buf += {_VARLONGS[index]!r}")
            self.value(branch, _nullable_inner(kind), value, depth + 1)
            return
        # Scalars: the branch is the one of the value's Python type (a bool is not a long; a long may go to a
        # double when the union has no long).
        tests = {"boolean": "bool", "long": "int", "int": "int", "double": "float", "float": "float", "string": "str"}
        taken: set[str] = set()
        for index, branch in others:
            assert isinstance(branch, str)
            python = tests[branch]
            if python in taken:
                raise NotCompilable(f"a union with two branches for {python}")
            taken.add(python)
            emit(depth, f"{first} type({value}) is {python}:")
            first = "elif"
            emit(depth + 1, f"buf += {_VARLONGS[index]!r}")
            self.value(branch, None, value, depth + 1)
        numbers = [index for index, branch in others if branch in ("double", "float")]
        if "int" not in taken and numbers:
            emit(depth, f"elif type({value}) is int:")
            emit(depth + 1, f"buf += {_VARLONGS[numbers[0]]!r}")
            self.value(resolved[numbers[0]], None, value, depth + 1)
        emit(depth, "else: raise _Mismatch")

    def array(self, schema: dict[str, object], kind: mi.Type | None, value: str, depth: int) -> None:
        emit = self.source.emit
        kind = _kind(kind)
        item_kind = kind.item_type if isinstance(kind, mi.ListType) else None
        emit(depth, f"if type({value}) is not list: raise _Mismatch")
        emit(depth, f"if {value}:")
        self.size(f"len({value})", depth + 1)
        item = self.source.name()
        emit(depth + 1, f"for {item} in {value}:")
        self.value(schema["items"], item_kind, item, depth + 2)
        emit(depth, "buf += b'\\x00'")

    def map(self, schema: dict[str, object], kind: mi.Type | None, value: str, depth: int) -> None:
        emit = self.source.emit
        kind = _kind(kind)
        value_kind = kind.value_type if isinstance(kind, mi.DictType) else None
        emit(depth, f"if {value}:")  # .items() below: only a mapping has it
        self.size(f"len({value})", depth + 1)
        key, entry = self.source.name("k"), self.source.name()
        emit(depth + 1, f"for {key}, {entry} in {value}.items():")
        self.value("string", None, key, depth + 2)
        self.value(schema["values"], value_kind, entry, depth + 2)
        emit(depth, "buf += b'\\x00'")

    def record(self, schema: dict[str, object], kind: mi.Type | None, value: str, depth: int) -> None:
        emit = self.source.emit
        name = self.enter(schema)
        ours = _contract_fields(kind)
        get = self.source.name("get")
        kind = _kind(kind)
        if self.from_struct:
            if not isinstance(kind, mi.StructType):
                raise NotCompilable(f"the record {name} is no Struct of the contract")
            cls = self.source.constant(kind.cls, "_cls")
            emit(depth, f"if type({value}) is not {cls}: raise _Mismatch")
        else:
            emit(depth, f"{get} = {value}.get")  # a mapping's (a list has none, and raises)
        fields = schema.get("fields")
        assert isinstance(fields, list)
        for field in fields:
            has_default = "default" in field
            default = (self.source.constant(_default_bytes(field["type"], field["default"], self.named), "_d")
                       if has_default else None)
            contract = ours.get(field["name"])
            if contract is None:  # a field of a later schema version the event does not carry: its default
                if default is None:
                    raise NotCompilable(f"the field {field['name']!r} has no default and no value")
                emit(depth, f"buf += {default}")
                continue
            entry = self.source.name()
            if self.from_struct:  # a Struct has every field
                emit(depth, f"{entry} = {value}.{contract.name}")
                self.value(field["type"], avro.field_type(contract), entry, depth)
                continue
            emit(depth, f"{entry} = {get}({field['name']!r}, _MISSING)")
            emit(depth, f"if {entry} is _MISSING:")
            emit(depth + 1, f"buf += {default}" if default is not None else "raise _Mismatch")
            emit(depth, "else:")
            self.value(field["type"], avro.field_type(contract), entry, depth + 1)
        self.open.discard(name)


class _ReaderCompiler(_Compiler):
    """Source for reading one writer schema's binary into one event's JSON document."""

    def __init__(self, named: Mapping[str, object], lean: bool) -> None:
        super().__init__(named)
        # For a reader that decodes the document next: every field at its default left out (avro.from_avro's
        # lean), and JSON text checked but not parsed (a msgspec.Raw, written back as it came).
        self.lean = lean

    def value(self, schema: object, kind: mi.Type | None, target: str, depth: int) -> None:
        """Lines reading a value of ``schema`` at ``p`` in ``data`` into the local ``target`` (``kind``: the
        contract's type there; None where the event does not carry it, read to be skipped). Every length and
        count is checked against the bytes left before it is believed."""
        emit = self.source.emit
        schema = _read_type(schema, self.named)
        if isinstance(schema, list):
            self.union(schema, kind, target, depth)
        elif schema in ("long", "int"):
            self.long(target, depth)
        elif schema in ("string", "bytes"):
            size = self.source.name("n")
            self.long(size, depth)
            emit(depth, f"if {size} < 0 or {size} > len(data) - p: raise _Mismatch")
            # JSON text where the contract has free-form JSON, whether the writer made the field optional or not.
            text = _is_text(_nullable_inner(kind))
            if text and self.lean:  # checked as JSON, kept as its text: its reader parses it once
                emit(depth, f"{target} = _raw(data[p:p + {size}])")
            elif text:
                emit(depth, f"{target} = _parse(data[p:p + {size}])")
            elif schema == "string" or kind is not None:  # bytes the contract carries resolve to a string only
                emit(depth, f"{target} = data[p:p + {size}].decode()")
            else:
                emit(depth, f"{target} = data[p:p + {size}]")  # bytes the event does not carry: skipped
            emit(depth, f"p += {size}")
        elif schema == "boolean":
            emit(depth, "b = data[p]")
            emit(depth, "if b > 1: raise _Mismatch")
            emit(depth, f"{target} = b == 1")
            emit(depth, "p += 1")
        elif schema == "double":
            emit(depth, f"{target}, = _UNDOUBLE(data, p)")
            emit(depth, "p += 8")
        elif schema == "float":
            emit(depth, f"{target}, = _UNFLOAT(data, p)")
            emit(depth, "p += 4")
        elif schema == "null":
            emit(depth, f"{target} = None")
        elif isinstance(schema, dict) and schema.get("type") in ("array", "map"):
            self.container(schema, kind, target, depth)
        elif isinstance(schema, dict) and schema.get("type") == "record":
            self.record(schema, kind, target, depth)
        elif isinstance(schema, dict) and schema.get("type") == "enum":
            symbols = schema.get("symbols")
            if not isinstance(symbols, list) or not symbols:
                raise NotCompilable(f"the enum {schema.get('name')} has no symbols")
            names = self.source.constant(tuple(str(symbol) for symbol in symbols), "_symbols")
            index = self.source.name("i")
            self.long(index, depth)
            emit(depth, f"if not 0 <= {index} < {len(symbols)}: raise _Mismatch")
            emit(depth, f"{target} = {names}[{index}]")
        elif isinstance(schema, dict) and schema.get("type") == "fixed":
            fixed_size = schema.get("size")
            if not isinstance(fixed_size, int) or fixed_size < 0:
                raise NotCompilable(f"the fixed {schema.get('name')} has no size")
            size = str(fixed_size)
            emit(depth, f"if p + {size} > len(data): raise _Mismatch")
            emit(depth, f"{target} = data[p:p + {size}]")
            emit(depth, f"p += {size}")
        else:
            raise NotCompilable(f"the Avro type {schema!r}")

    def long(self, target: str, depth: int) -> None:
        """Lines reading a long into ``target``: one and two bytes inline (every length under 8 KiB), longer
        ones by a call."""
        emit = self.source.emit
        emit(depth, "b = data[p]")
        emit(depth, "p += 1")
        emit(depth, f"if b < 128: {target} = (b >> 1) ^ -(b & 1)")
        emit(depth, "elif data[p] < 128:")
        emit(depth + 1, "b = (b & 127) | (data[p] << 7)")
        emit(depth + 1, "p += 1")
        emit(depth + 1, f"{target} = (b >> 1) ^ -(b & 1)")
        emit(depth, f"else: {target}, p = _read_long(data, p, b)")

    def union(self, branches: list[object], kind: mi.Type | None, target: str, depth: int) -> None:
        emit = self.source.emit
        index = self.source.name("i")
        self.long(index, depth)
        inner = _nullable_inner(kind)
        first = "if"
        for number, branch in enumerate(branches):
            emit(depth, f"{first} {index} == {number}:")
            first = "elif"
            self.value(branch, inner if _read_type(branch, self.named) != "null" else None, target, depth + 1)
        emit(depth, "else: raise _Mismatch")

    def container(self, schema: dict[str, object], kind: mi.Type | None, target: str, depth: int) -> None:
        """An array or a map: blocks of a count (negative: followed by the block's size) until a zero count."""
        emit = self.source.emit
        is_map = schema["type"] == "map"
        kind = _kind(kind)
        inner = (kind.value_type if isinstance(kind, mi.DictType) else None) if is_map else \
            (kind.item_type if isinstance(kind, mi.ListType) else None)
        count, item, key = self.source.name("n"), self.source.name(), self.source.name("k")
        emit(depth, f"{target} = {{}}" if is_map else f"{target} = []")
        emit(depth, "while True:")
        self.long(count, depth + 1)
        emit(depth + 1, f"if {count} == 0: break")
        emit(depth + 1, f"if {count} < 0:")
        emit(depth + 2, f"{count} = -{count}")
        self.long("_", depth + 2)
        # Each item takes a byte at least (a writer schema whose items take none is not admitted): a count
        # beyond the bytes left is a lie, refused before any loop runs.
        emit(depth + 1, f"if {count} > len(data) - p: raise _Mismatch")
        emit(depth + 1, f"for _ in range({count}):")
        if is_map:
            self.value("string", None, key, depth + 2)
            self.value(schema["values"], inner, item, depth + 2)
            emit(depth + 2, f"{target}[{key}] = {item}")
        else:
            self.value(schema["items"], inner, item, depth + 2)
            emit(depth + 2, f"{target}.append({item})")

    def record(self, schema: dict[str, object], kind: mi.Type | None, target: str, depth: int) -> None:
        emit = self.source.emit
        name = self.enter(schema)
        kind = _kind(kind)
        info = kind if isinstance(kind, mi.StructType) else None
        ours = _contract_fields(info)
        emit(depth, f"{target} = {{}}")
        fields = schema.get("fields")
        assert isinstance(fields, list)
        written = set()
        for field in fields:
            contract = ours.get(field["name"])
            entry = self.source.name()
            self.value(field["type"], avro.field_type(contract) if contract is not None else None, entry, depth)
            if contract is not None:
                written.add(field["name"])
                self.keep(info, contract, target, entry, depth)
        if info is not None:
            for field in info.fields:  # fields of a later contract than the writer's: their defaults
                if field.encode_name not in written:
                    if field.required:
                        raise NotCompilable(f"the writer schema lacks the required field {field.encode_name!r}")
                    plan = self.source.constant(avro.FieldPlan(field), "_plan")
                    entry = self.source.name()
                    emit(depth, f"{entry} = {plan}.default()")
                    self.keep(info, field, target, entry, depth)
        self.open.discard(name)

    def keep(self, info: mi.StructType | None, field: mi.Field, target: str, entry: str, depth: int) -> None:
        """The line putting a field in the document, unless it is left out at its default (``FieldPlan.at_default``
        written out for the common defaults)."""
        put = f"{target}[{field.encode_name!r}] = {entry}"
        omits = info is not None and (info.cls.__struct_config__.omit_defaults or self.lean)
        if not omits or field.required:
            self.source.emit(depth, put)
            return
        default, factory = field.default, field.default_factory
        if default is None:
            self.source.emit(depth, f"if {entry} is not None: {put}")
        elif default is msgspec.NODEFAULT and factory in (list, dict):
            self.source.emit(depth, f"if type({entry}) is not {factory.__name__} or {entry}: {put}")
        elif default is msgspec.NODEFAULT:
            self.source.emit(depth, put)  # a Struct made by its factory: always written
        elif type(default) in (str, int, float, bool):
            self.source.emit(depth, f"if not (type({entry}) is {type(default).__name__} and {entry} == {default!r}): "
                                    f"{put}")
        else:
            plan = self.source.constant(avro.FieldPlan(field), "_plan")
            self.source.emit(depth, f"if not {plan}.at_default({entry}): {put}")


def _named(parsed: Mapping[str, object]) -> Mapping[str, object]:
    named = parsed.get("__named_schemas")
    if not isinstance(named, dict):
        raise NotCompilable("not a schema parsed by fastavro")
    return named


def compile_writer(parsed: Mapping[str, object], event: type[msgspec.Struct], *, from_struct: bool = False) -> Writer:
    """A function writing an event's JSON document (parsed; with ``from_struct``, the event's Struct itself) as
    Avro binary with the fastavro-parsed ``parsed``; it raises for anything it does not take (then the general
    path decides). NotCompilable for a schema the compiled code does not cover."""
    compiler = _WriterCompiler(_named(parsed), from_struct)
    compiler.source.emit(1, "buf = bytearray()")
    compiler.record(dict(parsed), avro.struct_info(event), "document", 1)
    compiler.source.emit(1, "return bytes(buf)")
    return compiler.source.function("write_avro_compiled", "document")


def compile_reader(parsed: Mapping[str, object], event: type[msgspec.Struct], *, lean: bool = False) -> Reader:
    """A function reading Avro binary written with ``parsed`` (in ``data`` from ``p``) into an event's JSON
    document (``avro.from_avro``'s; ``lean`` as there, its JSON text as ``msgspec.Raw``: the document is for
    encoding); it raises for a payload it does not take. NotCompilable for a schema the compiled code does not
    cover."""
    compiler = _ReaderCompiler(_named(parsed), lean)
    try:
        compiler.record(dict(parsed), avro.struct_info(event), "document", 1)
    except RecursionError as exc:
        raise NotCompilable("the schema nests too deep to compile") from exc
    compiler.source.emit(1, "return document")
    return compiler.source.function("read_avro_compiled", "data, p=0")


# --------------------------------------------------------------------------------------------- explaining


class _Stop(Exception):
    """Where and why a payload cannot be read (the message of its refusal)."""


class _TooDeep(Exception):
    """JSON text inside the payload nests deeper than a JSON reader goes."""


class PayloadError(ValueError):
    """A payload its writer schema cannot read, with the reason (``too_deep``: JSON text in it nests deeper than
    any JSON reader goes, which a request's reader refuses as it refuses such a JSON request)."""

    def __init__(self, message: str, *, too_deep: bool = False) -> None:
        super().__init__(message)
        self.too_deep = too_deep


def explain(parsed: Mapping[str, object], event: type[msgspec.Struct], data: bytes, start: int = 0) -> PayloadError:
    """Why the payload in ``data`` from ``start`` cannot be read with ``parsed``, for a producer to act on: the
    field, what was expected there and at which byte of the payload. The compiled reader is fast and says
    nothing; this walk reads the same way, slowly, when it has failed. Bounded like it: no count or length is
    believed beyond the bytes left, and the schema (admitted first) is not recursive."""
    walk = _Walk(_named(parsed), data, start)
    try:
        walk.value(dict(parsed), avro.struct_info(event), "$")
    except _Stop as stop:
        return PayloadError(str(stop))
    except _TooDeep as deep:
        return PayloadError(str(deep), too_deep=True)
    return PayloadError("the payload could not be read, though every field of its schema was found in it")


class _Walk:
    """Reads a payload field by field, stopping at the first thing that is not as its schema says."""

    def __init__(self, named: Mapping[str, object], data: bytes, start: int) -> None:
        self.named = named
        self.data = data
        self.start = start
        self.p = start

    def at(self) -> int:
        """The position in the payload (after the frame), as a producer counts its bytes."""
        return self.p - self.start

    def left(self) -> int:
        return len(self.data) - self.p

    def need(self, count: int, what: str, path: str) -> None:
        if count > self.left():
            ends = "the payload is empty" if len(self.data) == self.start else \
                f"the payload ends at byte {len(self.data) - self.start}"
            raise _Stop(f"{path}: {ends} where {what} was expected (at byte {self.at()}, "
                        f"{count - self.left()} byte(s) short)")

    def long(self, what: str, path: str) -> int:
        folded, shift, begun = 0, 0, self.at()
        while True:
            self.need(1, what, path)
            byte = self.data[self.p]
            self.p += 1
            folded |= (byte & 0x7F) << shift
            if byte < 0x80:
                return (folded >> 1) ^ -(folded & 1)
            shift += 7
            if shift > 63:
                raise _Stop(f"{path}: {what} at byte {begun} is a varint longer than a long (10 bytes)")

    def length(self, what: str, path: str) -> int:
        begun = self.at()
        size = self.long(f"{what}'s length", path)
        if size < 0:
            raise _Stop(f"{path}: {what} at byte {begun} has a negative length ({size})")
        self.need(size, f"{what} of {size:,} bytes", path)
        return size

    def value(self, schema: object, kind: mi.Type | None, path: str) -> object:
        schema = _read_type(schema, self.named)
        data = self.data
        if isinstance(schema, list):
            begun = self.at()
            index = self.long("a union's branch index", path)
            if not 0 <= index < len(schema):
                raise _Stop(f"{path}: the union's branch index at byte {begun} is {index}; its schema has "
                            f"{len(schema)} branches")
            branch = schema[index]
            return self.value(branch, _nullable_inner(kind) if _read_type(branch, self.named) != "null" else None,
                              path)
        if schema in ("long", "int"):
            return self.long(f"an {schema}", path)
        if schema in ("string", "bytes"):
            what = "a string" if schema == "string" else "bytes"
            size = self.length(what, path)
            text = data[self.p:self.p + size]
            self.p += size
            if _is_text(_nullable_inner(kind)):
                try:
                    return msgspec.json.decode(text)
                except RecursionError as exc:
                    raise _TooDeep(f"{path} is JSON text nested deeper than a JSON reader goes") from exc
                except msgspec.DecodeError as exc:
                    raise _Stop(f"{path} is not JSON text: {exc}") from exc
            if schema == "string" or kind is not None:
                try:
                    return text.decode()
                except UnicodeDecodeError as exc:
                    raise _Stop(f"{path}: the string at byte {self.at() - size} is not UTF-8 ({exc.reason} at its "
                                f"byte {exc.start})") from exc
            return text
        if schema == "boolean":
            self.need(1, "a boolean", path)
            byte = data[self.p]
            if byte > 1:
                raise _Stop(f"{path}: the boolean at byte {self.at()} is {byte}, not 0 or 1")
            self.p += 1
            return byte == 1
        if schema in ("double", "float"):
            size = 8 if schema == "double" else 4
            self.need(size, f"a {schema} ({size} bytes)", path)
            self.p += size
            return 0.0
        if schema == "null":
            return None
        if isinstance(schema, dict) and schema.get("type") in ("array", "map"):
            self.container(schema, kind, path)
            return None
        if isinstance(schema, dict) and schema.get("type") == "record":
            fields = schema.get("fields")
            assert isinstance(fields, list)
            ours = _contract_fields(kind)
            for field in fields:
                contract = ours.get(field["name"])
                self.value(field["type"], avro.field_type(contract) if contract is not None else None,
                           f"{path}.{field['name']}")
            return None
        if isinstance(schema, dict) and schema.get("type") == "enum":
            begun = self.at()
            index = self.long("an enum's symbol index", path)
            symbols = schema.get("symbols")
            assert isinstance(symbols, list)
            if not 0 <= index < len(symbols):
                raise _Stop(f"{path}: the enum's symbol index at byte {begun} is {index}; it has {len(symbols)}")
            return symbols[index]
        if isinstance(schema, dict) and schema.get("type") == "fixed":
            fixed_size = schema.get("size")
            assert isinstance(fixed_size, int)
            self.need(fixed_size, f"a fixed of {fixed_size} bytes", path)
            self.p += fixed_size
            return None
        raise _Stop(f"{path}: the Avro type {schema!r} is not read")

    def container(self, schema: dict[str, object], kind: mi.Type | None, path: str) -> None:
        is_map = schema["type"] == "map"
        kind = _kind(kind)
        inner = (kind.value_type if isinstance(kind, mi.DictType) else None) if is_map else \
            (kind.item_type if isinstance(kind, mi.ListType) else None)
        what = "a map's entry count" if is_map else "an array's item count"
        number = 0
        while True:
            begun = self.at()
            count = self.long(what, path)
            if count == 0:
                return
            if count < 0:
                count = -count
                self.long("a block's byte size", path)
            if count > self.left():
                items = "entries" if is_map else "items"
                raise _Stop(f"{path}: {count:,} {items} claimed at byte {begun} with {self.left():,} byte(s) left "
                            "(each takes one at least)")
            for _ in range(count):
                if is_map:
                    key = self.value("string", None, f"{path}[{number}]'s key")
                    self.value(schema["values"], inner, f"{path}.{key}")
                else:
                    self.value(schema["items"], inner, f"{path}[{number}]")
                number += 1

