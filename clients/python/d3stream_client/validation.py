"""Request validation that needs no model: what a worker refuses before any fetch, decode or device time.

The worker decodes every request record with :func:`decode_request` and answers a refusal as an error
answer with the :class:`EventError`'s code and message. A producer can run the same checks before it
sends (``Publisher`` does), and gets the very message the worker would have put in the
``invalid_request`` answer. What needs the worker's own state (its media allowlist, its model's prompt
length) is still checked there.
"""

from __future__ import annotations

import json
import re
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
    parsed, duplicate keys, at least one question, then the counts of questions and options.
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
    the schema, at least one question, the request limits, duplicate keys, nesting and the number of media
    references.
    EventError with the worker's own code and message otherwise."""
    value = request if isinstance(request, bytes) else msgspec.json.encode(request)
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
    except msgspec.ValidationError as exc:
        raise EventError("invalid_label", f"the label does not match the schema: {exc}", fallback_id) from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        raise EventError("invalid_label", f"the record is not a UTF-8 JSON object: {exc}", fallback_id) from exc


def validate_label(label: Label | dict[str, Any] | bytes) -> bytes:
    """The record value of a label that matches the schema; EventError (``invalid_label``) otherwise."""
    value = label if isinstance(label, bytes) else msgspec.json.encode(label)
    decode_label(value)
    return value
