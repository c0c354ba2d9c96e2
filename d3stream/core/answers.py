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
from collections.abc import Mapping
from functools import partial
from typing import Any

import msgspec
import structlog
from d3stream_client.contract import (
    Answer,
    DeadLetter,
    ErrorInfo,
    MediaRecord,
    ModelRecord,
    Provenance,
    Request,
    Source,
    Worker,
)

from d3stream.core.outgoing import Outgoing, RecordFit, RecordWriter
from d3stream.core.record import Refusal, RequestRecord
from d3stream.core.seams import RecordKind
from d3stream.core.storage import FetchedMedia
from d3stream.ops.metrics import Metrics
from d3stream.settings import DeliverySettings

log = structlog.get_logger(__name__)

# A dead letter keeps this much of a record's key and of the reason (a decoder's message can quote input).
MAX_KEY_BYTES = 1024
MAX_REASON_CHARS = 2000


def dead_letter_event(reason: str, source: Source, key: bytes | None, raw: bytes, max_bytes: int) -> DeadLetter:
    """A record kept with the reason it could not be taken: its raw bytes (base64) up to ``max_bytes``, and the
    size and SHA-256 of all of them, so a truncated one can still be identified."""
    kept = raw[: max(0, max_bytes)]
    return DeadLetter(
        reason=reason[:MAX_REASON_CHARS],
        source=source,
        key=key.decode("utf-8", "replace") if key else None,
        value=base64.b64encode(kept).decode(),
        value_bytes=len(raw),
        value_sha256=hashlib.sha256(raw).hexdigest(),
        value_truncated=len(kept) < len(raw),
    )


