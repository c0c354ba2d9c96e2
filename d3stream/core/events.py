"""The event contract: request, answer and dead-letter records, and their JSON Schemas.

Requests arrive as UTF-8 JSON on the request topic, keyed by request id. Every request gets exactly
one answer event on the answer topic, with the same key: either the model's ``answers`` or an
``error`` saying why there are none. Bytes that are not even a JSON object also go to the dead-letter
topic with the reason, so nothing a producer sends is silently dropped.

The msgspec Structs below are the single definition of the contract: the decoder validates with them
and ``schemas/*.schema.json`` are generated from them (``python -m d3stream.core.events`` rewrites them; a
test fails when the checked-in files drift).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec

from d3stream.runtime.kinds import MEDIA_KINDS, QUESTION_TYPE_NAMES, question_type, spoken_list

SCHEMA_VERSION = "2"  # 2: deadline, ttl_ms, priority, tenant; provenance.cost (requests of 1 stay valid)
CONTENT_TYPE = "application/json"
HEADERS = [("content-type", CONTENT_TYPE.encode()), ("d3stream-schema", SCHEMA_VERSION.encode())]

# Request-level error codes an answer event can carry (question-level errors live inside ``answers``).
ERROR_CODES = (
    "undecodable_event",  # not UTF-8 JSON at all (also dead-lettered)
    "invalid_request",  # JSON, but not a valid request (schema or content)
    "model_not_served",  # the request names a model this worker does not serve
    "media_not_allowed",  # a media reference outside the allowlist, or an http(s) URL / local path
    "media_missing",  # the object does not exist
    "media_too_large",  # over the strict size limits (refused from HEAD, never downloaded)
    "media_unreadable",  # fetched, but not a valid image or video
    "media_unavailable",  # the object store did not answer in time, after retries
    "deadline_exceeded",  # past its deadline (or ttl_ms) before a pass carried it: no device time spent
    "answer_too_large",  # the answer does not fit the answer topic's message limit, even compressed
    "internal_error",  # a fault of this worker; the message says what
)

# Priority lanes, highest first (the scheduler's lane index is the position here).
Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)

MediaReference = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        description="s3://bucket/key (optionally ?versionId=...) or an inline "
        + spoken_list([f"data:{kind.name}/..." for kind in MEDIA_KINDS]) + " URL",
    ),
]


class Request(msgspec.Struct, kw_only=True):
    """A decision request: questions about one state, with the media every question sees."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=512, description="request id; also the Kafka key")]
    state: Any = msgspec.field(default=None)
    questions: Annotated[
        dict[str, Any],
        msgspec.Meta(description=f"question id -> System One question ({spoken_list(QUESTION_TYPE_NAMES)})"),
    ]
    images: list[MediaReference] = msgspec.field(default_factory=list)
    videos: list[MediaReference] = msgspec.field(default_factory=list)
    model: str | None = None
    permutation_average: bool | None = None
    metadata: Any = None
    # Scheduling (schema 2; all optional, so requests of schema 1 stay valid).
    deadline: Annotated[int, msgspec.Meta(
        ge=0, description="epoch milliseconds after which the answer is no longer wanted: answered deadline_exceeded "
                          "without device time")] | None = None
    ttl_ms: Annotated[int, msgspec.Meta(
        ge=0, description="the deadline relative to the record's timestamp (the earlier of the two counts)")] | None = None
    priority: Annotated[Priority, msgspec.Meta(
        description="the lane: passes are filled from higher lanes first, with ageing (docs/SCHEDULING.md)")] = "normal"
    tenant: Annotated[str, msgspec.Meta(
        min_length=1, max_length=128,
        description="who the cost is counted for; default: the tenant_header record header, else the topic")] | None = None


class Source(msgspec.Struct, kw_only=True):
    """Where the request was read from."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None = None


class ErrorInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    late_ms: Annotated[int | None, msgspec.Meta(
        description="deadline_exceeded: how long after its deadline the request was dropped")] = None


class ModelRecord(msgspec.Struct, kw_only=True):
    name: str
    runtime: str
    provenance_sha256: str


class MediaRecord(msgspec.Struct, kw_only=True):
    """One media object the answer depends on."""

    uri: str
    etag: str | None = None
    version: str | None = None
    bytes: int
    sha256: str


class BatchRecord(msgspec.Struct, kw_only=True):
    """The forward passes that carried this request's questions (summed over passes)."""

    passes: int = 0
    rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    # Shared-prefix reuse: the questions ran on one pass of the prompt prefix they share; saved_tokens
    # is the prompt tokens that were therefore not run again.
    shared_prefix: bool = False
    saved_tokens: int = 0


