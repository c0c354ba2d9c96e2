"""Request validation that needs no model: what a worker refuses before any fetch, decode or device time.

The worker decodes every request record with :func:`decode_request` and answers a refusal as an error
answer with the :class:`EventError`'s code and message. A producer can run the same checks before it
sends (``Publisher`` does), and gets the very message the worker would have put in the
``invalid_request`` answer. What needs the worker's own state (its media allowlist, its model's prompt
length) is still checked there.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from d3stream_client.contract import FIXED_OPTIONS, MEDIA_FIELDS, Label, Request


class EventError(ValueError):
    """A record that is not a valid request; ``code`` is the answer's error code."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


_document_decoder = msgspec.json.Decoder()

# Nesting deeper than this is refused before it reaches the model (JSON bombs of brackets).
MAX_NESTING = 64


@dataclass(frozen=True)
class RequestLimits:
    """Request-level limits checked while decoding, before any fetch, decode or device time.

    Each is the setting of the same name with ``max_request_`` in front (``d3stream.settings.LimitSettings``); None means
    no limit. The defaults keep the answer of any request within them well under Kafka's default 1 MB
    message limit: the answer echoes every option key (and a score's level texts) with a probability
    (~25 bytes each), the question ids and the metadata, so its size is bounded by about the request's
    bytes plus 35 bytes per option.
    """

    bytes: int | None = 262_144
    questions: int | None = 256
    options: int | None = 8_192
    # Checked by the worker after the token estimate, before any fetch (``check_media_references``).
    media_references: int = 32

    @classmethod
    def from_settings(cls, settings: Any) -> RequestLimits:
        """The limits of a worker's settings (``d3stream.settings.Settings``: its ``limits`` and ``media``
        sections)."""
        return cls(
            bytes=settings.limits.max_request_bytes,
            questions=settings.limits.max_request_questions,
            options=settings.limits.max_request_options,
            media_references=settings.media.max_media_references,
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
    kind = question.get("type")
    if isinstance(kind, str) and kind in FIXED_OPTIONS:
        return FIXED_OPTIONS[kind]
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
    if msgspec.json.encode(document).count(b":") == value.count(b":"):
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


class _OutOfRange(float):
    """A JSON number too large for a double (``1e400``): infinite, and kept with its text for the message."""

    text: str


def _parse_float(text: str) -> float:
    number = float(text)
    if math.isfinite(number):
        return number
    out_of_range = _OutOfRange(text)
    out_of_range.text = text
    return out_of_range


def _number_name(number: float) -> str:
    if isinstance(number, _OutOfRange):
        return number.text
    return "NaN" if math.isnan(number) else "Infinity" if number > 0 else "-Infinity"


def _members(value: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> Iterator[tuple[str, Any]]:
    """(the member's name in a path, the member) of an object or an array: ``.key`` or ``[index]``."""
    if isinstance(value, dict):
        return ((f".{str(key)[:80]}", item) for key, item in value.items())
    return ((f"[{index}]", item) for index, item in enumerate(value))


def _non_finite(document: dict[Any, Any]) -> str | None:
    """``NaN at state.x``: the first NaN or infinity of a decoded document (in document order) and where it is;
    None when every number is finite."""
    stack = [_members(document)]  # an iterator per open object or array
    path: list[str] = []  # the names of the members being read
    while stack:
        for name, item in stack[-1]:
            if isinstance(item, float):
                if not math.isfinite(item):
                    return f"{_number_name(item)} at {''.join([*path, name]).removeprefix('.')}"
            elif isinstance(item, (dict, list, tuple)):
                stack.append(_members(item))
                path.append(name)
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def _refuse_non_finite(document: dict[Any, Any], request_id: str | None, code: str = "invalid_request",
                       what: str = "request") -> None:
    """EventError naming where when the document holds NaN or an infinity.

    JSON text has no NaN or Infinity and a double no 1e400, so a record holding one is refused, never read with
    null in its place (what ``msgspec.json.encode`` would write for a float that is not finite)."""
    found = _non_finite(document)
    if found is not None:
        raise EventError(
            code, f"the {what} has {found}: numbers must be finite (NaN and infinities are not JSON, and are not "
            "turned into null)", request_id)


def _check_document(document: dict[str, Any], request_id: str | None) -> None:
    """The checks that read a whole decoded document, in the order every framing answers them: nesting, then
    finite numbers."""
    if not _depth_ok(document):
        raise EventError("invalid_request", TOO_DEEP, request_id)
    _refuse_non_finite(document, request_id)


_NO_QUESTIONS = "the request has no questions: questions must map at least one question ID to a question"


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
    parsed, then the document's checks (those of ``decode_document``, and duplicate keys), the counts of
    questions and options last.
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
    request_id = _request_id(document, fallback_id)
    # Too few brackets to nest too deep: the walk over the document is only needed past the limit. Its numbers need
    # no walk: msgspec reads no NaN, Infinity or 1e400 from JSON text, and _parse refused those naming where.
    if value.count(b"[") + value.count(b"{") > MAX_NESTING and not _depth_ok(document):
        raise EventError("invalid_request", TOO_DEEP, request_id)
    return _request(document, request_id, limits, value)


def decode_document(document: Any, key: bytes | None = None, limits: RequestLimits = DEFAULT_LIMITS) -> Request:
    """``decode_request`` for a request another framing has decoded already (a Python dict, a record of a schema
    registry's format): the same checks with the same answers, those JSON text makes by itself included. It
    nests at most ``MAX_NESTING`` levels, and its numbers are finite (a float or an Avro double can be NaN, JSON
    text cannot). The record's size is its framing's to check (``limits.bytes`` counts JSON bytes)."""
    fallback_id = key.decode("utf-8", "replace") if key else None
    if not isinstance(document, dict):
        raise EventError("undecodable_event", f"a request is an object, got {type(document).__name__}", fallback_id)
    request_id = _request_id(document, fallback_id)
    _check_document(document, request_id)
    return _request(document, request_id, limits)


def _request_id(document: dict[str, Any], fallback_id: str | None) -> str | None:
    """The id an error answer carries: the document's, when it is a nonempty string; else the record's key."""
    identifier = document.get("id")
    return identifier if isinstance(identifier, str) and identifier else fallback_id


def _request(document: dict[str, Any], request_id: str | None, limits: RequestLimits,
             value: bytes | None = None) -> Request:
    """The request of a document within the nesting limit whose numbers are finite: it matches the schema, has no
    key twice (``value``, its JSON text), has a question, and is within the request limits."""
    try:
        request = msgspec.convert(document, Request)
    except msgspec.ValidationError as exc:
        raise EventError("invalid_request", f"the request does not match the schema: {exc}", request_id) from exc
    if value is not None:
        _refuse_duplicate_keys(value, document, request.id)
    if not request.questions:
        raise EventError("invalid_request", _NO_QUESTIONS, request.id)
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
        raise _unreadable(value, fallback_id, exc) from exc
    if not isinstance(document, dict):
        raise EventError(
            "undecodable_event", f"a request is a JSON object, got {type(document).__name__}", fallback_id
        )
    return document


def _lenient(value: bytes) -> Any:
    """JSON text msgspec refused, read again allowing NaN, Infinity and numbers too large for a double (Python's
    ``json.dumps`` writes NaN and Infinity); None unless those numbers are all that kept msgspec from reading it.
    RecursionError when it nests too deep to read."""
    try:
        document = json.loads(value.decode("utf-8"), parse_float=_parse_float)
        msgspec.json.encode(document, enc_hook=float)  # what else msgspec refuses: a lone surrogate (\ud800)
    except (ValueError, TypeError, OverflowError, msgspec.EncodeError):
        return None
    return document


def _unreadable(value: bytes, fallback_id: str | None, exc: msgspec.DecodeError) -> EventError:
    """The error for a record msgspec could not read: ``undecodable_event``, unless it is a JSON object but for a
    number that is not finite (NaN, Infinity, 1e400): a request all the same, refused as ``decode_document``
    refuses that document (``invalid_request`` naming where, after the nesting limit) and not dead-lettered."""
    try:
        document = _lenient(value)
    except RecursionError:
        return _too_deep(value, fallback_id)
    if isinstance(document, dict):
        request_id = _request_id(document, fallback_id)
        try:
            _check_document(document, request_id)
        except EventError as refused:
            return refused
    return EventError("undecodable_event", f"the record is not UTF-8 JSON: {exc}", fallback_id)


TOO_DEEP = f"the request is nested deeper than {MAX_NESTING} levels of JSON arrays and objects"
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
    return EventError("invalid_request", TOO_DEEP, request_id)


def check_media_references(request: Request, limit: int) -> None:
    """EventError when the request names more images and videos than ``limit`` (max_media_references)."""
    references = sum(len(getattr(request, kind.field)) for kind in MEDIA_FIELDS)
    if references > limit:
        raise EventError(
            "invalid_request",
            f"the request names {references:,} images and videos; at most {limit:,} are accepted "
            "(setting: max_media_references)",
            request.id,
        )


def validate_request(request: Request | dict[str, Any] | bytes, limits: RequestLimits = DEFAULT_LIMITS) -> bytes:
    """The record value of a request the worker would accept as far as it can be told without the worker:
    the schema, at least one question, the request limits, duplicate keys, nesting, finite numbers and the number
    of media references. EventError with the worker's own code and message otherwise.

    A request that is not bytes yet is checked before it is encoded: a NaN or an infinity in it is refused
    naming where (JSON has neither, and msgspec would write null in its place)."""
    if isinstance(request, bytes):
        value = request
    else:
        document = msgspec.to_builtins(request) if isinstance(request, Request) else request
        if isinstance(document, dict):
            _check_document(document, _request_id(document, None))
        value = msgspec.json.encode(document)
    decoded = decode_request(value, limits=limits)
    check_media_references(decoded, limits.media_references)
    return value


# A label record is a handful of short values; anything far larger is not one (and is not kept in memory).
MAX_LABEL_BYTES = 65_536
_label_decoder = msgspec.json.Decoder(Label)


def decode_label(value: bytes | None, key: bytes | None = None) -> Label:
    """A label from a record's bytes; EventError with code ``invalid_label`` and the reason otherwise."""
    fallback_id = key.decode("utf-8", "replace") if key else None
    if value is None:
        raise EventError("invalid_label", "the record has no value (a tombstone is not a label)", fallback_id)
    if len(value) > MAX_LABEL_BYTES:
        raise EventError("invalid_label", f"the record is {len(value):,} bytes; a label is at most "
                         f"{MAX_LABEL_BYTES:,}", fallback_id)
    try:
        return _label_decoder.decode(value)
    except (msgspec.DecodeError, RecursionError) as exc:
        _refuse_non_finite_label(value, fallback_id)
        if isinstance(exc, msgspec.ValidationError):
            raise EventError("invalid_label", f"the label does not match the schema: {exc}", fallback_id) from exc
        raise EventError("invalid_label", f"the record is not a UTF-8 JSON object: {exc}", fallback_id) from exc


def _refuse_non_finite_label(value: bytes, fallback_id: str | None) -> None:
    """``invalid_label`` naming where when a label record msgspec refused is JSON but for a NaN, an Infinity or a
    number too large for a double."""
    try:
        document = _lenient(value)
    except RecursionError:
        return
    if isinstance(document, dict):
        _refuse_non_finite(document, fallback_id, "invalid_label", "label")


def validate_label(label: Label | dict[str, Any] | bytes) -> bytes:
    """The record value of a label that matches the schema and whose numbers are finite (one that is not bytes yet
    is checked before it is encoded); EventError (``invalid_label``) otherwise."""
    if isinstance(label, bytes):
        value = label
    else:
        document = msgspec.to_builtins(label) if isinstance(label, Label) else label
        if isinstance(document, dict):
            _refuse_non_finite(document, _request_id(document, None), "invalid_label", "label")
        value = msgspec.json.encode(document)
    decode_label(value)
    return value