def provenance_digest(record: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class AnswerBuilder:
    """Builds a worker's answer events and dead letters, sized to fit their topics."""

    def __init__(self, delivery: DeliverySettings, *, model_record: ModelRecord, worker: Worker, fit: RecordFit,
                 metrics: Metrics, replay_id: str | None = None, write: RecordWriter | None = None):
        self.delivery = delivery
        self.model_record = model_record
        self.worker = worker
        self.fit = fit  # whether a record fits its topic (the sink's limits)
        self.write = write or RecordWriter()  # an event's value and headers (JSON, or the registry's format)
        self.metrics = metrics
        self.replay_id = replay_id
        self.dead_letters = 0

    def answered(self, record: RequestRecord, response: dict[str, Any]) -> Answer:
        """The answer event of a request the model answered (``Prepared.answers``' response)."""
        # The response is the runtime's own untyped dict ({"model", "answers", "usage"}); its values go into the
        # Answer's fields as they are.
        request = record.request
        assert request is not None  # the model answered it: it was decoded
        return Answer(
            id=request.id,
            source=record.source,
            model=response["model"],
            answers=response["answers"],
            usage=response["usage"],
            provenance=self._provenance(record),
            metadata=request.metadata,
        )

    def _provenance(self, record: RequestRecord) -> Provenance:
        return Provenance(
            model=self.model_record,
            media=record.media,
            batch=record.batch,
            timings=record.timings,
            cost=record.cost(),
            worker=self.worker,
            replay_id=self.replay_id,
        )

    def error(
        self,
        record: RequestRecord,
        code: str,
        message: str,
        *,
        request: Request | None = None,
        request_id: str | None = None,
        late_ms: int | None = None,
    ) -> Answer:
        answer_id = (request.id if request else None) or request_id
        if not answer_id:  # no id anywhere: name the request by where it was read
            answer_id = _by_position(record.source)
        log.info("request refused", id=answer_id, code=code, reason=message[:300], offset=record.source.offset)
        return Answer(
            id=answer_id,
            source=record.source,
            model=self.model_record.name,
            error=ErrorInfo(code=code, message=message, late_ms=late_ms),
            provenance=self._provenance(record),
            metadata=request.metadata if request else None,
        )

    def refused(self, record: RequestRecord, refusal: Refusal) -> Answer:
        """The error answer of a request a stage refused."""
        return self.error(record, refusal.code, refusal.message, request=record.request,
                          request_id=refusal.request_id, late_ms=refusal.late_ms)

    def dead_letter(self, record: RequestRecord, reason: str) -> Outgoing:
        """The dead letter of a record: the reason, and its raw bytes up to ``dead_letter_max_bytes`` (with
        the size and SHA-256 of all of them). Should even that be refused as too large, its replacement
        keeps the size and hash only."""
        read = record.input
        raw = read.value or b""
        key = (read.key or b"")[:MAX_KEY_BYTES] or None
        letter = dead_letter_event(reason, record.source, key, raw, self.delivery.dead_letter_max_bytes)
        self.dead_letters += 1
        self.metrics.count_dead_letter()
        topic = self.delivery.dead_letter_topic
        bare = msgspec.structs.replace(letter, value="", value_truncated=bool(raw))
        request_headers = record.headers  # not the record: an outgoing record must not keep its request alive
        value, headers = self.write(topic, letter, request_headers)
        if not self.fit(topic, key, value, headers).fits:
            value, headers = self.write(topic, bare, request_headers)
        return Outgoing(topic, key, value, kind="dead_letter", headers=headers,
                        replacement=lambda cause: self._written(topic, key, bare, request_headers, "dead_letter"))

    def _written(self, topic: str, key: bytes | None, event: Answer | DeadLetter, headers: list[tuple[str, bytes]],
                 kind: RecordKind = "answer") -> Outgoing:
        """The record of an event, written as its topic's records are, with nothing smaller to replace it."""
        value, written_headers = self.write(topic, event, headers)
        return Outgoing(topic, key, value, kind=kind, headers=written_headers)

    def fitted(self, record: RequestRecord, answer: Answer) -> tuple[Answer, Outgoing]:
        """The answer and its record if it fits the answer topic; else an ``answer_too_large`` error answer
        under the same id (a refusal by the broker later on replaces it the same way)."""
        topic = self.delivery.answer_topic
        value, headers = self.write(topic, answer, record.headers)
        key = answer.id.encode()
        fit = self.fit(topic, key, value, headers)
        if fit.fits:
            # The replacement is made from the answer and headers alone: a record kept by its own outgoing
            # record would be a reference cycle, freed only when the cyclic collector happens to run, and with
            # it the request's decoded media and prepared inputs (issue 36).
            return answer, Outgoing(topic, key, value, headers=headers,
                                    replacement=partial(self._refused, answer, record.headers))
        smaller = self._too_large(answer, record.headers, fit.reason)
        return smaller, self._written(topic, smaller.id.encode(), smaller, record.headers)

    def _refused(self, answer: Answer, headers: list[tuple[str, bytes]], cause: str) -> Outgoing:
        """What replaces an answer the broker refused as too large (``Outgoing.replacement``)."""
        topic = self.delivery.answer_topic
        self.metrics.count_answer("answer_too_large")
        smaller = self._too_large(answer, headers, f"the broker refused it for topic {topic!r}: {cause}")
        return self._written(topic, smaller.id.encode(), smaller, headers)

    def _too_large(self, answer: Answer, headers: list[tuple[str, bytes]], reason: str) -> Answer:
        """An ``answer_too_large`` error answer for ``answer``, under its id and with its provenance: no answers
        and no echoed metadata; the provenance loses its media list and the id its text if even that does not
        fit."""
        message = (
            f"the answer to this request is too large to publish: {reason}. Ask fewer questions or fewer options "
            "per request, or raise the answer topic's max.message.bytes (and max_request_size)"
        )
        log.info("request refused", id=answer.id, code="answer_too_large", reason=message[:300],
                 offset=answer.source.offset)
        smaller = Answer(id=answer.id, source=answer.source, model=self.model_record.name,
                         error=ErrorInfo(code="answer_too_large", message=message), provenance=answer.provenance,
                         answer_id=answer.answer_id)
        topic = self.delivery.answer_topic
        for shrink in (_without_media, _without_id):
            if self.fit(topic, smaller.id.encode(), *self.write(topic, smaller, headers)).fits:
                break
            smaller = shrink(smaller, answer.source)
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