class Cost(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What answering this request used (schema 2). ``device_seconds`` is its share of every pass it rode in,
    by tokens (a pass's seconds x its rows' real tokens / the pass's real tokens), so the shares of all
    answers add up to the passes' measured time."""

    tenant: str | None = None
    prompt_tokens: int = 0
    padded_tokens: int = 0
    device_seconds: float = 0.0
    media_bytes: int = 0
    # Not measured separately: the vision tower runs inside the forward pass, so its time is part of
    # device_seconds (None until a runtime reports it).
    vision_seconds: float | None = None


class Timings(msgspec.Struct, kw_only=True):
    """Where the time went for this request, in milliseconds."""

    queued: float = 0.0
    fetch: float = 0.0
    decode: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    total: float = 0.0


class Worker(msgspec.Struct, kw_only=True):
    host: str
    pid: int
    version: str


class Provenance(msgspec.Struct, kw_only=True):
    model: ModelRecord | None = None
    media: list[MediaRecord] = msgspec.field(default_factory=list)
    batch: BatchRecord = msgspec.field(default_factory=BatchRecord)
    timings: Timings = msgspec.field(default_factory=Timings)
    cost: Cost | None = None
    worker: Worker | None = None
    replay_id: str | None = None


class Answer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The answer to one request: ``answers`` and ``usage``, or ``error``; always ``provenance``."""

    id: str
    answer_id: str = ""  # deterministic per request record and model: duplicates share it
    source: Source
    model: str | None = None
    answers: dict[str, Any] | None = None
    usage: dict[str, int] | None = None
    error: ErrorInfo | None = None
    provenance: Provenance = msgspec.field(default_factory=Provenance)
    metadata: Any = None


class DeadLetter(msgspec.Struct, kw_only=True):
    """A record that could not be read as a request, kept with the reason.

    The raw bytes travel base64-encoded up to the worker's ``dead_letter_max_bytes`` (a dead letter must fit
    its topic's message limit too); beyond that only their beginning, with the size and SHA-256 of the whole
    so the record can still be identified."""

    reason: str
    source: Source
    key: str | None = None
    value: str = msgspec.field(default="", name="value_base64")
    value_bytes: Annotated[int, msgspec.Meta(description="size of the whole record value")] = 0
    value_sha256: Annotated[str, msgspec.Meta(description="SHA-256 of the whole record value (hex)")] = ""
    value_truncated: Annotated[
        bool, msgspec.Meta(description="value_base64 holds only the first dead_letter_max_bytes bytes")
    ] = False


class EventError(ValueError):
    """A record that is not a valid request; ``code`` is the answer's error code."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


_document_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

# Nesting deeper than this is refused before it reaches the model (JSON bombs of brackets).
MAX_NESTING = 64


@dataclass(frozen=True)
class RequestLimits:
    """Request-level limits checked while decoding, before any fetch, decode or device time.

    Each is the setting of the same name with ``max_request_`` in front (``config.Settings``); None means
    no limit. The defaults keep the answer of any request within them well under Kafka's default 1 MB
    message limit: the answer echoes every option key (and a score's level texts) with a probability
    (~25 bytes each), the question ids and the metadata, so its size is bounded by about the request's
    bytes plus 35 bytes per option.
    """

    bytes: int | None = 262_144
    questions: int | None = 256
    options: int | None = 8_192

    @classmethod
    def from_settings(cls, settings: Any) -> RequestLimits:
        return cls(
            bytes=settings.max_request_bytes,
            questions=settings.max_request_questions,
            options=settings.max_request_options,
        )


DEFAULT_LIMITS = RequestLimits()


def _depth_ok(value: Any, limit: int = MAX_NESTING) -> bool:
    stack = [(value, 1)]
    while stack:
        current, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(current, dict):
            stack.extend((v, depth + 1) for v in current.values())
        elif isinstance(current, list):
            stack.extend((v, depth + 1) for v in current)
    return True


def _option_count(question: Any) -> int:
    """The answer options a question asks for, as far as its shape says (validation comes later)."""
    if not isinstance(question, dict):
        return 0
    kind = question_type(question.get("type"))
    if kind is not None and kind.fixed_options is not None:
        return kind.fixed_options
    criteria = question.get("criteria")
    return len(criteria) if isinstance(criteria, (dict, list)) else 0


def _refuse_duplicate_keys(value: bytes, document: Any, request_id: str | None) -> None:
    """EventError naming the key when a JSON object of the record has the same key twice.

    msgspec (like most JSON parsers) keeps the last of duplicate keys, so a request could show one value
    to a reviewer's parser and another to the model. The check is cheap on the normal path: every object
    member has one ``:`` outside strings and ``:`` is never escaped on output, so re-encoding the
    decoded ``document`` gives as many colons as the record exactly when no member was dropped. Only a
    mismatch (a duplicate, or a ``\\u003a`` escape in a string) pays for a second, pair-by-pair parse.
    """
    if _encoder.encode(document).count(b":") == value.count(b":"):
        return
    duplicate: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen and not duplicate:
                duplicate.append(name)
            seen.add(name)
        return dict(pairs)

    try:
        json.loads(value, object_pairs_hook=pairs_hook)
    except (ValueError, RecursionError) as exc:  # msgspec read it, so this is a parser difference
        raise EventError("invalid_request", f"the request could not be checked for duplicate keys: {exc}", request_id) from exc
    if duplicate:
        raise EventError(
            "invalid_request",
            f"the request has the key {duplicate[0][:80]!r} twice in one JSON object; keys must be unique "
            "(parsers disagree on which value counts)",
            request_id,
        )


def _check_limits(request: Request, limits: RequestLimits) -> None:
    if limits.questions is not None and len(request.questions) > limits.questions:
        raise EventError(
            "invalid_request",
            f"the request has {len(request.questions):,} questions, over max_request_questions "
            f"({limits.questions:,}); split it into several requests",
            request.id,
        )
    if limits.options is not None:
        options = sum(_option_count(question) for question in request.questions.values())
        if options > limits.options:
            raise EventError(
                "invalid_request",
                f"the request's questions have {options:,} options in all, over max_request_options "
                f"({limits.options:,}); split it into several requests",
                request.id,
            )


def decode_request(value: bytes | None, key: bytes | None = None, limits: RequestLimits = DEFAULT_LIMITS) -> Request:
    """A validated request from a record's bytes; EventError with the code and reason otherwise.

    ``limits`` are checked here, before anything is fetched or run: the record's size before it is
    parsed, duplicate keys, then the counts of questions and options.
    """
    fallback_id = key.decode("utf-8", "replace") if key else None
    if value is None:
        raise EventError("undecodable_event", "the record has no value (a tombstone is not a request)", fallback_id)
    if limits.bytes is not None and len(value) > limits.bytes:
        raise EventError(
            "invalid_request",
            f"the record is {len(value):,} bytes, over max_request_bytes ({limits.bytes:,}); it was not read",
            fallback_id,
        )
    document = _parse(value, fallback_id)
    request_id = document.get("id") if isinstance(document.get("id"), str) and document.get("id") else fallback_id
    # Too few brackets to nest too deep: the walk over the document is only needed past the limit.
    if value.count(b"[") + value.count(b"{") > MAX_NESTING and not _depth_ok(document):
        raise EventError("invalid_request", _TOO_DEEP, request_id)
    try:
        request = msgspec.convert(document, Request)
    except msgspec.ValidationError as exc:
        raise EventError("invalid_request", f"the request does not match the schema: {exc}", request_id) from exc
    _refuse_duplicate_keys(value, document, request.id)
    _check_limits(request, limits)
    return request


def _parse(value: bytes, fallback_id: str | None) -> dict[str, Any]:
    """The record as a JSON object (parsed once: the request, the depth and the duplicate-key checks all read
    this document); ``undecodable_event`` when it is not UTF-8 JSON or not an object."""
    try:
        document = _document_decoder.decode(value)
    except RecursionError as exc:
        raise _too_deep(value, fallback_id) from exc
    except msgspec.DecodeError as exc:
        raise EventError("undecodable_event", f"the record is not UTF-8 JSON: {exc}", fallback_id) from exc
    if not isinstance(document, dict):
        raise EventError(
            "undecodable_event", f"a request is a JSON object, got {type(document).__name__}", fallback_id
        )
    return document


_TOO_DEEP = f"the request is nested deeper than {MAX_NESTING} levels of JSON arrays and objects"
# The id, when it is the first member of the request object (as producers usually write it): the one part
# of a document too deep to parse that can still be read, so its error answer carries the request's id.
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*("(?:[^"\\]|\\.){1,512}")')


def _too_deep(value: bytes, fallback_id: str | None) -> EventError:
    """The error for a record msgspec gave up on because of its depth, not its syntax.

    msgspec stops with RecursionError at its own nesting limit (about a thousand levels), far beyond
    ``MAX_NESTING``, without reading the rest: such a record nests deeper than the limit whatever follows,
    so it is ``invalid_request`` saying so (it is JSON as far as the parser went, and not garbage a producer
    must see in the dead-letter topic). Only what is certainly not a request stays ``undecodable_event``:
    bytes that are not UTF-8, or a document that is not a JSON object."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        return EventError("undecodable_event", f"the record is not UTF-8 JSON: {exc}", fallback_id)
    opening = text.lstrip()[:1]
    if opening != "{":
        kind = "array" if opening == "[" else "value"
        return EventError("undecodable_event", f"a request is a JSON object, got a deeply nested {kind}", fallback_id)
    request_id = fallback_id
    found = _LEADING_ID.match(value)
    if found:
        try:
            leading = msgspec.json.decode(found.group(1))
        except msgspec.DecodeError:
            leading = None
        if isinstance(leading, str) and leading:
            request_id = leading
    return EventError("invalid_request", _TOO_DEEP, request_id)


def encode(value: msgspec.Struct) -> bytes:
    return _encoder.encode(value)


def decode_answer(value: bytes) -> Answer:
    return msgspec.json.decode(value, type=Answer)


SCHEMAS = {"request": Request, "answer": Answer, "dead-letter": DeadLetter}


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one event type, as checked in under ``schemas/``."""
    schema = msgspec.json.schema(SCHEMAS[name])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://d3stream.invalid/schemas/{name}.schema.json"
    schema["x-d3stream-schema-version"] = SCHEMA_VERSION
    return schema


def write_schemas(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SCHEMAS:
        path = folder / f"{name}.schema.json"
        path.write_text(json.dumps(json_schema(name), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_schemas(Path(__file__).resolve().parents[2] / "schemas"):
        print(path)
