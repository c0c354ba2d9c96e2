"""The event contract: the request, answer, dead-letter, label and evaluation records, defined once.

Producers publish a ``Request`` as UTF-8 JSON to the request topic, keyed by its ``id``. The worker
publishes exactly one ``Answer`` per request record to the answer topic, with the same key: either the
model's ``answers`` or an ``error`` saying why there are none. Bytes that are not a JSON object at all also
go to the dead-letter topic as a ``DeadLetter`` with the reason.

The truth about a request, when someone learns it later, is a ``Label`` on the label topic, keyed by the
same id (so a label lands on the partition of its answer). ``d3stream evaluate`` joins labels with answers
and publishes one ``Evaluation`` per joined request and model.

These msgspec Structs are the one definition of the contract. The worker (the ``d3stream`` package) decodes
and encodes with them, this client does too, and ``schemas/*.schema.json`` are generated from them
(``d3stream_client.schemas``), so a producer in any language and this package cannot drift apart.

The vocabulary of the contract (question types, media kinds, error codes, priorities) is named here too.
What each question type means to the model lives with the model; the worker's tests check that both name
the same types and kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import msgspec

SCHEMA_VERSION = "2"  # 2: deadline, ttl_ms, priority, tenant; provenance.cost (requests of 1 stay valid)
CONTENT_TYPE = "application/json"
# Every request and answer record carries these headers, so a reader can tell the contract's version.
HEADERS: list[tuple[str, bytes]] = [("content-type", CONTENT_TYPE.encode()), ("d3stream-schema", SCHEMA_VERSION.encode())]

# Request-level error codes an answer event can carry (question-level errors live inside ``answers``).
ERROR_CODES = (
    "undecodable_event",  # not UTF-8 JSON at all (also dead-lettered)
    "schema_not_found",  # framed for a Schema Registry that has no schema of its id (also dead-lettered)
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

# The three question types, in the order reports and schemas list them.
QUESTION_TYPE_NAMES: tuple[str, ...] = ("choice", "noul", "score")
# Options a question of the type has whatever its criteria say (a noul is always false / true).
FIXED_OPTIONS: dict[str, int] = {"noul": 2}


@dataclass(frozen=True)
class MediaField:
    """One kind of media a request may show every question: its name and the request field listing it."""

    name: str  # "image": also the media type of its data: URLs
    field: str  # "images"


MEDIA_FIELDS: tuple[MediaField, ...] = (MediaField("image", "images"), MediaField("video", "videos"))

# Priority lanes, highest first (the scheduler's lane index is the position here).
Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)


def spoken_list(names: tuple[str, ...] | list[str]) -> str:
    """``choice, noul or score``: names as an error message or a description lists them."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


MediaReference = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        description="s3://bucket/key (optionally ?versionId=...) or an inline "
        + spoken_list([f"data:{kind.name}/..." for kind in MEDIA_FIELDS]) + " URL",
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


# A label's value for one question: a choice's option key, a noul's true or false, a score's level index
# (or its level text, as the answer's legend shows it).
LabelValue = str | bool | int


class Label(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a request's answers should have been, known later (a closed ticket, an issued refund)."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=512,
                                    description="the request's id; also the Kafka key (the answer's key)")]
    labels: Annotated[dict[str, LabelValue], msgspec.Meta(
        min_length=1,
        description="question id -> the true answer: a choice's option key, a noul's true or false, a score's "
                    "level index (an integer) or level text (a string, even a digit)")]
    labeled_at: Annotated[int, msgspec.Meta(
        ge=0, description="epoch milliseconds when the truth was known (default: the record's timestamp)")] | None = None
    source: Annotated[str, msgspec.Meta(max_length=256, description="who or what labelled it (agent, refund-system)")
                      ] | None = None
    metadata: Any = None


Role = Literal["live", "shadow"]
ROLES: tuple[Role, ...] = get_args(Role)


class LabelledQuestion(msgspec.Struct, kw_only=True):
    """One question of an answer, scored against its label."""

    type: str
    label: LabelValue  # as the label event gave it
    label_option: Annotated[str, msgspec.Meta(description="the option key the label names")]
    predicted: Annotated[str, msgspec.Meta(description="the answer's decision (an option key)")]
    p_label: Annotated[float, msgspec.Meta(description="the probability the answer gave the labelled option")]
    confidence: Annotated[float, msgspec.Meta(description="the probability of the predicted option")]
    correct: bool
    brier: Annotated[float, msgspec.Meta(description="sum over the options of (p - onehot(label))^2")]
    log_loss: Annotated[float, msgspec.Meta(description="-ln p_label (p_label clipped at 1e-15)")]
    expected_brier: Annotated[float, msgspec.Meta(
        description="1 - sum of p^2: the Brier term the answer expected of itself if calibrated (its expected "
                    "accuracy is confidence)")] | None = None


class Evaluation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One model's answer to one request joined with the request's label (``d3stream evaluate``)."""

    id: str
    model: Annotated[str, msgspec.Meta(description="the model that answered (the answer's model)")]
    role: Annotated[Role, msgspec.Meta(description="live: from the answer topic; shadow: from the shadow topic")]
    answer_id: str = ""
    answer: Annotated[Source, msgspec.Meta(description="where the answer record was read")]
    label: Annotated[Source, msgspec.Meta(description="where the label record was read")]
    labeled_by: str | None = None
    labeled_at: int | None = None
    lag_ms: Annotated[int, msgspec.Meta(
        description="the label record's timestamp minus the answer record's (negative: the label came first)")] = 0
    questions: dict[str, LabelledQuestion]


_encoder = msgspec.json.Encoder()
_answer_decoder = msgspec.json.Decoder(Answer)
_dead_letter_decoder = msgspec.json.Decoder(DeadLetter)
_evaluation_decoder = msgspec.json.Decoder(Evaluation)


def encode(value: msgspec.Struct) -> bytes:
    """The JSON bytes of one event, as they travel in a record's value."""
    return _encoder.encode(value)


def decode_answer(value: bytes) -> Answer:
    """The typed answer of an answer record's value (msgspec.ValidationError when it is not one)."""
    return _answer_decoder.decode(value)


def decode_evaluation(value: bytes) -> Evaluation:
    """The typed evaluation of an evaluation record's value."""
    return _evaluation_decoder.decode(value)


def decode_dead_letter(value: bytes) -> DeadLetter:
    """The typed dead letter of a dead-letter record's value."""
    return _dead_letter_decoder.decode(value)
