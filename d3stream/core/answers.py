"""Answer events: the answer to a request, the error answer that replaces it, and dead letters.

Every request ends as exactly one answer event keyed by its id: the model's ``answers``, or an ``error`` with
a code and a message saying why there are none. This module builds them, with their provenance (the model
record, the media objects read, the passes the request rode in, per-stage timings, the worker), and makes
sure each fits the topic it goes to: an answer too large even compressed becomes an ``answer_too_large``
error answer under the same id, and a dead letter keeps the raw record only up to ``dead_letter_max_bytes``
(with the size and SHA-256 of all of it), so no record can halt its partition by being refused forever.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import structlog

from d3stream.config import Settings
from d3stream.core.events import (
    HEADERS,
    Answer,
    BatchRecord,
    Cost,
    DeadLetter,
    ErrorInfo,
    MediaRecord,
    ModelRecord,
    Provenance,
    Request,
    Source,
    Timings,
    Worker,
    encode,
)
from d3stream.core.outgoing import Outgoing, RecordFit
from d3stream.core.seams import DEFAULT_SCHEDULING, InputRecord, Position, Scheduling
from d3stream.core.storage import FetchedMedia
from d3stream.ops.metrics import Metrics

log = structlog.get_logger(__name__)

# A dead letter keeps this much of a record's key and of the reason (a decoder's message can quote input).
MAX_KEY_BYTES = 1024
MAX_REASON_CHARS = 2000


def provenance_digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass(slots=True)
class RequestWork:
    """What one request's answer is built from while it walks the stages."""

    record: InputRecord
    source: Source
    received: float
    position: Position = ("", -1, -1)  # where it was read: (topic, partition, offset)
    timings: Timings = field(default_factory=Timings)
    media: list[MediaRecord] = field(default_factory=list)
    batch: BatchRecord = field(default_factory=BatchRecord)
    tokens: int = 0
    media_bytes: int = 0  # held of the in-flight media budget
    questions: int = 0
    request: Request | None = None  # once decoded: even a worker fault is answered under its id
    model: str | None = None  # the served model it was routed to (None: not routed; the default's records)
    extra: list[Outgoing] = field(default_factory=list)  # e.g. a dead letter, published with the answer
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS)  # of the answer and dead letter
    # When each stage started (perf_counter; 0: not reached): with the timings, what spans are built from.
    fetch_at: float = 0.0
    decode_at: float = 0.0
    prepare_at: float = 0.0
    submitted_at: float = 0.0
    publish_at: float = 0.0
    finished: bool = False  # its answer event is built (whatever happens next, it gets no second one)
    # What it cost (provenance ``cost``): who it is counted for and its share of the passes that carried it.
    tenant: str | None = None
    scheduling: Scheduling = DEFAULT_SCHEDULING  # its lane and deadline, once decoded
    device_seconds: float = 0.0
    padded_tokens: int = 0
    quota_tokens: int = 0  # taken of its tenant's quota (tenant_max_inflight_tokens), given back when answered

    def cost(self) -> Cost | None:
        """Its cost record, once the request is decoded (a record that is no request has no tenant)."""
        if self.tenant is None:
            return None
        return Cost(tenant=self.tenant, prompt_tokens=self.tokens, padded_tokens=self.padded_tokens,
                    device_seconds=self.device_seconds, media_bytes=sum(media.bytes for media in self.media))


