"""The request pipeline: the records of one fetch in, one answer event per record out. No Kafka in it.

``RequestPipeline.answer`` takes any list of records (``seams.InputRecord``: topic, partition, offset, key,
value, headers), makes each one ``record.RequestRecord`` (the one object a request travels in) and walks
them through the stages:

1. **event** (``_admit``): bytes -> ``Request`` (``d3stream_client.validation.decode_request``, under the
   request limits), or a refusal (``undecodable_event``, also dead-lettered; ``invalid_request``); then its
   tenant and scheduling (lane, deadline: docs/SCHEDULING.md), ``deadline_exceeded`` when its deadline has
   passed already, and its model (``model_not_served`` when the worker does not serve the one it names);
2. **media** (requests that name images or videos, each a step of its own): refused with ``invalid_request``
   if certainly over ``max_request_tokens`` before anything is fetched, then fetched from the object store
   and decoded strictly off the prepare thread (``media_stage.py`` over ``storage.py`` and ``decoding.py``),
   under the media budgets;
3. **prepare**: validated, rendered and tokenized by the model, and planned for shared-prefix reuse, on the
   prepare thread, in trips of ``PREPARE_CHUNK`` requests of one lane, higher lanes first; decoded media are
   let go once a request is prepared (unless the shadow prepares from them too);
4. **quotas**: a request whose tenant is over ``tenant_max_inflight_tokens`` is held until the tenant's
   answered requests give tokens back (``quotas.py``, through the ledger); the others do not wait for it;
5. **passes**: rows of many requests packed into forward passes (``passes.py``); a request whose deadline
   passes before its rows ride is answered ``deadline_exceeded``;
6. **answer**: probabilities -> answer objects -> the answer event with its provenance and deterministic
   ``answer_id``, sized to fit its topic (``answers.py``); what the request held in flight is given back to
   the ``InFlightLedger``.

A worker may serve several models (``routing.Hosted``: each with its own passes, answer builder and
provenance digest); ``routing.Router`` routes each request at admission (its ``model`` field, else the
canary share, else the default: routing.py says why) and the pipeline uses only that model's parts from then
on; a name not served is ``model_not_served``, and records refused before routing are answered with the
default model's records. The models served can change while it runs (``Router.add``, ``retire``, ``drop``: a
swap without a stop, rollout.py): a retired model takes no new requests but answers those already routed
to it.
With a shadow model (``shadow.py``) a share of the answered requests is also answered by it, after the
live answer; each is delivered with its shadow answer as one more record.

The fetch is processed as a batch where that saves work (its text-only requests of one priority lane share
prepare trips and one submission to the scheduler; lanes apart, so a high one does not wait for a flood's), while failures stay per request: whatever goes wrong with one record ends
as that record's error answer, never as its neighbours'. A stage that ends a request returns a
``Refusal``, and the pipeline answers it in one place (``_refused``). Each record's ``stage``
(``record.Stage``: read, decoded, routed, media, prepared, scored, answered or refused, shadowed,
delivered) is moved by the stage that did the work, and a step out of order raises. The answered requests
are yielded as they are ready (all text-only answers of a pass together, a media request's on its own):
each step is an async generator, and ``streams.Streams`` reads the steps of a fetch side by side.

Whatever raises out of ``answer`` anyway is its caller's to answer (the guard of service/fetch_handler.py
answers the records not handed on again one at a time, and one that still fails as a ``SkippedRecord``:
``internal_error``, dead-lettered); what the records of the failed call held in flight goes back first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from functools import partial

import structlog
from d3stream_client.contract import HEADERS, PRIORITIES, Answer, Request, Source
from d3stream_client.validation import EventError, RequestLimits, decode_request

from d3stream.core.answers import answer_identity, ms
from d3stream.core.decoding import MediaDecoder
from d3stream.core.inflight import InFlightLedger
from d3stream.core.jobthread import JobThread
from d3stream.core.media_stage import MediaStage
from d3stream.core.passes import PrepareOutcome
from d3stream.core.record import Refusal, RequestRecord, Stage
from d3stream.core.routing import Hosted, Router
from d3stream.core.seams import DeadlineExceeded, InputRecord, Scheduling
from d3stream.core.shadow import Shadow
from d3stream.core.storage import MediaFetcher
from d3stream.core.streams import Streams
from d3stream.ops.metrics import Metrics
from d3stream.ops.tracing import forwarded_headers, header_names
from d3stream.runtime.cpu_threads import use_intraop_threads
from d3stream.runtime.media import reason
from d3stream.settings import (
    BatchingSettings,
    DeliverySettings,
    MediaSettings,
    ModelSettings,
    ObservabilitySettings,
)

log = structlog.get_logger(__name__)


# Requests prepared per trip to the prepare thread: few trips per fetch, and an urgent request waits for at
# most one trip of a flood's backlog (jobs of a higher priority lane go first: jobthread.py).
PREPARE_CHUNK = 16


# A step's answered requests, as they are ready. Not kafka/commits.py's Answered, which is one read record's
# answers as the commit policy is handed them.
AnswersReady = AsyncIterator[list[RequestRecord]]


class RequestPipeline:
    """Records -> answer events, for the models of one worker (see the module's docstring)."""

    def __init__(self, batching: BatchingSettings, media: MediaSettings, observability: ObservabilitySettings,
                 models: ModelSettings, delivery: DeliverySettings, hosted: Sequence[Hosted], *,
                 request_limits: RequestLimits, fetcher: MediaFetcher, decoder: MediaDecoder,
                 ledger: InFlightLedger, metrics: Metrics, shadow: Hosted | None = None):
        # The sections it reads: lanes, tenants and deadlines (batching) and the forwarded headers
        # (observability); media goes to the media stage, and models and delivery only make the shadow (its
        # topic, share and answers: shadow.py).
        self.batching = batching
        self.observability = observability
        # What in-flight requests hold (their models' counts, tokens, quotas, media budget), taken and given
        # back through this one owner; a retired model is dropped when its count reaches zero.
        self.ledger = ledger
        # The models served and which one each request goes to (routing.py); a rollout adds, retires and drops
        # models and sets its canary there.
        self.router = Router(hosted, routed=ledger.routed)
        self.media = MediaStage(media, fetcher=fetcher, decoder=decoder, ledger=ledger, metrics=metrics)
        self.metrics = metrics
        # The decode-time limits (the limits and media sections: ``RequestLimits.from_settings``).
        self.request_limits = request_limits
        # Request headers the answers carry: the trace headers, then forward_headers.
        self._forwarded_names = header_names(observability.forward_headers)
        # Prompt preparation and prefix planning: one thread, woken once for many requests. On a CPU its torch
        # ops (the image processor) run inline, leaving the intra-op threads to the model thread (cpu_threads.py).
        on_cpu = str(self.router.default.model.device).startswith("cpu")
        self.prepare_thread = JobThread("d3stream-prepare",
                                        initializer=partial(use_intraop_threads, 1) if on_cpu else None)
        # A model that also answers a share of the requests, to a topic of its own (shadow.py).
        self.shadow = (Shadow(models, batching, delivery, shadow, prepare_thread=self.prepare_thread,
                              metrics=metrics) if shadow else None)

    def close(self) -> None:
        self.prepare_thread.shutdown()

    @property
    def every_model(self) -> list[Hosted]:
        """Every model this pipeline answers with: the router's, and a shadow checkpoint of its own (a served
        model that shadows is one of the router's already)."""
        every = self.router.every
        own = self.shadow.hosted if self.shadow is not None else None
        return [*every, own] if own is not None and all(own is not each for each in every) else every

    async def answer(self, inputs: Sequence[InputRecord]) -> AnswersReady:
        """Answer every record: yields lists of answered requests as they are ready, each request once. Should
        anything raise out of it anyway, what its records not handed on yet hold goes back before it raises
        (``_given_up``): its caller answers them again (service/fetch_handler.py)."""
        records = [self._begin(each) for each in inputs]
        handed: set[int] = set()  # id() of the records yielded
        try:
            async for answered in self._answer_begun(records):
                handed.update(map(id, answered))
                yield answered
        except Exception:
            self._given_up([record for record in records if id(record) not in handed])
            raise

    def _given_up(self, records: list[RequestRecord]) -> None:
        """What the records of a failed ``answer`` call that were not handed on hold goes back, since its caller
        answers them again as new records (service/fetch_handler.py's guard): an unfinished one's tokens, quota,
        media and model count, and everyone's questions; their places among the requests read stay taken, for the
        records that answer them. Leaked, they would hold backpressure (or a retired model) for the worker's lifetime."""
        for record in records:
            if not record.stage.finished:  # a finished one gave back what its answer frees when it was built
                self.ledger.answered(record)
                for each in self.router.hosted.values():
                    each.passes.rows.finished(record.position)
        self.ledger.delivered(records)
        self.ledger.read(len(records))

    async def _answer_begun(self, records: list[RequestRecord]) -> AnswersReady:
        positions = [record.position for record in records]
        for each in self.router.hosted.values():
            each.passes.rows.expect(positions)
        refused: list[RequestRecord] = []
        # Text-only requests by model and lane: a lane's requests are prepared and submitted without waiting for
        # a lower lane's (a high request read with a flood does not wait for the whole fetch to be prepared).
        text: dict[tuple[str, int], list[RequestRecord]] = {}
        with_media: list[RequestRecord] = []
        for record in records:
            request = self._admit(record)
            if isinstance(request, Refusal):
                refused.append(self._refused(record, request))
            elif request.images or request.videos:
                with_media.append(record)
            else:
                lane = record.scheduling.lane if self.batching.priority_lanes else 1
                text.setdefault((self.router.of(record).name, lane), []).append(record)
        steps: Streams[list[RequestRecord]] = Streams()
        # A few prepare trips and one submission per model and lane, the higher lanes' started first: their jobs
        # reach the prepare thread before a flood's.
        for (name, _), group in sorted(text.items(), key=lambda each: each[0][1]):
            steps.add(self._isolated(group, self._answer_all(self.router.hosted[name], group)))
        for record in with_media:
            steps.add(self._isolated([record], self._answer_with_media(record)))
        if refused:
            yield refused
        async for answered in steps:
            yield answered

    async def _isolated(self, records: list[RequestRecord], step: AnswersReady) -> AnswersReady:
        """The answers of ``step``; a fault of this worker still gets each of its requests not yet answered an
        answer."""
        try:
            async for answered in step:
                yield answered
        except Exception as exc:  # noqa: BLE001 - a worker fault still gets its request an answer
            log.exception("request failed", offsets=[record.source.offset for record in records][:20])
            failed = Refusal("internal_error", reason(exc))
            yield [self._refused(record, failed) for record in records if not record.stage.finished]

    # ------------------------------------------------------------------------------------ stages

    def _begin(self, read: InputRecord) -> RequestRecord:
        record = RequestRecord(read, Source(topic=read.topic, partition=read.partition, offset=read.offset,
                                            timestamp=read.timestamp), time.perf_counter())
        if read.headers:
            forwarded = forwarded_headers(read.headers, self._forwarded_names,
                                          self.observability.forward_headers_max_bytes)
            if forwarded:
                record.headers = [*HEADERS, *forwarded]
        return record

    def _admit(self, record: RequestRecord) -> Request | Refusal:
        """The request decoded and routed (``record.request``, ``record.model``), or the refusal that ends it."""
        read = record.input
        try:
            # A framing layer (kafka/registry.py) hands on the refusal of a record it could not read.
            unreadable = getattr(read, "unreadable", None)
            if isinstance(unreadable, EventError):
                raise unreadable
            request = decode_request(read.value, read.key, self.request_limits)
        except EventError as exc:
            # A record the worker skipped, or one framed with a refused schema, is dead-lettered whatever its code.
            if exc.code in DEAD_LETTERED or getattr(read, "dead_letter", False):
                record.records.append(self.router.default.answers.dead_letter(record, str(exc)))
            return Refusal(exc.code, str(exc), request_id=exc.request_id)
        record.request = request
        record.tenant = request_tenant(self.batching, read, request)
        scheduling = record.scheduling = request_scheduling(self.batching, read, request)
        record.advance(Stage.DECODED)
        if scheduling.deadline is not None and time.time() > scheduling.deadline:
            return _expired(DeadlineExceeded(time.time() - scheduling.deadline), "was read")
        hosted = self.router.route(request)
        if isinstance(hosted, Refusal):
            return hosted
        self.ledger.route(record, hosted.name)
        record.advance(Stage.ROUTED)
        return request

    async def _answer_with_media(self, record: RequestRecord) -> AnswersReady:
        """A request naming images or videos: refused early if certainly too long, its media fetched and
        decoded, then prepared and answered like the text-only ones."""
        hosted = self.router.of(record)
        refusal = await self._over_token_limit(hosted, record) or await self.media.load(hosted.model, record)
        if refusal is not None:
            yield [self._refused(record, refusal)]
            return
        async for answered in self._answer_all(hosted, [record]):
            yield answered

    async def _over_token_limit(self, hosted: Hosted, record: RequestRecord) -> Refusal | None:
        """Refuse a request certainly over max_request_tokens before fetching its media."""
        model, request = hosted.model, record.request
        assert request is not None  # admitted: decoded
        if not model.request_may_exceed_tokens(len(record.input.value or b""), len(request.questions)):
            return None
        try:
            await self.prepare_thread.run(lambda: model.check_request_tokens(
                request.state, request.questions, permutation_average=request.permutation_average))
        except ValueError as exc:
            return Refusal("invalid_request", str(exc))
        return None

    async def _answer_all(self, hosted: Hosted, records: list[RequestRecord]) -> AnswersReady:
        """Prepare every request (all routed to ``hosted``) on the prepare thread, a few trips for a whole fetch,
        run their rows together on that model's passes, answer them. With a shadow, the chosen requests are
        answered by it too and handed on with their shadow answers."""
        shadow = self.shadow
        if shadow is None or shadow.name == hosted.name:
            async for answered in self._answer_prepared(hosted, records):
                yield answered
            return
        steps: Streams[list[RequestRecord]] = Streams()
        steps.add(self._answer_prepared(hosted, records))
        async for answered in steps:
            now, later = shadow.split(answered)
            if later:  # its own step: the live answers of later passes are not held up behind this shadow work
                steps.add(shadow.answer(hosted.name, later))
            if now:
                yield now

    async def _answer_prepared(self, hosted: Hosted, records: list[RequestRecord]) -> AnswersReady:
        started = time.perf_counter()
        outcomes = await self._prepare_all(hosted, records)
        seconds = time.perf_counter() - started
        refused: list[RequestRecord] = []
        passing: list[RequestRecord] = []
        self.metrics.observe_stage("prepare", seconds, len(records))  # the trips of the fetch took this long together
        prepare_ms = ms(seconds)
        for record, outcome in zip(records, outcomes, strict=True):
            record.prepare_at, record.timings.prepare = started, prepare_ms
            if self.shadow is not None and self.shadow.follows(hosted.name, record):
                record.media_kept = record.media_bytes  # the shadow prepares from them too: all of it stays held
            else:
                record.drop_decoded()
            if isinstance(outcome, BaseException):
                code = "invalid_request" if isinstance(outcome, ValueError) else "internal_error"
                refused.append(self._refused(record, Refusal(code, reason(outcome))))
                continue
            prepared, record.plan = outcome
            record.prepared = prepared
            record.tokens = prepared.input_tokens
            record.advance(Stage.PREPARED)
            passing.append(record)
        self.ledger.prepared(passing)
        if refused:
            yield refused
        async for answered in self._run_within_quotas(hosted, passing):
            yield answered

    async def _run_within_quotas(self, hosted: Hosted, passing: list[RequestRecord]) -> AnswersReady:
        """Run the requests' rows; a request whose tenant is over ``tenant_max_inflight_tokens`` is held
        first, until its tenant's answered requests make room (quotas.py; the others do not wait for it)."""
        if not self.ledger.quotas.enabled:
            if passing:
                async for answered in self._run(hosted, passing):
                    yield answered
            return
        ready: list[RequestRecord] = []
        held: list[RequestRecord] = []
        for record in passing:
            (ready if self.ledger.try_quota(record) else held).append(record)
        steps: Streams[list[RequestRecord]] = Streams()
        if ready:
            steps.add(self._run(hosted, ready))
        for record in held:
            steps.add(self._isolated([record], self._held(hosted, record)))
        async for answered in steps:
            yield answered

    async def _held(self, hosted: Hosted, record: RequestRecord) -> AnswersReady:
        await self.ledger.wait_for_quota(record)
        async for answered in self._run(hosted, [record]):
            yield answered

    async def _run(self, hosted: Hosted, passing: list[RequestRecord]) -> AnswersReady:
        async for done in hosted.passes.run(passing):
            yield [self._answered(hosted, record) for record in done]

    async def _prepare_all(self, hosted: Hosted,
                           records: list[RequestRecord]) -> list[PrepareOutcome]:
        """Each request prepared (or what went wrong), in trips of ``PREPARE_CHUNK`` requests of one priority
        lane: a high-priority request's trip goes before a flood's backlog waiting on the prepare thread."""
        lanes = [record.scheduling.lane if self.batching.priority_lanes else 1 for record in records]
        order = sorted(range(len(records)), key=lanes.__getitem__)
        chunks = [order[at:at + PREPARE_CHUNK] for at in range(0, len(order), PREPARE_CHUNK)]

        def trip(chunk: list[int]) -> list[PrepareOutcome]:
            return [self._prepare(hosted, records[index]) for index in chunk]

        results = await asyncio.gather(*(self.prepare_thread.run(partial(trip, chunk), priority=lanes[chunk[0]])
                                         for chunk in chunks))
        if order == list(range(len(order))):  # one lane (a fetch's text requests are grouped by lane): in order
            return [outcome for prepared in results for outcome in prepared]
        outcomes: list[PrepareOutcome] = [RuntimeError("not prepared")] * len(records)
        for chunk, prepared in zip(chunks, results, strict=True):
            for index, outcome in zip(chunk, prepared, strict=True):
                outcomes[index] = outcome
        return outcomes

    @staticmethod
    def _prepare(hosted: Hosted, record: RequestRecord) -> PrepareOutcome:
        """On the prepare thread: the prepared request and its shared-prefix plan, or what went wrong."""
        request = record.request
        assert request is not None  # admitted: decoded
        images, videos = record.decoded if record.decoded is not None else ([], [])
        try:
            prepared = hosted.model.prepare(request.state, request.questions, decoded_images=images,
                                            decoded_videos=videos, permutation_average=request.permutation_average)
            return prepared, hosted.passes.plan(prepared)
        except Exception as exc:  # noqa: BLE001 - handed back as this request's own error
            return exc

    def _answered(self, hosted: Hosted, record: RequestRecord) -> RequestRecord:
        if record.expired is not None:
            return self._refused(record, _expired(record.expired, "could ride a forward pass"))
        prepared = record.prepared
        assert prepared is not None  # it rode a pass: it was prepared
        try:
            answer = hosted.answers.answered(record, prepared.answers(record.probabilities))
        except Exception as exc:  # noqa: BLE001 - a worker fault still gets its request an answer
            log.exception("answer not built", offset=record.source.offset)
            error = hosted.answers.error(record, "internal_error", reason(exc), request=record.request)
            return self._finish(record, error, Stage.REFUSED)
        return self._finish(record, answer, Stage.ANSWERED)

    def _refused(self, record: RequestRecord, refusal: Refusal) -> RequestRecord:
        """A request a stage refused, answered with its error answer (by its model, the default before routing)."""
        return self._finish(record, self.router.of(record).answers.refused(record, refusal), Stage.REFUSED)

    def _finish(self, record: RequestRecord, answer: Answer, stage: Stage) -> RequestRecord:
        """The request's final answer event (with its id and size settled) among its records to publish, the
        request ``stage`` (ANSWERED or REFUSED: a request is answered once); what it held in flight is given
        back."""
        record.advance(stage)
        self.ledger.answered(record)
        position = record.position
        for each in self.router.hosted.values():
            each.passes.rows.finished(position)
        hosted = self.router.of(record)
        if record.tenant is not None:
            self.metrics.count_cost(record.tenant, hosted.name, record.device_seconds, record.tokens,
                                    record.padded_tokens)
        record.timings.total = ms(time.perf_counter() - record.received)
        answer.answer_id = answer_identity(answer, hosted.provenance_sha256)  # deterministic per model
        try:
            record.answer, outgoing = hosted.answers.fitted(record, answer)
        except Exception as exc:  # noqa: BLE001 - the request is finished: it still gets an answer, its error
            # The stage has moved, so the fault handler of the step would pass this request by: answered here.
            log.exception("answer not encoded", offset=record.source.offset)
            error = hosted.answers.refused(record, Refusal("internal_error", reason(exc)))
            error.answer_id = answer_identity(error, hosted.provenance_sha256)
            record.answer, outgoing = hosted.answers.fitted(record, error)
        record.records.append(outgoing)
        record.drop_prepared()
        if self.shadow is None or record.answer.error is not None or not self.shadow.follows(hosted.name, record):
            record.drop_decoded()
        return record


def _expired(late: DeadlineExceeded, when: str) -> Refusal:
    return Refusal("deadline_exceeded",
                   f"the request's deadline had passed {late.late_ms:,} ms before it {when}; it was not run "
                   "(fields deadline / ttl_ms; honor_deadlines)", late_ms=late.late_ms)


# Refusals whose record also goes to the dead-letter topic: what is certainly not a request a producer meant
# (bytes that are not a JSON object, a registry framing whose schema is unknown) is kept there with the reason;
# so is a record the worker failed on (``SkippedRecord``), to be looked at again once the fault is known.
DEAD_LETTERED = frozenset({"undecodable_event", "schema_not_found"})


@dataclass(frozen=True)
class SkippedRecord:
    """A record whose handling raised what no stage expected (service/fetch_handler.py's guard), read as the
    ``internal_error`` refusal ``unreadable`` names and dead-lettered with its own bytes: it is answered, and its
    partition goes on past it. Only where it was read, its key and its bytes are kept: anything else of it (its
    headers, what a registry made of it) may be what failed."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    unreadable: EventError
    headers: Sequence[tuple[str, bytes]] | None = None
    dead_letter: bool = True


def skipped(read: InputRecord, exc: BaseException) -> SkippedRecord:
    """``read`` as a record the worker failed on with ``exc``: its answer names the exception and says why the
    stream went on (under the key's id, as a record a registry could not read is answered)."""
    request_id = read.key.decode("utf-8", "replace") if read.key else None
    message = (f"the worker failed on this record ({reason(exc)[:MAX_FAULT_CHARS]}); it was skipped, answered "
               "with this error and dead-lettered, so that its partition goes on")
    return SkippedRecord(read.topic, read.partition, read.offset, read.timestamp, read.key, read.value,
                         EventError("internal_error", message, request_id))


# Of an exception's message, what a skipped record's answer repeats (its traceback is in the worker's log).
MAX_FAULT_CHARS = 500


def request_tenant(batching: BatchingSettings, record: InputRecord, request: Request) -> str:
    """Who a request's cost counts for: its ``tenant``, else the ``tenant_header`` header, else the topic."""
    if request.tenant is not None:
        return request.tenant
    header = batching.tenant_header
    if header:
        for name, value in record.headers or ():
            if name == header and value:
                return value.decode("utf-8", "replace")[:128]
    return record.topic


def request_scheduling(batching: BatchingSettings, record: InputRecord, request: Request) -> Scheduling:
    """A request's lane and deadline (epoch seconds): the earlier of ``deadline`` and the record's timestamp
    plus ``ttl_ms``; none when ``honor_deadlines`` is off."""
    candidates = []
    if batching.honor_deadlines:
        if request.deadline is not None:
            candidates.append(request.deadline)
        if request.ttl_ms is not None and record.timestamp is not None and record.timestamp >= 0:
            candidates.append(record.timestamp + request.ttl_ms)
    lane = PRIORITIES.index(request.priority)
    return Scheduling(lane=lane, deadline=min(candidates) / 1000.0) if candidates else _UNDATED[lane]


# Each lane's scheduling without a deadline: most requests', built once (they are immutable).
_UNDATED = tuple(Scheduling(lane=lane) for lane in range(len(PRIORITIES)))
