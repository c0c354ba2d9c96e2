"""Every request decoder, fuzzed (Hypothesis): plain JSON, Avro framed for a Schema Registry (its writer schema
admitted first) and JSON Schema framed.

A request record is whatever a producer, or anyone who can write to the topic or register a schema, puts there.
So each decoder is thrown random bytes, truncated and bit-flipped encodings of valid requests, random writer
schemas (every Avro type, named and nested, recursive, huge, expanding exponentially through named references,
arrays of items taking no bytes, mutations of the contract's own Request schema) with payloads written for them
(fastavro's writer), and JSON nested tens of thousands deep or hundreds of kilobytes wide. Each input must end
in a ``Request`` or in one refusal of the documented kinds:

* ``EventError`` (``undecodable_event`` or ``invalid_request``) from ``validation.decode_request``;
* ``writer_schemas.SchemaRefused`` from admitting a writer schema;
* ``avro_binary.PayloadError`` from ``registry.AvroCodec.read``;
* ``_Refused`` (``invalid_request``) from the worker's framed-record readers (``d3stream/kafka/registry.py``).

Anything else that escapes (RecursionError, IndexError, KeyError, struct.error, UnicodeDecodeError...) fails the
test; an interpreter that crashes (fastavro's reader on a recursive schema does) fails the run. No input may
make a decoder allocate more than ``MEMORY_BOUND`` at its peak (tracemalloc). No test times anything: bounded
time is shown by the inputs that used to take long (80 million items claimed in 48 bytes) being refused before
any loop runs. Where a decoder reads a valid request, every framing must read the same request, and a payload
written with an admitted writer schema must read as Avro's resolution (fastavro's resolving reader, safe on an
admitted schema: none is recursive, and then ``avro.from_avro``) reads it.

Two Hypothesis profiles, chosen by ``D3STREAM_FUZZ``, neither keeping an example database in the work tree. Every
test here is marked ``fuzz`` (pyproject.toml), so ``-m fuzz`` selects them.

* ``short`` (the default, in ``make test``): about a hundred examples a property, derandomized (the same examples
  on every run and machine, so a CI failure reproduces), the file in about a minute of CPU.
* ``long``: about thirty times as many, new ones on each run; a failure prints its seed and a blob to rerun it
  (``--hypothesis-seed=N``, ``@reproduce_failure``). Cap it with ``timeout``::

      D3STREAM_FUZZ=long timeout 600 .venv/bin/python -m pytest -p no:cacheprovider -m fuzz tests/unit/client/test_decoder_fuzz.py
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fastavro
import msgspec
import pytest
from d3stream_client.avro import avro_schema, from_avro
from d3stream_client.avro_binary import PayloadError
from d3stream_client.contract import PRIORITIES, Request
from d3stream_client.registry import FRAME, AvroCodec, frame
from d3stream_client.validation import TOO_DEEP, EventError, decode_request
from d3stream_client.writer_schemas import MAX_SCHEMA_BYTES, MAX_SCHEMA_TYPES, SchemaRefused, admit
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from d3stream.kafka.registry import _read_avro, _read_json_schema, _Refused

# ============================================================================================ profiles

_SLOW_GENERATION = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                    HealthCheck.filter_too_much]
settings.register_profile("d3stream-decoders-short", max_examples=120, derandomize=True, database=None,
                          deadline=None, suppress_health_check=_SLOW_GENERATION, print_blob=False)
settings.register_profile("d3stream-decoders-long", max_examples=4_000, derandomize=False, database=None,
                          deadline=None, suppress_health_check=_SLOW_GENERATION, print_blob=True)
PROFILE = os.environ.get("D3STREAM_FUZZ", "short")
if PROFILE not in ("short", "long"):
    raise RuntimeError(f"D3STREAM_FUZZ is short or long, not {PROFILE!r}")
FUZZ = settings.get_profile(f"d3stream-decoders-{PROFILE}")  # applied per test: no global profile is loaded

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(3_600 if PROFILE == "long" else 300)]


def fuzz(share: float = 1.0) -> settings:
    """The profile, with ``share`` of its examples (a property that costs more per example takes fewer)."""
    return settings(FUZZ, max_examples=max(10, int(FUZZ.max_examples * share)))


# ============================================================================================ outcomes

MEMORY_BOUND = 64 * 1024 * 1024  # bytes a decoder may allocate at its peak for any one input
T = TypeVar("T")
SCHEMA_ID = 7
REQUEST_CODES = {"undecodable_event", "invalid_request"}


@dataclass(frozen=True)
class Outcome:
    """How an input ended: a request, or a documented refusal (its kind, its code, its message)."""

    request: Request | None = None
    kind: str = ""  # "", "EventError", "_Refused", "SchemaRefused" or "PayloadError"
    code: str | None = None
    message: str = ""


def settle(run: Callable[[], Request]) -> Outcome:
    """The outcome of ``run``. Only the documented refusals are caught: anything else propagates and fails."""
    try:
        request = run()
    except (EventError, _Refused) as refused:
        assert refused.code in REQUEST_CODES, f"undocumented code {refused.code!r}: {refused}"
        return Outcome(kind=type(refused).__name__, code=refused.code, message=str(refused))
    except (SchemaRefused, PayloadError) as refused:
        return Outcome(kind=type(refused).__name__, message=str(refused))
    assert isinstance(request, Request)
    return Outcome(request=request)


def measured(run: Callable[[], T], bound: int = MEMORY_BOUND) -> T:
    """``run()``, failing when it allocated more than ``bound`` bytes at its peak (tracemalloc)."""
    tracemalloc.start()
    try:
        result = run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= bound, f"one input made the decoder allocate {peak / 2**20:.1f} MiB at its peak"
    return result


def bounded(run: Callable[[], Request]) -> Outcome:
    """``settle(run)`` within the memory bound."""
    return measured(lambda: settle(run))


# The decoders as the worker chains them: a framed record is read by its format's reader, then its document is
# decoded as a plain JSON request.

def plain_json(value: bytes) -> Request:
    return decode_request(value)


def json_schema_framed(payload: bytes) -> Request:
    return decode_request(_read_json_schema(frame(SCHEMA_ID, payload), schema_id=SCHEMA_ID))


def avro_framed(codec: AvroCodec, payload: bytes) -> Request:
    return decode_request(_read_avro(frame(SCHEMA_ID, payload), codec=codec, schema_id=SCHEMA_ID))


def avro_client_read(codec: AvroCodec, payload: bytes) -> Request:
    """The client's reading (every field, defaults included), then the request checks."""
    return decode_request(codec.read(frame(SCHEMA_ID, payload), FRAME.size))


