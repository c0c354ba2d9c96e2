"""Shadow evaluation: a second model also answers live requests, and nobody but the operator sees it.

``--shadow NAME=PATH`` (a checkpoint loaded like a ``--model`` value, s3:// included) or ``--shadow NAME`` (a
model the worker serves): every request, or the share ``shadow_share`` of them chosen by a hash of the request
id (``chosen``: the same requests on every worker, restart and replay), is answered by the live model as always
and *also* by the shadow. Why a worker does it rather than a replay afterwards: the shadow sees exactly the
live traffic, media and all, at the moment it arrives, and its answers can be compared with the live ones as
they happen (Prometheus) and afterwards (``d3stream compare kafka:ANSWERS kafka:ANSWERS.shadow``).

What keeps it out of the live path:

* **Its answers go to ``shadow_topic`` only** (default ``<answer_topic>.shadow``): ordinary answer events that
  name the shadow model, with its own provenance record on the provenance topic, published as an extra record
  (kind ``"shadow"``) of the request's record. So with ``exactly_once`` they commit in the same
  transaction as the live answer of the same request, and a crash loses or repeats neither. The JSON-lines
  file sink keeps live answers only.
* **A shadow error never changes the live answer**: whatever fails on the shadow's side (prepare, a pass, an
  answer too large for the shadow topic) becomes the shadow's own error answer on the shadow topic.
* **Scheduling: after the live answer, in the request's own lane.** A request's shadow rows are prepared and
  submitted only once its live answer is computed, so live rows never queue behind shadow rows of the same
  request. They then ride the request's own priority lane (with no deadline), not the lowest one: the live
  answer of a shadowed request is published with its shadow answer (one transaction, below), so a shadow
  that waited behind all newer live traffic would hold that live answer back just as long (in the lowest
  lane, up to three ageing steps on a saturated worker: docs/SCHEDULING.md). What the live stream pays is the
  shadow passes' own device time (one model thread: a live pass waits for a shadow pass that is running)
  and, for the shadowed requests, the time to their shadow's pass (docs/MODELS.md, "Shadow evaluation",
  measures it).

Live comparison (``Metrics.count_shadow_*``): per (live model, shadow model, question type) the compared
questions, how many agree on the top choice, the sum and maximum of |dp| over their options, and the
shadow's answered / errored counts, measured with ``agreement.join_slots``, so the figures are the ones
``d3stream compare`` gives for the same answers.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from functools import partial

import msgspec
import structlog
from d3stream_client.contract import Answer

from d3stream.core.agreement import join_slots, parse_slot
from d3stream.core.answers import AnswerBuilder, answer_identity
from d3stream.core.jobthread import JobThread
from d3stream.core.outgoing import Outgoing
from d3stream.core.passes import PrepareOutcome
from d3stream.core.record import RequestRecord, Stage
from d3stream.core.routing import Hosted
from d3stream.core.seams import Scheduling
from d3stream.ops.metrics import Metrics
from d3stream.runtime.media import reason
from d3stream.settings import BatchingSettings, DeliverySettings, ModelSettings

log = structlog.get_logger(__name__)

# Salt of the share's hash, so the shadow's choice is independent of any other hash of request ids.
SHARE_SALT = b"d3stream-shadow\x00"


def shadow_topic(models: ModelSettings, delivery: DeliverySettings) -> str:
    """Where shadow answers go: ``shadow_topic``, else the answer topic's name + ``.shadow``."""
    return models.shadow_topic or f"{delivery.answer_topic}.shadow"