class AnswerBuilder:
    """Builds a worker's answer events and dead letters, sized to fit their topics."""

    def __init__(self, settings: Settings, *, model_record: ModelRecord, worker: Worker, fit: RecordFit,
                 metrics: Metrics, replay_id: str | None = None):
        self.settings = settings
        self.model_record = model_record
        self.worker = worker
        self.fit = fit  # whether a record fits its topic (the sink's limits)
        self.metrics = metrics
        self.replay_id = replay_id
        self.dead_letters = 0

    def answered(self, work: RequestWork, request: Request, response: dict[str, Any]) -> Answer:
        """The answer event of a request the model answered (``Prepared.answers``' response)."""
        return Answer(
            id=request.id,
            source=work.source,
            model=response["model"],
            answers=response["answers"],
            usage=response["usage"],
            provenance=self._provenance(work),
            metadata=request.metadata,
        )

    def _provenance(self, work: RequestWork) -> Provenance:
        return Provenance(
            model=self.model_record,
            media=work.media,
            batch=work.batch,
            timings=work.timings,
            cost=work.cost(),
            worker=self.worker,
            replay_id=self.replay_id,
        )

    def error(
        self,
        work: RequestWork,
        code: str,
        message: str,
        *,
        request: Request | None = None,
        request_id: str | None = None,
        late_ms: int | None = None,
    ) -> Answer:
        answer_id = (request.id if request else None) or request_id
        if not answer_id:  # no id anywhere: name the request by where it was read
            answer_id = _by_position(work.source)
        log.info("request refused", id=answer_id, code=code, reason=message[:300], offset=work.source.offset)
        return Answer(
            id=answer_id,
            source=work.source,
            model=self.model_record.name,
            error=ErrorInfo(code=code, message=message, late_ms=late_ms),
            provenance=self._provenance(work),
            metadata=request.metadata if request else None,
        )

    def dead_letter(self, work: RequestWork, reason: str) -> Outgoing:
        """The dead letter of a record: the reason, and its raw bytes up to ``dead_letter_max_bytes`` (with
        the size and SHA-256 of all of them). Should even that be refused as too large, its replacement
        keeps the size and hash only."""
        record = work.record
        raw = record.value or b""
        kept = raw[: max(0, self.settings.dead_letter_max_bytes)]
        key = (record.key or b"")[:MAX_KEY_BYTES] or None
        letter = DeadLetter(
            reason=reason[:MAX_REASON_CHARS],
            source=work.source,
            key=key.decode("utf-8", "replace") if key else None,
            value=base64.b64encode(kept).decode(),
            value_bytes=len(raw),
            value_sha256=hashlib.sha256(raw).hexdigest(),
            value_truncated=len(kept) < len(raw),
        )
        self.dead_letters += 1
        self.metrics.count_dead_letter()
        topic = self.settings.dead_letter_topic
        bare = msgspec.structs.replace(letter, value="", value_truncated=bool(raw))
        value = encode(letter)
        headers = work.headers
        if not self.fit(topic, key, value, headers).fits:
            value = encode(bare)
        return Outgoing(topic, key, value, kind="dead_letter", headers=headers,
                        replacement=lambda cause: Outgoing(topic, key, encode(bare), kind="dead_letter",
                                                           headers=headers))

    def fitted(self, work: RequestWork, answer: Answer) -> tuple[Answer, Outgoing]:
        """The answer and its record if it fits the answer topic; else an ``answer_too_large`` error answer
        under the same id (a refusal by the broker later on replaces it the same way)."""
        topic = self.settings.answer_topic
        headers = work.headers
        value = encode(answer)
        key = answer.id.encode()
        fit = self.fit(topic, key, value, headers)
        if fit.fits:
            return answer, Outgoing(topic, key, value, headers=headers, replacement=partial(self._refused, work, answer))
        smaller = self._too_large(work, answer, fit.reason)
        return smaller, Outgoing(topic, smaller.id.encode(), encode(smaller), headers=headers)

    def _refused(self, work: RequestWork, answer: Answer, cause: str) -> Outgoing:
        """What replaces an answer the broker refused as too large (``Outgoing.replacement``)."""
        topic = self.settings.answer_topic
        self.metrics.count_answer("answer_too_large")
        smaller = self._too_large(work, answer, f"the broker refused it for topic {topic!r}: {cause}")
        return Outgoing(topic, smaller.id.encode(), encode(smaller), headers=work.headers)

    def _too_large(self, work: RequestWork, answer: Answer, reason: str) -> Answer:
        """An ``answer_too_large`` error answer for ``answer``: no answers and no echoed metadata; the
        provenance loses its media list and the id its text if even that does not fit."""
        message = (
            f"the answer to this request is too large to publish: {reason}. Ask fewer questions or fewer options "
            "per request, or raise the answer topic's max.message.bytes (and max_request_size)"
        )
        smaller = self.error(work, "answer_too_large", message, request_id=answer.id)
        smaller.answer_id = answer.answer_id
        for shrink in (_without_media, _without_id):
            if self.fit(self.settings.answer_topic, smaller.id.encode(), encode(smaller), work.headers).fits:
                break
            smaller = shrink(smaller, work.source)
        return smaller


def answer_identity(answer: Answer, provenance_sha256: str) -> str:
    """The same request record answered by the same model always gets the same answer id, so a
    duplicate published after a crash (at_least_once) can be recognised and dropped downstream."""
    source = answer.source
    text = f"{source.topic}\x00{source.partition}\x00{source.offset}\x00{answer.id}\x00{provenance_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _without_media(answer: Answer, source: Source) -> Answer:
    media = answer.provenance.media
    assert answer.error is not None  # only error answers are shrunk
    note = f"the provenance lists {len(media)} media objects; left out to fit the message limit"
    return msgspec.structs.replace(
        answer,
        provenance=msgspec.structs.replace(answer.provenance, media=[]),
        error=ErrorInfo(code=answer.error.code, message=f"{answer.error.message} ({note})"),
    )


def _without_id(answer: Answer, source: Source) -> Answer:
    """A request id too long to publish: the answer is named by where the request was read."""
    return msgspec.structs.replace(answer, id=_by_position(source))


def _by_position(source: Source) -> str:
    return f"{source.topic}/{source.partition}/{source.offset}"


def media_record(item: FetchedMedia) -> MediaRecord:
    return MediaRecord(uri=item.uri, etag=item.etag, version=item.version, bytes=len(item.data), sha256=item.sha256)


def ms(seconds: float) -> float:
    """Seconds as milliseconds to the microsecond (cheaper than ``round(..., 3)``, which goes through text)."""
    return math.floor(seconds * 1_000_000.0 + 0.5) / 1000.0