def admitted(schema_text: str) -> AvroCodec | Outcome:
    """The codec of an admitted writer schema, its readers compiled, or the refusal; within the memory bound
    either way. Anything but a SchemaRefused escaping admission fails."""

    def admission() -> AvroCodec | Outcome:
        try:
            codec = AvroCodec(admit(schema_text, Request), Request)
        except SchemaRefused as refused:
            return Outcome(kind="SchemaRefused", message=str(refused))
        assert codec._reader is not None and codec._lean_reader is not None  # compiled, as admission promised
        return codec

    return measured(admission)


# ============================================================================================ Avro bytes


def zigzag(number: int) -> bytes:
    """A long as Avro writes it (zigzag, then a base-128 varint)."""
    folded = (number << 1) ^ (number >> 63)
    out = bytearray()
    while folded > 0x7F:
        out.append((folded & 0x7F) | 0x80)
        folded >>= 7
    out.append(folded)
    return bytes(out)


def parsed(schema: object) -> dict[str, Any]:
    result = fastavro.parse_schema(schema)
    assert isinstance(result, dict)
    return result


CONTRACT = avro_schema(Request)
CONTRACT_TEXT = json.dumps(CONTRACT)
CONTRACT_PARSED = parsed(CONTRACT)
CONTRACT_CODEC = AvroCodec(CONTRACT_PARSED, Request)
# Admission's one-time costs (Avro's modules imported, the contract's schema parsed and kept) paid here, not in
# the first input's memory.
admit(CONTRACT_TEXT, Request)
NOUL = '{"type": "noul", "instructions": "Does the customer ask for their money back?"}'
QUESTION_TEXTS = (
    NOUL,
    '{"type": "choice", "instructions": "Which team?", "criteria": {"billing": "payments", "tech": "bugs"}}',
    '{"type": "score", "instructions": "How urgent?", "criteria": ["low", "normal", "urgent"]}',
)
# A request of the contract with every optional field left out: what the worst cases below append to.
SMALLEST_TEXT = '{"type":"noul"}'
SMALLEST = CONTRACT_CODEC.write({"id": "r", "questions": {"q": json.loads(SMALLEST_TEXT)}})


def contract_with(*extra: dict[str, object], replace: dict[str, object] | None = None) -> dict[str, Any]:
    """The contract's Request schema with ``extra`` fields appended and some fields' types replaced (their
    defaults dropped: a writer's default is never read)."""
    schema = copy.deepcopy(CONTRACT)
    fields = schema["fields"]
    for field in fields:
        if replace and field["name"] in replace:
            field["type"] = replace[field["name"]]
            field.pop("default", None)
    fields.extend(copy.deepcopy(list(extra)))
    return schema


# ============================================================================================ requests

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)
json_values = st.recursive(
    json_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
questions = st.sampled_from([json.loads(text) for text in QUESTION_TEXTS]) | json_values
media = st.lists(st.sampled_from(["s3://tickets/1001.png?versionId=3", "data:image/png;base64,iVBORw0KGgo="])
                 | st.text(min_size=1, max_size=20), max_size=3)
requests = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=40), "questions": st.dictionaries(st.text(max_size=10), questions,
                                                                          min_size=1, max_size=3)},
    optional={
        "state": json_values, "metadata": json_values, "images": media, "videos": media,
        "model": st.none() | st.text(max_size=12), "permutation_average": st.none() | st.booleans(),
        "deadline": st.none() | st.integers(0, 2**63 - 1), "ttl_ms": st.none() | st.integers(0, 2**63 - 1),
        "priority": st.sampled_from(PRIORITIES), "tenant": st.none() | st.text(min_size=1, max_size=30),
    },
)