def chosen(request_id: str, share: float) -> bool:
    """Whether the shadow also answers this request: the first 64 bits of SHA-256(salt + id) below ``share``
    of their range. A function of the id only: every worker, restart and replay picks the same requests."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    digest = hashlib.sha256(SHARE_SALT + request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < share * 2.0**64


class Shadow:
    """The shadow of one worker: its model's passes, an answer builder for the shadow topic, the share."""

    def __init__(self, models: ModelSettings, batching: BatchingSettings, delivery: DeliverySettings,
                 hosted: Hosted, *, prepare_thread: JobThread, metrics: Metrics):
        self.hosted = hosted
        self.name: str = hosted.name
        self.topic = shadow_topic(models, delivery)
        self.share = models.shadow_share
        self.lanes = batching.priority_lanes
        self.prepare_thread = prepare_thread
        self.metrics = metrics
        live: AnswerBuilder = hosted.answers
        # Its answers are fitted to the shadow topic's message limit, and name the shadow model.
        self.answers = AnswerBuilder(msgspec.structs.replace(delivery, answer_topic=self.topic),
                                     model_record=live.model_record, worker=live.worker, fit=live.fit,
                                     metrics=metrics, replay_id=live.replay_id, write=live.write)

    def follows(self, live: str, record: RequestRecord) -> bool:
        """Whether the shadow will also answer this request of the ``live`` model, should that answer it
        (so its decoded media must wait for the shadow's prepare)."""
        request = record.request
        return live != self.name and request is not None and chosen(request.id, self.share)

    def split(self, answered: list[RequestRecord]) -> tuple[list[RequestRecord], list[RequestRecord]]:
        """Which answered requests go on now, and which the shadow answers first (``answer``): the chosen
        ones the live model answered. A refusal or a live error goes on at once: the shadow compares answers."""
        now: list[RequestRecord] = []
        later: list[RequestRecord] = []
        for record in answered:
            if record.stage is not Stage.ANSWERED:  # refused, or shadowed already
                now.append(record)
                continue
            request, answer = record.request, record.answer
            assert request is not None and answer is not None  # ANSWERED: decoded, and its answer built
            (later if answer.error is None and chosen(request.id, self.share) else now).append(record)
        return now, later

    async def answer(self, live: str, pending: list[RequestRecord]) -> AsyncIterator[list[RequestRecord]]:
        """Answer ``pending`` (requests ``live`` answered) with the shadow: each is yielded once its shadow
        record is among its records. Never raises: a failure is a shadow error answer."""
        own = [self._own(record) for record in pending]
        try:
            lanes = [self._lane(record) for record in pending]
            prepared = await self.prepare_thread.run(partial(self._prepare_all, pending), priority=min(lanes))
            for record in (*pending, *own):
                record.drop_decoded()  # the shadow was the last to need them
            passing: list[RequestRecord] = []
            index_of: dict[int, int] = {}
            ready: list[RequestRecord] = []
            for index, outcome in enumerate(prepared):
                if isinstance(outcome, BaseException):
                    code = "invalid_request" if isinstance(outcome, ValueError) else "internal_error"
                    self._attach(live, pending[index], own[index],
                                 self.answers.error(own[index], code, reason(outcome), request=own[index].request))
                    ready.append(pending[index])
                    continue
                record = own[index]
                record.prepared, record.plan = outcome
                record.tokens = record.prepared.input_tokens
                record.advance(Stage.PREPARED)
                record.scheduling = Scheduling(lane=lanes[index], deadline=None)  # never late
                index_of[id(record)] = index
                passing.append(record)
            if ready:
                yield ready
            async for done in self.hosted.passes.run(passing):
                finished = []
                for record in done:
                    index = index_of[id(record)]
                    self._attach(live, pending[index], record, self._answered(record))
                    finished.append(pending[index])
                yield finished
        except Exception as exc:  # noqa: BLE001 - a shadow fault is the shadow's error answer, never the live one's
            for record in (*pending, *own):
                record.drop_decoded()
            # Those still waiting for their shadow answer: one yielded before may be delivered by now (DELIVERED).
            left = [index for index, record in enumerate(pending) if record.stage is Stage.ANSWERED]
            log.exception("shadow answers failed", shadow=self.name, requests=len(left))
            for index in left:
                self._attach(live, pending[index], own[index],
                             self.answers.error(own[index], "internal_error", reason(exc), request=own[index].request))
            yield [pending[index] for index in left]

    # ------------------------------------------------------------------------------------ steps

    def _lane(self, record: RequestRecord) -> int:
        """The request's priority lane (``priority_lanes=false``: the middle one, as for its live rows)."""
        return record.scheduling.lane if self.lanes else 1

    def _own(self, live: RequestRecord) -> RequestRecord:
        """The shadow answer's own record of the request (its passes, timings, cost), read where the live one was:
        decoded and routed (to the shadow) already, so it starts ROUTED."""
        return RequestRecord(input=live.input, source=live.source, received=time.perf_counter(), headers=live.headers,
                             stage=Stage.ROUTED, request=live.request, model=self.name, tenant=live.tenant,
                             media=live.media, decoded=live.decoded)

    def _prepare_all(self, pending: list[RequestRecord]) -> list[PrepareOutcome]:
        """On the prepare thread (in its requests' lane): each request prepared for the shadow model, or what went wrong."""
        outcomes: list[PrepareOutcome] = []
        for record in pending:
            request = record.request
            assert request is not None  # the live model answered it
            images, videos = record.decoded if record.decoded is not None else ([], [])
            try:
                prepared = self.hosted.model.prepare(request.state, request.questions, decoded_images=images,
                                                     decoded_videos=videos,
                                                     permutation_average=request.permutation_average)
                outcomes.append((prepared, self.hosted.passes.plan(prepared)))
            except Exception as exc:  # noqa: BLE001 - that request's own shadow error
                outcomes.append(exc)
        return outcomes

    def _answered(self, record: RequestRecord) -> Answer:
        try:
            if record.expired is not None:
                raise RuntimeError("the shadow's rows were dropped at a deadline")
            assert record.prepared is not None  # it rode the shadow's passes
            return self.answers.answered(record, record.prepared.answers(record.probabilities))
        except Exception as exc:  # noqa: BLE001 - the shadow's own error answer
            log.exception("shadow answer not built", offset=record.source.offset)
            return self.answers.error(record, "internal_error", reason(exc), request=record.request)

    def _attach(self, live: str, record: RequestRecord, own: RequestRecord, answer: Answer) -> None:
        """The shadow answer as the last record of the live request (one transaction), and measured."""
        answer.answer_id = answer_identity(answer, self.hosted.provenance_sha256)
        answer, outgoing = self.answers.fitted(own, answer)
        own.drop_prepared()
        record.records.append(as_shadow(outgoing))
        record.advance(Stage.SHADOWED)
        assert record.answer is not None  # the live answer is there: it is what the shadow follows
        self.observe(live, record.answer, answer)

    def observe(self, live_name: str, live: Answer, shadow: Answer) -> None:
        """The live comparison metrics of one request (``d3stream compare``'s decision and |dp|)."""
        metrics = self.metrics
        metrics.count_shadow_request(live_name, self.name, errored=shadow.error is not None)
        live_answers = msgspec.to_builtins(live.answers or {})
        shadow_answers = msgspec.to_builtins(shadow.answers or {})
        for question_id, raw in live_answers.items():
            slot = parse_slot(raw)
            if slot is None:  # the live model did not answer it: nothing to compare
                continue
            other = parse_slot(shadow_answers.get(question_id))
            if other is None or other.type != slot.type:
                metrics.count_shadow_question(live_name, self.name, slot.type, agree=None)
                continue
            joined = join_slots(live.id, question_id, slot, other)
            metrics.count_shadow_question(live_name, self.name, slot.type, agree=joined.agree,
                                          abs_dps=joined.deltas.values())


def as_shadow(record: Outgoing) -> Outgoing:
    """``record`` (an answer to the shadow topic) as a shadow record, its too-large replacement one too."""
    replacement = record.replacement
    record.kind = "shadow"
    if replacement is not None:
        record.replacement = lambda cause: as_shadow(replacement(cause))
    return record