# Damage done to a valid encoding: cut it short, flip a bit, overwrite, insert or delete bytes, or insert a
# length or count that claims far more than follows.
CLAIMS = (-1, 2**31, 2**31 - 1, 80_000_000, 2**62, 2**63 - 1, -(2**63))
Damage = tuple[str, int, int]
damages = st.lists(st.tuples(st.sampled_from(["truncate", "flip", "set", "insert", "delete", "claim"]),
                             st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4)


def damaged(value: bytes, damage: Sequence[Damage]) -> bytes:
    data = bytearray(value)
    for action, where, byte in damage:
        at = where % (len(data) + 1)
        if action == "truncate":
            del data[at:]
        elif action == "flip" and data:
            data[at % len(data)] ^= 1 << (byte % 8)
        elif action == "set" and data:
            data[at % len(data)] = byte
        elif action == "insert":
            data[at:at] = bytes([byte])
        elif action == "delete":
            del data[at:at + 1 + byte % 8]
        elif action == "claim":
            data[at:at] = zigzag(CLAIMS[byte % len(CLAIMS)])
    return bytes(data)


# ============================================================================================ writer schemas

PRIMITIVES = ("null", "boolean", "int", "long", "float", "double", "bytes", "string")
LOGICAL_TYPES: tuple[dict[str, object], ...] = (
    {"type": "long", "logicalType": "timestamp-millis"}, {"type": "long", "logicalType": "timestamp-micros"},
    {"type": "long", "logicalType": "local-timestamp-millis"}, {"type": "int", "logicalType": "date"},
    {"type": "int", "logicalType": "time-millis"}, {"type": "long", "logicalType": "time-micros"},
    {"type": "string", "logicalType": "uuid"}, {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2},
    {"type": "bytes", "logicalType": "decimal", "precision": 2, "scale": 9},  # scale past precision: invalid
    {"type": "string", "logicalType": "not-a-logical-type"}, {"type": "long"}, {"type": "null"},
)
# Broken schemas of every kind, each to be refused with a reason.
BROKEN_TYPES: tuple[object, ...] = (
    ["null", ["null", "long"]], ["long", "long"], [], "NoSuchType", {"type": "array"}, {"type": "map"},
    {"type": "record", "name": "NoFields"}, {"type": "enum", "name": "NoSymbols", "symbols": []},
    {"type": "enum", "name": "Twice", "symbols": ["A", "A"]}, {"type": "fixed", "name": "NoSize"},
    {"type": "fixed", "name": "Negative", "size": -1}, {"type": "record", "name": "1bad", "fields": []},
    {"type": "record", "name": "Dup", "fields": [{"name": "a", "type": "long"}, {"name": "a", "type": "long"}]},
    {"type": "string", "default": 1}, 42, None, {"type": {"type": "long"}}, {"type": ["null", "long"]},
    {"type": "fixed", "name": "Huge", "size": 2**62}, {"type": "array", "items": "null"},
)
# Types a producer's schema plausibly gives the contract's fields (promotions, reordered unions, logical types).
CONTRACT_RETYPES: dict[str, tuple[object, ...]] = {
    "id": ("bytes", {"type": "string", "logicalType": "uuid"}, ["null", "string"], "long"),
    "state": ("string", "bytes", ["string", "null"], ["null", "bytes"], "long"),
    "metadata": ("string", "bytes", ["string", "null"], ["null", "bytes"]),
    "questions": ({"type": "map", "values": "bytes"}, {"type": "map", "values": ["null", "string"]},
                  {"type": "array", "items": "string"}),
    "images": ({"type": "array", "items": "bytes"}, {"type": "array", "items": ["null", "string"]}),
    "videos": ({"type": "array", "items": "bytes"},),
    "model": ("string", ["string", "null"], ["null", "bytes"]),
    "permutation_average": ("boolean", ["boolean", "null"], "long"),
    "deadline": ("long", "int", ["null", "int"], {"type": "long", "logicalType": "timestamp-millis"},
                 ["null", {"type": "long", "logicalType": "timestamp-millis"}], "double"),
    "ttl_ms": ("long", ["long", "null"]),
    "priority": ({"type": "enum", "name": "Priority", "symbols": ["high", "normal", "low"]}, "bytes",
                 ["null", "string"]),
    "tenant": ("string", ["null", "bytes"]),
}
_NO_DEFAULT = object()


class _SchemaDrawer:
    """Draws an Avro type: primitives, logical types, records, enums, fixeds, arrays, maps and unions, nested up
    to ``max_depth``; references to the named types defined before it (the same record used many times), and with
    ``recursion`` to the records still being defined (a record containing itself)."""

    def __init__(self, draw: Callable[..., Any], *, recursion: bool, max_depth: int) -> None:
        self.draw = draw
        self.recursion = recursion
        self.max_depth = max_depth
        self.named: dict[str, object] = {}  # name -> its definition, for references and defaults
        self.open: list[str] = []
        self.serial = 0

    def fresh(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def type(self, depth: int) -> object:
        kinds = ["primitive", "primitive", "logical"]
        if self.named:
            kinds.append("reference")
        if self.recursion and self.open:
            kinds.append("recursion")
        if depth < self.max_depth:
            kinds += ["record", "enum", "fixed", "array", "map", "union", "union"]
        kind = self.draw(st.sampled_from(kinds))
        if kind == "primitive":
            return self.draw(st.sampled_from(PRIMITIVES))
        if kind == "logical":
            return copy.deepcopy(self.draw(st.sampled_from(LOGICAL_TYPES)))
        if kind == "reference":
            return self.draw(st.sampled_from(sorted(self.named)))
        if kind == "recursion":
            return self.draw(st.sampled_from(self.open))
        if kind == "union":
            return self.union(depth)
        return self.composite(kind, depth)

    def composite(self, kind: str, depth: int) -> dict[str, object]:
        if kind == "record":
            name = self.fresh("R")
            self.open.append(name)
            fields = [self.field(f"f{index}", depth + 1) for index in range(self.draw(st.integers(0, 4)))]
            self.open.pop()
            record = {"type": "record", "name": name, "fields": fields}
            self.named[name] = record
            return record
        if kind == "enum":
            name = self.fresh("E")
            symbols = self.draw(st.lists(st.sampled_from(["A", "B", "C", "high", "normal"]), min_size=1,
                                         max_size=4, unique=True))
            self.named[name] = enum = {"type": "enum", "name": name, "symbols": symbols}
            return enum
        if kind == "fixed":
            name = self.fresh("F")
            fixed: dict[str, object] = {"type": "fixed", "name": name, "size": self.draw(st.integers(0, 16))}
            if self.draw(st.booleans()):
                fixed.update(logicalType="decimal", precision=4, scale=2)
            self.named[name] = fixed
            return fixed
        if kind == "array":
            return {"type": "array", "items": self.type(depth + 1)}
        return {"type": "map", "values": self.type(depth + 1)}

    def union(self, depth: int) -> list[object]:
        """Branches of distinct kinds, as Avro wants them (at most one array, one map, one of each primitive)."""
        branches: list[object] = []
        seen: set[str] = set()
        for _ in range(self.draw(st.integers(1, 4))):
            branch = self.type(depth + 1)
            key = (branch if isinstance(branch, str) and branch in PRIMITIVES else
                   branch["type"] if isinstance(branch, dict) and branch.get("type") in ("array", "map") else
                   json.dumps(branch, sort_keys=True))
            if isinstance(branch, list) or key in seen:
                continue
            seen.add(str(key))
            branches.append(branch)
        return branches or ["null"]

    def field(self, name: str, depth: int) -> dict[str, object]:
        """A field of a random type, with a default of its type or none; now and then a broken type or a
        default of another type (both refused)."""
        broken = self.draw(st.sampled_from([False] * 24 + [True]))
        field_type = copy.deepcopy(self.draw(st.sampled_from(BROKEN_TYPES))) if broken else self.type(depth)
        field: dict[str, object] = {"name": name, "type": field_type}
        if self.draw(st.booleans()):
            default = self.default(field["type"])
            if default is not _NO_DEFAULT:
                field["default"] = default
        elif self.draw(st.sampled_from([False] * 39 + [True])):
            field["default"] = "not the type's value"
        return field

    def default(self, schema: object, depth: int = 0) -> object:
        """A valid default for ``schema`` (a union's is its first branch's), or _NO_DEFAULT."""
        if depth > 8:
            return _NO_DEFAULT
        if isinstance(schema, list):
            return self.default(schema[0], depth + 1) if schema else _NO_DEFAULT
        if isinstance(schema, str) and schema in self.named:
            return self.default(self.named[schema], depth + 1)
        if isinstance(schema, dict):
            kind = schema.get("type")
            if kind == "record":
                fields = schema.get("fields")
                values = {f["name"]: self.default(f["type"], depth + 1) for f in fields} if isinstance(fields, list) else {}
                return _NO_DEFAULT if _NO_DEFAULT in values.values() else values
            if kind == "enum":
                symbols = schema.get("symbols")
                return symbols[0] if isinstance(symbols, list) and symbols else _NO_DEFAULT
            if kind == "fixed":
                size = schema.get("size")
                return "\u0000" * size if isinstance(size, int) and 0 <= size <= 64 else _NO_DEFAULT
            if kind == "array":
                return []
            if kind == "map":
                return {}
            schema = kind
        return {"null": None, "boolean": False, "int": 0, "long": 0, "float": 0.0, "double": 0.0, "bytes": "",
                "string": ""}.get(schema, _NO_DEFAULT) if isinstance(schema, str) else _NO_DEFAULT


# Datums for a parsed schema, written by fastavro's writer. Drawn from a seeded random.Random rather than from
# Hypothesis: a schema of two thousand fields would overrun Hypothesis's choice buffer.
STRINGS = (*QUESTION_TEXTS, "null", "{}", "[1, 2]", '{"a": {"b": [null]}}', "high", "normal", "low",
           "s3://tickets/1001.png", "", "not json", '{"type": "noul", "type": "choice"}', "1e400", "NaN")


class _NoDatum(Exception):
    """The schema has no value within the depth and size tried (a record that needs itself, or one that expands
    exponentially through named references)."""


def _branch_name(branch: object) -> str:
    """The name fastavro's writer knows a union branch by (its tuple notation picks that branch)."""
    if isinstance(branch, str):
        return branch
    assert isinstance(branch, dict)
    kind = branch["type"]
    return str(branch["name"]) if kind in ("record", "enum", "fixed", "error") else str(kind)


class _Datums:
    """Random values of one parsed schema: small containers, JSON text among the strings, and at depth the
    union branches that end (null, a scalar) first; at most ``MOST`` values in all."""

    MOST = 20_000

    def __init__(self, schema: dict[str, Any], seed: int) -> None:
        self.named: dict[str, Any] = schema["__named_schemas"]
        self.rng = random.Random(seed)
        self.left = self.MOST

    def composite(self, schema: object) -> bool:
        while isinstance(schema, str) and schema in self.named:
            schema = self.named[schema]
        return isinstance(schema, list) or (isinstance(schema, dict) and schema.get("type") in ("record", "array", "map"))

    def value(self, schema: object, depth: int = 0) -> object:
        self.left -= 1
        if depth > 40 or self.left < 0:
            raise _NoDatum
        rng = self.rng
        if isinstance(schema, list):
            order = list(range(len(schema)))
            rng.shuffle(order)
            if depth > 6:
                order.sort(key=lambda index: self.composite(schema[index]))
            branch = schema[order[0]]
            return (_branch_name(branch), self.value(branch, depth + 1))
        if isinstance(schema, str):
            if schema in self.named:
                return self.value(self.named[schema], depth + 1)
            return _primitive(schema, rng)
        assert isinstance(schema, dict)
        kind = schema["type"]
        if kind in ("record", "error"):
            return {field["name"]: self.value(field["type"], depth + 1) for field in schema["fields"]}
        if kind == "enum":
            return rng.choice(schema["symbols"])
        if kind == "fixed":
            if schema["size"] > 4_096:
                raise _NoDatum
            return rng.randbytes(schema["size"])
        size = rng.choice((0, 1, 2, 3)) if depth < 6 else 0
        if kind == "array":
            return [self.value(schema["items"], depth + 1) for _ in range(size)]
        if kind == "map":
            return {rng.choice(("q", "refund", "k", "")) + str(index): self.value(schema["values"], depth + 1)
                    for index in range(size)}
        return self.value(kind, depth + 1)  # a primitive with a logical type: its primitive's value


def _primitive(kind: str, rng: random.Random) -> object:
    if kind == "null":
        return None
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice((0, 1, -1, 2**31 - 1, -(2**31), rng.randint(-(2**31), 2**31 - 1)))
    if kind == "long":
        return rng.choice((0, 1, -1, 8192, 2**63 - 1, -(2**63), rng.randint(0, 2**45)))
    if kind in ("float", "double"):
        return rng.choice((0.0, -1.5, 1e30 if kind == "double" else 3.0, rng.random()))
    if kind == "bytes":
        return rng.choice((b"", b"\xff\xfe", rng.randbytes(rng.randint(0, 12)), *(text.encode() for text in STRINGS)))
    return rng.choice((*STRINGS, "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(0, 12)))))


def written(schema: dict[str, Any], seed: int) -> bytes | None:
    """A payload fastavro's writer writes for a random value of ``schema`` (None when it has no value within the
    bounds tried, or the writer refuses the schema or the value: that is not what is fuzzed here)."""
    try:
        value = _Datums(schema, seed).value(schema)
        out = io.BytesIO()
        fastavro.schemaless_writer(out, schema, value)
    except (_NoDatum, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - fastavro's writer refusing a schema or a value it would not write
        return None
    return out.getvalue()


@dataclass(frozen=True)
class Case:
    """A writer schema's text and payloads to read with it: ``written`` ones (a value of the schema as fastavro
    writes it) and ``hostile`` ones (damaged written ones, random bytes). ``admitted``: what admission must decide,
    when the case says (the worst cases do)."""

    schema: str
    written: tuple[bytes, ...] = ()
    hostile: tuple[bytes, ...] = ()
    admitted: bool | None = None


# The most fields the wide schemas add: past the limits in the long profile; within them in the short one, where
# each costs a second to compile (the explicit examples and tests reach the limits).
WIDEST = 2_500 if PROFILE == "long" else 200


def _wide(draw: Callable[..., Any]) -> dict[str, Any]:
    """The contract with hundreds or thousands of fields added, up to and past the size and type limits."""
    count = draw(st.integers(50, WIDEST))
    kind = draw(st.sampled_from(["long", "string", ["null", "long"], {"type": "map", "values": "long"},
                                 {"type": "array", "items": ["null", "long"]}]))
    return contract_with(*({"name": f"w{index}", "type": copy.deepcopy(kind)} for index in range(count)))


def _deep(draw: Callable[..., Any]) -> dict[str, Any]:
    """The contract with a field nested arrays, maps, unions and records deep."""
    layers = draw(st.lists(st.sampled_from(["array", "map", "union", "record"]), min_size=5, max_size=120))
    inner: object = "long"
    for index, layer in enumerate(layers):
        inner = ({"type": "array", "items": inner} if layer == "array" else
                 {"type": "map", "values": inner} if layer == "map" else
                 ["null", inner] if layer == "union" and not isinstance(inner, list) else
                 {"type": "record", "name": f"D{index}", "fields": [{"name": "d", "type": inner}]})
    return contract_with({"name": "deep", "type": inner})


def _expanding(draw: Callable[..., Any]) -> dict[str, Any]:
    """Named records each holding the one before twice: 2 ** levels types once written out, in a small text."""
    levels = draw(st.integers(2, 40))
    first: dict[str, object] = {"type": "record", "name": "X0", "fields": [{"name": "v", "type": "long"}]}
    fields: list[dict[str, object]] = [{"name": "x0", "type": first}]
    for level in range(1, levels):
        fields.append({"name": f"x{level}", "type": {"type": "record", "name": f"X{level}", "fields": [
            {"name": "a", "type": f"X{level - 1}"}, {"name": "b", "type": f"X{level - 1}"}]}})
    return contract_with(*fields)


RECURSIVE_TYPES: tuple[object, ...] = (
    # a record in itself: through a union, an array, a map, and another record
    ["null", {"type": "record", "name": "Node", "fields": [{"name": "child", "type": ["null", "Node"]}]}],
    {"type": "record", "name": "Tree", "fields": [{"name": "children", "type": {"type": "array", "items": "Tree"}}]},
    {"type": "record", "name": "Dict", "fields": [{"name": "entries", "type": {"type": "map", "values": "Dict"}}]},
    {"type": "record", "name": "A", "fields": [{"name": "b", "type": ["null", {
        "type": "record", "name": "B", "fields": [{"name": "a", "type": ["null", "A"]}]}]}]},
    {"type": "record", "name": "Self", "fields": [{"name": "me", "type": "Self"}]},  # needs itself: no value at all
)


def _recursive(draw: Callable[..., Any]) -> dict[str, Any]:
    """The contract with a field of a record containing itself; or the contract's Request containing itself."""
    if draw(st.booleans()):
        return contract_with({"name": "next", "type": copy.deepcopy(draw(st.sampled_from(RECURSIVE_TYPES)))})
    return contract_with({"name": "inner", "type": ["null", "Request"], "default": None})


def _mutated_contract(draw: Callable[..., Any], drawer: _SchemaDrawer) -> dict[str, Any]:
    """The contract's Request schema with fields kept, dropped or retyped, and random fields added (with and
    without defaults). Types are drawn in field order, so a reference names a type defined before it."""
    schema = copy.deepcopy(CONTRACT)
    slots: list[dict[str, Any] | None] = list(schema["fields"])  # None: a field added there
    for _ in range(draw(st.integers(0, 4))):
        slots.insert(draw(st.integers(0, len(slots))), None)
    fields: list[dict[str, Any]] = []
    for slot in slots:
        if slot is None:
            fields.append(drawer.field(f"added{len(fields)}", 1))
            continue
        action = draw(st.sampled_from(["keep"] * 16 + ["drop", "retype", "retype", "random type"]))
        if action == "drop":
            continue
        if action == "retype":
            slot["type"] = copy.deepcopy(draw(st.sampled_from(CONTRACT_RETYPES[slot["name"]])))
            slot.pop("default", None)
        elif action == "random type":
            slot["type"] = drawer.type(1)
            slot.pop("default", None)
        fields.append(slot)
    schema["fields"] = fields
    return schema


@st.composite
def writer_schemas(draw: Callable[..., Any], modes: Sequence[str] = ("contract", "contract", "contract", "random",
                                                                     "recursive", "wide", "deep", "expanding")
                   ) -> dict[str, Any]:
    """A writer schema: mostly the contract mutated; else random records and the worst shapes (recursive, wide,
    deep, exponentially expanding)."""
    mode = draw(st.sampled_from(list(modes)))
    drawer = _SchemaDrawer(draw, recursion=draw(st.booleans()), max_depth=draw(st.integers(1, 5)))
    if mode == "contract":
        return _mutated_contract(draw, drawer)
    if mode == "random":
        name = draw(st.sampled_from(["Request", "d3stream.v2.Request", "Answer", "Other"]))
        drawer.open.append(name)
        fields = [drawer.field(f"f{index}", 1) for index in range(draw(st.integers(0, 6)))]
        if draw(st.booleans()):
            fields += [{"name": "id", "type": "string"}, {"name": "questions", "type": {"type": "map", "values": "string"}}]
        return {"type": "record", "name": name, "fields": fields}
    return {"recursive": _recursive, "wide": _wide, "deep": _deep, "expanding": _expanding}[mode](draw)


@st.composite
def cases(draw: Callable[..., Any], modes: Sequence[str] | None = None) -> Case:
    """A writer schema (sometimes pretty-printed), payloads written with it, damaged ones and random bytes."""
    schema = draw(writer_schemas() if modes is None else writer_schemas(modes))
    text = json.dumps(schema, indent=draw(st.sampled_from([None, None, 2])))
    payloads: list[bytes] = []
    if len(text) <= MAX_SCHEMA_BYTES:  # past it nothing is parsed, and nothing written
        try:
            parsed_schema = parsed(schema)
        except Exception:  # noqa: BLE001 - not a schema fastavro parses: random bytes only
            parsed_schema = None
        if parsed_schema is not None:
            for seed in draw(st.lists(st.integers(0, 2**32), min_size=1, max_size=3)):
                payload = written(parsed_schema, seed)
                if payload is not None:
                    payloads.append(payload)
    hostile = [damaged(payload, draw(damages)) for payload in payloads for _ in range(draw(st.integers(0, 2)))]
    hostile += draw(st.lists(st.binary(max_size=64), max_size=2))
    return Case(text, tuple(payloads), tuple(hostile))


# ----------------------------------------------------------------------------------- the worst cases, by hand

def _nodes(depth: int) -> bytes:
    """A ``next`` chain of Node records ``depth`` deep: branch Node, then the child's branch..., then null."""
    return b"\x02" * depth + b"\x00"


RECURSIVE_20K = Case(json.dumps(contract_with({"name": "next", "type": RECURSIVE_TYPES[0], "default": None})),
                     written=(SMALLEST + _nodes(20_000),), admitted=False)
_NULLS = contract_with({"name": "nulls", "type": {"type": "array", "items": "null"}})
NULLS_80M = Case(json.dumps(_NULLS), written=(SMALLEST + zigzag(80_000_000) + b"\x00" * (44 - len(SMALLEST)),),
                 admitted=False)
_LONGS = contract_with({"name": "counts", "type": {"type": "array", "items": "long"}})
LONGS_2_31 = Case(json.dumps(_LONGS), hostile=(SMALLEST + zigzag(2**31) + b"\x02" * 16,
                                               SMALLEST + zigzag(-(2**31)) + zigzag(2**40) + b"\x02" * 16),
                  admitted=True)
EMPTY = Case(CONTRACT_TEXT, hostile=(b"",), admitted=True)
EXPANDING_30 = Case(json.dumps(_expanding(lambda strategy: 30)), admitted=False)
TOO_WIDE = Case(json.dumps(contract_with(*({"name": f"w{index}", "type": "long"} for index in range(2_500)))),
                admitted=False)


def fastavro_written(schema: dict[str, Any], value: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed(schema), value)
    return out.getvalue()


# Writer schemas admitted for a request that give a contract field another type Avro's resolution promotes.
_PRIORITY_BYTES = contract_with(replace={"priority": "bytes"})
PRIORITY_AS_BYTES = Case(json.dumps(_PRIORITY_BYTES), written=(fastavro_written(
    _PRIORITY_BYTES, {"id": "r", "questions": {"q": SMALLEST_TEXT}, "priority": b"high"}),), admitted=True)
_STATE_STRING = contract_with(replace={"state": "string", "metadata": "bytes"})
STATE_AS_STRING = Case(json.dumps(_STATE_STRING), written=(fastavro_written(
    _STATE_STRING, {"id": "r", "questions": {"q": SMALLEST_TEXT}, "state": '{"ticket": 1}', "metadata": b"[1]"}),),
    admitted=True)
TOO_DEEP_SCHEMA = Case(json.dumps(contract_with({"name": "deep", "type": json.loads(
    '{"type": "array", "items": ' * 70 + '"long"' + "}" * 70)})), admitted=False)


def test_the_worst_cases_are_what_they_claim():
    """The hand-made payloads are what their names say (so the examples below test what they mean to)."""
    assert len(NULLS_80M.written[0]) == 48 and len(SMALLEST) < 40
    assert RECURSIVE_20K.written[0].count(b"\x02") >= 20_000
    assert len(EXPANDING_30.schema) < MAX_SCHEMA_BYTES
    # the chain of nodes is the one fastavro's writer writes (a shorter one, compared byte for byte)
    chain: object = None
    for _ in range(50):
        chain = ("d3stream.v2.Node", {"child": chain})
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed(json.loads(RECURSIVE_20K.schema)),
                               {"id": "r", "questions": {"q": SMALLEST_TEXT}, "next": chain})
    assert out.getvalue() == SMALLEST + _nodes(50)


# ============================================================================================ properties


@fuzz()
@given(document=requests)
def test_a_valid_request_reads_back_the_same_in_every_framing(document):
    """Plain JSON, JSON Schema framed and Avro framed (the worker's lean reading and the client's full one):
    the same request, equal to the document's."""
    expected = msgspec.convert(document, Request)
    value = msgspec.json.encode(document)
    payload = CONTRACT_CODEC.write(document)
    for outcome in (bounded(lambda: plain_json(value)), bounded(lambda: json_schema_framed(value)),
                    bounded(lambda: avro_framed(CONTRACT_CODEC, payload)),
                    bounded(lambda: avro_client_read(CONTRACT_CODEC, payload))):
        assert outcome.request == expected, outcome


@fuzz()
@given(document=requests, damage=damages)
@example(document={"id": "r", "questions": {"q": json.loads(NOUL)}}, damage=[("truncate", 0, 0)])
@example(document={"id": "r", "questions": {"q": json.loads(NOUL)}}, damage=[("claim", 1, 3)])
def test_a_damaged_avro_request_ends_in_a_request_or_a_refusal(document, damage):
    """Truncated, bit-flipped, spliced encodings of valid requests, read as the worker and the client read them."""
    payload = damaged(CONTRACT_CODEC.write(document), damage)
    bounded(lambda: avro_framed(CONTRACT_CODEC, payload))
    bounded(lambda: avro_client_read(CONTRACT_CODEC, payload))


@fuzz()
@given(document=requests, damage=damages)
def test_a_damaged_json_request_ends_in_a_request_or_a_refusal_plain_or_framed(document, damage):
    value = damaged(msgspec.json.encode(document), damage)
    plain, framed = bounded(lambda: plain_json(value)), bounded(lambda: json_schema_framed(value))
    if framed.kind != "_Refused":  # a framed payload that is JSON is refused, or read, as the plain request
        assert (framed.request, framed.code, framed.message) == (plain.request, plain.code, plain.message)


@fuzz()
@given(value=st.binary(max_size=512) | st.sampled_from([b"{", b"[" * 5000, b'{"id": "r", "questions": {"q": {}}}']))
@example(value=b"")
@example(value=b"\x00\x00\x00\x00\x07")
def test_random_bytes_end_in_a_request_or_a_refusal_in_every_framing(value):
    bounded(lambda: plain_json(value))
    bounded(lambda: json_schema_framed(value))
    bounded(lambda: avro_framed(CONTRACT_CODEC, value))
    bounded(lambda: avro_client_read(CONTRACT_CODEC, value))


@fuzz(0.75)
@given(case=cases())
@example(case=RECURSIVE_20K)
@example(case=NULLS_80M)
@example(case=LONGS_2_31)
@example(case=EMPTY)
@example(case=EXPANDING_30)
@example(case=TOO_DEEP_SCHEMA)
@example(case=TOO_WIDE)
def test_any_writer_schema_is_admitted_or_refused_and_its_payloads_end_in_a_request_or_a_refusal(case):
    """Admission decides with a reason; only what it admits reads payloads, each ending in a request or a
    refusal, as the worker reads it and as the client does (the two may differ: the worker hands on JSON text as
    it came, so a duplicate key in it is refused, as in a plain JSON request; the client's reading parses it)."""
    codec = admitted(case.schema)
    if case.admitted is not None:
        assert isinstance(codec, AvroCodec) == case.admitted, codec
    if not isinstance(codec, AvroCodec):
        assert codec.message, "a refusal says why"
        return
    for payload in (*case.written, *case.hostile):
        worker = bounded(lambda: avro_framed(codec, payload))  # noqa: B023 - called at once
        bounded(lambda: avro_client_read(codec, payload))  # noqa: B023 - called at once
        if payload in case.hostile and case.admitted:  # the worst cases': counts past their bytes, no bytes
            assert worker.kind == "_Refused" and worker.code == "invalid_request", worker


def without_logical_types(schema: object) -> object:
    """``schema`` with its logical types taken out: the same binary, which fastavro's reader then reads as the
    primitives the contract reads (not as datetimes, decimals and UUIDs)."""
    if isinstance(schema, list):
        return [without_logical_types(each) for each in schema]
    if isinstance(schema, dict):
        return {key: without_logical_types(value) for key, value in schema.items() if key != "logicalType"}
    return schema


@fuzz(0.75)
@given(case=cases(modes=("contract",)))
@example(case=PRIORITY_AS_BYTES)
@example(case=STATE_AS_STRING)
def test_a_payload_of_an_admitted_writer_schema_reads_as_avro_resolution_reads_it(case):
    """The compiled reader against the reference: fastavro's resolving reader (the writer schema against the
    contract's) and ``from_avro``. Either both read the same document, or both refuse the payload."""
    codec = admitted(case.schema)
    if not isinstance(codec, AvroCodec):
        return
    writer = parsed(without_logical_types(json.loads(case.schema)))
    for payload in case.written:
        try:
            datum_read = fastavro.schemaless_reader(io.BytesIO(payload), writer, CONTRACT_PARSED)
        except Exception:  # noqa: BLE001, S112 - fastavro's resolution disagrees with Avro's checker: no reference
            continue
        try:
            reference: object = json.dumps(from_avro(datum_read, Request), sort_keys=True)
        except ValueError as refused:  # JSON text that is not JSON: the compiled reader must refuse it too
            reference = refused
        try:
            compiled: object = json.dumps(json.loads(codec.read(payload)), sort_keys=True)
        except PayloadError as refused:
            compiled = refused
        if isinstance(reference, ValueError):
            assert isinstance(compiled, PayloadError), (compiled, reference)
        else:
            assert compiled == reference, f"writer schema {case.schema}"


# ----------------------------------------------------------------------------------- deep and huge JSON

# Writer schemas that carry free-form JSON as text in each way Avro's resolution admits: the contract's union,
# the union reordered, a plain string, and bytes promoted to a string.
JSON_TEXT_WRITERS: dict[str, dict[str, object]] = {
    "the contract's": {},
    "a string": {"state": "string", "metadata": "string"},
    "a string or null": {"state": ["string", "null"], "metadata": ["string", "null"]},
    "bytes": {"state": ["null", "bytes"], "metadata": "bytes", "questions": {"type": "map", "values": "bytes"}},
}
_WRITER_CODECS: dict[str, tuple[dict[str, Any], AvroCodec]] = {}


def json_text_writer(name: str) -> tuple[dict[str, Any], AvroCodec]:
    """The parsed writer schema named in ``JSON_TEXT_WRITERS``, admitted, and its codec."""
    if name not in _WRITER_CODECS:
        schema = admit(json.dumps(contract_with(replace=JSON_TEXT_WRITERS[name])), Request)
        _WRITER_CODECS[name] = (schema, AvroCodec(schema, Request))
    return _WRITER_CODECS[name]


def nested(depth: int, shape: str) -> str:
    """JSON text ``depth`` levels deep: arrays, objects, or both in turn."""
    opening = {"array": "[", "object": '{"a":', "mixed": '[{"a":'}[shape]
    closing = {"array": "]", "object": "}", "mixed": "}]"}[shape]
    levels = depth if shape != "mixed" else (depth + 1) // 2
    return opening * levels + "1" * (shape != "array") + closing * levels


def request_with(place: str, text: str) -> tuple[bytes, dict[str, object]]:
    """A request whose ``place`` (state, metadata or a question) is ``text``: as JSON, and as an Avro datum."""
    question = text if place == "question" else NOUL
    member = "" if place == "question" else f'"{place}": {text}, '
    json_value = f'{{"id": "deep-1", {member}"questions": {{"q": {question}}}}}'.encode()
    datum_value: dict[str, object] = {"id": "deep-1", "questions": {"q": NOUL}}
    if place == "question":
        datum_value["questions"] = {"q": text}
    else:
        datum_value[place] = text
    return json_value, datum_value


def avro_payload(writer: dict[str, Any], datum_value: dict[str, object]) -> bytes:
    """The Avro payload of a request's datum (its free-form fields as JSON text) for one of the writers above:
    bytes where the writer has bytes, and the JSON text ``null`` for a field the writer cannot leave null."""
    value = copy.deepcopy(datum_value)
    for name, field_type in ((field["name"], field["type"]) for field in writer["fields"]):
        if name in ("state", "metadata") and name not in value and field_type in ("string", "bytes"):
            value[name] = "null"
        text = value.get(name)
        if _accepts_bytes(field_type) and isinstance(text, str):
            value[name] = text.encode()
        elif name == "questions" and _accepts_bytes(field_type.get("values") if isinstance(field_type, dict) else None):
            value[name] = {key: entry.encode() for key, entry in value[name].items()}
    out = io.BytesIO()
    fastavro.schemaless_writer(out, writer, value)
    return out.getvalue()


def _accepts_bytes(field_type: object) -> bool:
    return field_type == "bytes" or (isinstance(field_type, list) and "bytes" in field_type)


@fuzz()
@given(depth=st.integers(65, 20_000), shape=st.sampled_from(["array", "object", "mixed"]),
       place=st.sampled_from(["state", "metadata", "question"]), writer=st.sampled_from(sorted(JSON_TEXT_WRITERS)))
@example(depth=10_000, shape="array", place="state", writer="the contract's")
@example(depth=10_000, shape="object", place="question", writer="the contract's")
@example(depth=10_000, shape="array", place="state", writer="a string")
@example(depth=10_000, shape="mixed", place="metadata", writer="bytes")
def test_json_nested_too_deep_is_refused_alike_in_every_framing(depth, shape, place, writer):
    """JSON text nested past the limit, plain, in a JSON Schema frame, or as JSON text in an Avro request written
    with any writer schema carrying it: each ``invalid_request`` with the one message a plain request gets."""
    json_value, datum_value = request_with(place, nested(depth, shape))
    schema, codec = json_text_writer(writer)
    payload = avro_payload(schema, datum_value)
    refused = Outcome(kind="EventError", code="invalid_request", message=TOO_DEEP)
    assert bounded(lambda: plain_json(json_value)) == refused
    assert bounded(lambda: json_schema_framed(json_value)) == refused
    avro = bounded(lambda: avro_framed(codec, payload))
    assert (avro.code, avro.message) == ("invalid_request", TOO_DEEP), avro


@fuzz(0.5)
@given(width=st.integers(0, 150_000), kind=st.sampled_from(["numbers", "strings", "keys", "text"]),
       place=st.sampled_from(["state", "metadata", "question"]), writer=st.sampled_from(sorted(JSON_TEXT_WRITERS)))
@example(width=131_000, kind="numbers", place="state", writer="the contract's")
@example(width=150_000, kind="keys", place="question", writer="bytes")
def test_huge_json_ends_alike_in_every_framing(width, kind, place, writer):
    """Wide JSON (long arrays, many keys, a long string), under and over ``max_request_bytes``: a request or a
    refusal, the same in every framing (the Avro reader hands on the JSON text as it came)."""
    text = {"numbers": lambda: "[" + ",".join(["0"] * width) + "]" if width else "[]",
            "strings": lambda: msgspec.json.encode(["ab"] * width).decode(),
            "keys": lambda: msgspec.json.encode({f"k{index}": index for index in range(width)}).decode(),
            "text": lambda: msgspec.json.encode("x" * width).decode()}[kind]()
    json_value, datum_value = request_with(place, text)
    json_value = msgspec.json.encode(msgspec.json.decode(json_value))  # compact, as the Avro reader writes it
    schema, codec = json_text_writer(writer)
    payload = avro_payload(schema, datum_value)
    plain = bounded(lambda: plain_json(json_value))
    assert bounded(lambda: json_schema_framed(json_value)) == plain
    avro = bounded(lambda: avro_framed(codec, payload))
    assert (avro.code, avro.request is None) == (plain.code, plain.request is None), (avro, plain)


# ============================================================================================ the worst cases


def test_a_recursive_schema_is_refused_and_never_followed_even_past_admission():
    """Admission refuses it; and a codec given it anyway (bypassing admission) refuses to read, rather than
    following 20,000 levels (fastavro's reader crashes the interpreter there)."""
    with pytest.raises(SchemaRefused, match="recursive"):
        admit(RECURSIVE_20K.schema, Request)
    codec = AvroCodec(parsed(json.loads(RECURSIVE_20K.schema)), Request)
    outcome = bounded(lambda: avro_framed(codec, RECURSIVE_20K.written[0]))
    assert outcome.kind == "_Refused" and "refers to itself" in outcome.message, outcome


def test_an_array_of_nulls_claiming_80_million_items_is_refused_before_any_loop():
    """The schema is refused at admission; a codec given it anyway refuses the 48-byte payload on its count, with
    the memory of a few bytes (no list of 80 million is ever built)."""
    with pytest.raises(SchemaRefused, match="items take no bytes"):
        admit(NULLS_80M.schema, Request)
    codec = AvroCodec(parsed(_NULLS), Request)
    outcome = measured(lambda: settle(lambda: avro_framed(codec, NULLS_80M.written[0])), 4 * 2**20)
    assert outcome.code == "invalid_request" and "80,000,000 items claimed" in outcome.message, outcome


def test_an_array_claiming_2_31_longs_is_refused_naming_the_claim():
    codec = admitted(LONGS_2_31.schema)
    assert isinstance(codec, AvroCodec)
    outcome = bounded(lambda: avro_framed(codec, LONGS_2_31.hostile[0]))
    assert outcome.code == "invalid_request" and "2,147,483,648 items claimed" in outcome.message, outcome


def test_an_empty_payload_after_the_frame_is_refused_in_both_formats():
    avro = bounded(lambda: avro_framed(CONTRACT_CODEC, b""))
    assert avro.kind == "_Refused" and avro.code == "invalid_request" and "the payload is empty" in avro.message
    framed = bounded(lambda: json_schema_framed(b""))
    assert framed.kind == "_Refused" and framed.code == "invalid_request" and "is empty" in framed.message


@pytest.mark.parametrize("kind", ["long", "map"])
def test_admitting_the_largest_schema_within_the_limits_stays_within_the_memory_bound(kind):
    """A writer schema just within the size and type limits (every field a long, or a map of longs) is
    admitted, compiling the largest readers admission allows, within the memory bound."""
    field_type = "long" if kind == "long" else {"type": "map", "values": "long"}
    room = MAX_SCHEMA_TYPES - 40  # the contract's own 30 types, and a margin
    count = room if kind == "long" else room // 2  # a map is two types: itself and its values
    text = json.dumps(contract_with(*({"name": f"a{index}", "type": field_type} for index in range(count))),
                      separators=(",", ":"))
    assert isinstance(admitted(text), AvroCodec)


def test_reading_a_payload_of_max_request_bytes_of_one_byte_records_stays_within_the_memory_bound():
    """The payload that allocates the most per byte read: an array of records of one boolean (each byte a record)
    that the request does not carry. Reading costs memory in proportion to the bytes (docs/REGISTRY.md), so a
    quarter of ``max_request_bytes`` (256 KiB), read under tracemalloc at a quarter of the time, must stay within
    a quarter of the bound."""
    schema = contract_with({"name": "junk", "type": {"type": "array", "items": {
        "type": "record", "name": "J", "fields": [{"name": "b", "type": "boolean"}]}}})
    codec = admitted(json.dumps(schema))
    assert isinstance(codec, AvroCodec)
    size = 262_144 // 4
    payload = SMALLEST + zigzag(size) + b"\x01" * size + b"\x00"
    outcome = measured(lambda: settle(lambda: avro_framed(codec, payload)), MEMORY_BOUND // 4)
    assert outcome.request is not None and outcome.request.id == "r"
