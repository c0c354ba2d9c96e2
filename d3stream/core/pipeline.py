"""The request pipeline: the records of one fetch in, one answer event per record out. No Kafka in it.

``RequestPipeline.serve`` takes any list of records (``seams.InputRecord``: topic, partition, offset, key,
value, headers) and walks them through the stages:

1. **event**: bytes -> ``Request`` (``events.decode_request``), or an error answer (``undecodable_event``,
   also dead-lettered; ``invalid_request``; ``model_not_served``; ``deadline_exceeded`` when its deadline
   has passed already), with its tenant and scheduling (lane, deadline: docs/SCHEDULING.md);
2. **media** (requests that name images or videos): fetched from the object store (``storage.py``) and
   decoded strictly off the prepare thread (``decoding.py``), under the media budgets;
3. **prepare**: validated, rendered and tokenized by the model, and planned for shared-prefix reuse, on the
   prepare thread; the fetch's text-only requests in trips of ``PREPARE_CHUNK``, higher lanes first;
4. **passes**: rows of many requests packed into forward passes (``passes.py``);
5. **answer**: probabilities -> answer objects -> the answer event with its provenance, sized to fit its
   topic (``answers.py``).

A worker may serve several models (``Hosted``: each with its own passes, answer builder and provenance
digest); a request's ``model`` field routes it, absent the first (default) one, or the one ``route_default``
picks (the canary share, rollout.py); a name not served is ``model_not_served``. Records refused before
routing are answered with the default model's records. The models served can change while it runs
(``add_model``, ``retire_model``, ``drop_model``: a swap without a stop): a retired model takes no new
requests but answers those already routed to it.
With a shadow model (``shadow.py``) a share of the answered requests is also answered by it, after the
live answer; each is delivered with its shadow answer as one more record.

The fetch is processed as a batch where that saves work (its text-only requests of one priority lane share
prepare trips and one submission to the scheduler; lanes apart, so a high one does not wait for a flood's), while failures stay per request: whatever goes wrong with one record ends
as that record's error answer, never as its neighbours'. Answers are handed to ``on_served`` as they are
ready (all text-only answers of the fetch together, a media request's on its own).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog

from d3stream.config import Settings
from d3stream.core.answers import AnswerBuilder, RequestWork, answer_identity, ms
from d3stream.core.decoding import ByteBudget, MediaDecoder
from d3stream.core.events import (
    HEADERS,
    PRIORITIES,
    Answer,
    EventError,
    Request,
    RequestLimits,
    Source,
    decode_request,
)
from d3stream.core.jobthread import JobThread
from d3stream.core.media_stage import MediaStage
from d3stream.core.outgoing import Outgoing
from d3stream.core.passes import Passes, PassItem
from d3stream.core.quotas import TenantQuotas
from d3stream.core.seams import DeadlineExceeded, DecisionModel, InFlight, InputRecord, Scheduling
from d3stream.core.shadow import Shadow
from d3stream.core.storage import MediaFetcher
from d3stream.ops.metrics import Metrics
from d3stream.ops.tracing import forwarded_headers, header_names
from d3stream.runtime.media import reason
from d3stream.runtime.model import Prepared

log = structlog.get_logger(__name__)


# Requests prepared per trip to the prepare thread: few trips per fetch, and an urgent request waits for at
# most one trip of a flood's backlog (jobs of a higher priority lane go first: jobthread.py).
PREPARE_CHUNK = 16


@dataclass(eq=False)
class Served:
    """A record's answer event and everything published for it (dead letters first, the answer last)."""

    work: RequestWork
    answer: Answer
    records: list[Outgoing]


OnServed = Callable[[list[Served]], Awaitable[None]]
# A request's decoded media (images, videos), or None for a text-only request.
Media = tuple[list[Any], list[Any]] | None


@dataclass(eq=False)
class Hosted:
    """One model a worker serves, with what is its own: its passes (row and shared-prefix schedulers, token
    budget, prefix runner; the model thread is shared), its answer builder (model record), its provenance
    record and that record's digest, which its answer ids are derived from."""

    model: DecisionModel
    passes: Passes
    answers: AnswerBuilder
    provenance: dict[str, Any]
    provenance_sha256: str

    @property
    def name(self) -> str:
        return self.model.model_name


class RequestPipeline:
    """Records -> answer events, for the models of one worker (see the module's docstring)."""

    def __init__(self, settings: Settings, hosted: Sequence[Hosted], *, fetcher: MediaFetcher,
                 decoder: MediaDecoder, media_budget: ByteBudget, metrics: Metrics, in_flight: InFlight,
                 quotas: TenantQuotas | None = None, shadow: Hosted | None = None):
        self.settings = settings
        self.hosted = {each.name: each for each in hosted}
        if len(self.hosted) != len(hosted):
            raise ValueError("two served models have the same name: name them with --model NAME=PATH")
        # What requests may name: the models above less any retired one that still answers what it holds.
        self.routes = dict(self.hosted)
        self.default = hosted[0]
        self.answers = self.default.answers  # what is refused before routing is answered with its records
        # Picks the model of a request that names none (None: the default); set by a rollout's canary.
        self.route_default: Callable[[Request], Hosted] | None = None
        # Requests routed to each model and not answered yet: a retired model is dropped at zero.
        self.routed: Counter[str] = Counter()
        self.media = MediaStage(settings, fetcher=fetcher, decoder=decoder, media_budget=media_budget,
                                metrics=metrics)
        self.media_budget = media_budget
        self.metrics = metrics
        self.in_flight = in_flight
        # Per-tenant in-flight token limits (tenant_max_inflight_tokens; a limit of 0 holds nothing).
        self.quotas = quotas or TenantQuotas(settings.tenant_max_inflight_tokens, in_flight)
        self.request_limits = RequestLimits.from_settings(settings)
        # Request headers the answers carry: the trace headers, then forward_headers.
        self._forwarded_names = header_names(settings.forward_headers)
        # Prompt preparation and prefix planning: one thread, woken once for many requests.
        self.prepare_thread = JobThread("d3stream-prepare")
        # A model that also answers a share of the requests, to a topic of its own (shadow.py).
        self.shadow = Shadow(settings, shadow, prepare_thread=self.prepare_thread, metrics=metrics) if shadow else None

    def close(self) -> None:
        self.prepare_thread.shutdown()

    def add_model(self, hosted: Hosted, *, default: bool = False) -> None:
        """Serve one more model (or serve a retired one again); as the default, requests naming none go to it."""
        self.hosted[hosted.name] = self.routes[hosted.name] = hosted
        if default:
            self.default, self.answers = hosted, hosted.answers

    def retire_model(self, name: str) -> None:
        """Route nothing more to ``name``; what was routed to it is still answered by it."""
        self.routes.pop(name, None)

    def drop_model(self, name: str) -> Hosted | None:
        """Forget a retired model that holds no request any more (None: it still holds some, or is routable)."""
        if name in self.routes or self.routed[name] > 0:
            return None
        del self.routed[name]
        return self.hosted.pop(name, None)

    async def serve(self, records: Sequence[InputRecord], on_served: OnServed) -> None:
        """Answer every record; ``on_served`` receives each answer once (it must not raise)."""
        works = [self._begin(record) for record in records]
        positions = [work.position for work in works]
        for each in self.hosted.values():
            each.passes.rows.expect(positions)
        refused: list[Served] = []
        # Text-only requests by model and lane: a lane's requests are prepared and submitted without waiting for
        # a lower lane's (a high request read with a flood does not wait for the whole fetch to be prepared).
        text: dict[tuple[str, int], list[tuple[RequestWork, Request]]] = {}
        with_media: list[tuple[RequestWork, Request]] = []
        for work in works:
            outcome = self._admit(work)
            if isinstance(outcome, Answer):
                refused.append(self._served(work, outcome))
            elif outcome.images or outcome.videos:
                with_media.append((work, outcome))
            else:
                lane = work.scheduling.lane if self.settings.priority_lanes else 1
                text.setdefault((self._hosted(work).name, lane), []).append((work, outcome))
        steps: list[Awaitable[None]] = []
        if refused:
            steps.append(on_served(refused))
        for (name, _), items in text.items():  # a few prepare trips and one submission per model and lane
            steps.append(self._isolated([work for work, _ in items],
                                        self._answer_all(self.hosted[name], items, on_served), on_served))
        for work, request in with_media:
            steps.append(self._isolated([work], self._serve_with_media(work, request, on_served), on_served))
        await asyncio.gather(*steps)

    async def _isolated(self, works: list[RequestWork], step: Awaitable[None], on_served: OnServed) -> None:
        """Run ``step``; a fault of this worker still gets each of its requests not yet answered an answer."""
        try:
            await step
        except Exception as exc:  # noqa: BLE001 - a worker fault still gets its request an answer
            log.exception("request failed", offsets=[work.source.offset for work in works][:20])
            left = [work for work in works if not work.finished]
            await on_served([self._served(work, self._hosted(work).answers.error(
                work, "internal_error", reason(exc), request=work.request)) for work in left])

    # ------------------------------------------------------------------------------------ stages

    def _hosted(self, work: RequestWork) -> Hosted:
        """The model a request was routed to (the default before routing)."""
        return self.default if work.model is None else self.hosted[work.model]

    def _begin(self, record: InputRecord) -> RequestWork:
        topic, partition, offset = record.topic, record.partition, record.offset
        work = RequestWork(record, Source(topic=topic, partition=partition, offset=offset, timestamp=record.timestamp),
                           time.perf_counter(), (topic, partition, offset))
        if record.headers:
            forwarded = forwarded_headers(record.headers, self._forwarded_names,
                                          self.settings.forward_headers_max_bytes)
            if forwarded:
                work.headers = [*HEADERS, *forwarded]
        return work

    def _admit(self, work: RequestWork) -> Request | Answer:
        """The decoded request, or the error answer that ends it here."""
        record = work.record
        try:
            request = decode_request(record.value, record.key, self.request_limits)
        except EventError as exc:
            if exc.code == "undecodable_event":
                work.extra.append(self.answers.dead_letter(work, str(exc)))
            return self.answers.error(work, exc.code, str(exc), request_id=exc.request_id)
        work.request = request
        work.tenant = request_tenant(self.settings, record, request)
        scheduling = work.scheduling = request_scheduling(self.settings, record, request)
        if scheduling.deadline is not None and time.time() > scheduling.deadline:
            return self._expired(work, request, DeadlineExceeded(time.time() - scheduling.deadline), "was read")
        if request.model is not None:
            hosted = self.routes.get(request.model)
        else:
            hosted = self.default if self.route_default is None else self.route_default(request)
        if hosted is None:
            served = ", ".join(repr(name) for name in self.routes)
            return self.answers.error(work, "model_not_served",
                                      f"this worker serves {served}, not {request.model!r}", request=request)
        work.model = hosted.name
        self.routed[hosted.name] += 1
        work.questions = len(request.questions)
        self.in_flight.questions += work.questions
        return request

    def _expired(self, work: RequestWork, request: Request, late: DeadlineExceeded, when: str) -> Answer:
        return self._hosted(work).answers.error(
            work, "deadline_exceeded",
            f"the request's deadline had passed {late.late_ms:,} ms before it {when}; it was not run "
            "(fields deadline / ttl_ms; honor_deadlines)",
            request=request, late_ms=late.late_ms)

    async def _serve_with_media(self, work: RequestWork, request: Request, on_served: OnServed) -> None:
        """A request naming images or videos: refused early if certainly too long, its media fetched and
        decoded, then prepared and answered like the text-only ones."""
        hosted = self._hosted(work)
        media = await self._over_token_limit(hosted, work, request) or await self.media.load(hosted.model, hosted.answers, work, request)
        if isinstance(media, Answer):
            await on_served([self._served(work, media)])
            return
        await self._answer_all(hosted, [(work, request)], on_served, [media])

    async def _over_token_limit(self, hosted: Hosted, work: RequestWork, request: Request) -> Answer | None:
        """Refuse a request certainly over max_request_tokens before fetching its media."""
        model = hosted.model
        if not model.request_may_exceed_tokens(len(work.record.value or b""), len(request.questions)):
            return None
        try:
            await self.prepare_thread.run(lambda: model.check_request_tokens(
                request.state, request.questions, permutation_average=request.permutation_average))
        except ValueError as exc:
            return hosted.answers.error(work, "invalid_request", str(exc), request=request)
        return None

    async def _answer_all(self, hosted: Hosted, items: list[tuple[RequestWork, Request]], on_served: OnServed,
                          media: Sequence[Media] | None = None) -> None:
        """Prepare every request (all routed to ``hosted``) on the prepare thread, a few trips for a whole fetch,
        run their rows together on that model's passes, answer them."""
        decoded = media or [None] * len(items)
        following = self.shadow.following(hosted, items, decoded, on_served) if self.shadow else None
        try:
            await self._answer_prepared(hosted, items, following or on_served, decoded)
        finally:
            if following is not None:  # the shadowed requests are delivered with their shadow answers
                await following.finished()

    async def _answer_prepared(self, hosted: Hosted, items: list[tuple[RequestWork, Request]], on_served: OnServed,
                               decoded: Sequence[Media]) -> None:
        started = time.perf_counter()
        outcomes = await self._prepare_all(hosted, items, decoded)
        seconds = time.perf_counter() - started
        refused: list[Served] = []
        passing: list[PassItem] = []
        self.metrics.observe_stage("prepare", seconds, len(items))  # the trips of the fetch took this long together
        prepare_ms = ms(seconds)
        tokens = 0
        for (work, request), outcome in zip(items, outcomes, strict=True):
            work.prepare_at, work.timings.prepare = started, prepare_ms
            if isinstance(outcome, BaseException):
                code = "invalid_request" if isinstance(outcome, ValueError) else "internal_error"
                refused.append(self._served(work, hosted.answers.error(work, code, reason(outcome), request=request)))
                continue
            prepared, plan = outcome
            work.tokens = prepared.input_tokens
            tokens += work.tokens
            passing.append(PassItem(work, prepared, work.position, plan, scheduling=work.scheduling))
        self.in_flight.tokens += tokens
        if refused:
            await on_served(refused)
        await self._run_within_quotas(hosted, passing, on_served)

    async def _run_within_quotas(self, hosted: Hosted, passing: list[PassItem], on_served: OnServed) -> None:
        """Run the requests' rows; a request whose tenant is over ``tenant_max_inflight_tokens`` is held
        first, until its tenant's answered requests make room (quotas.py; the others do not wait for it)."""
        if not self.quotas.enabled:
            if passing:
                await self._run(hosted, passing, on_served)
            return
        ready: list[PassItem] = []
        held: list[PassItem] = []
        for item in passing:
            work = item.work
            taken = self.quotas.try_take(work.tenant or "", work.tokens)
            work.quota_tokens = work.tokens if taken else 0
            (ready if taken else held).append(item)
        steps = [self._run(hosted, ready, on_served)] if ready else []
        steps.extend(self._isolated([item.work], self._held(hosted, item, on_served), on_served) for item in held)
        await asyncio.gather(*steps)

    async def _held(self, hosted: Hosted, item: PassItem, on_served: OnServed) -> None:
        work = item.work
        await self.quotas.take(work.tenant or "", work.tokens, (work.record.topic, work.record.partition))
        work.quota_tokens = work.tokens
        await self._run(hosted, [item], on_served)

    async def _run(self, hosted: Hosted, passing: list[PassItem], on_served: OnServed) -> None:
        async for done in hosted.passes.run(passing):
            await on_served([self._answered(hosted, item) for item in done])

    async def _prepare_all(self, hosted: Hosted, items: list[tuple[RequestWork, Request]],
                           media: Sequence[Media]) -> list[tuple[Prepared, Any] | BaseException]:
        """Each request prepared (or what went wrong), in trips of ``PREPARE_CHUNK`` requests of one priority
        lane: a high-priority request's trip goes before a flood's backlog waiting on the prepare thread."""
        requests = [request for _, request in items]
        lanes = [work.scheduling.lane if self.settings.priority_lanes else 1 for work, _ in items]
        order = sorted(range(len(requests)), key=lanes.__getitem__)
        chunks = [order[at:at + PREPARE_CHUNK] for at in range(0, len(order), PREPARE_CHUNK)]

        def trip(chunk: list[int]) -> list[tuple[Prepared, Any] | BaseException]:
            return [self._prepare(hosted, requests[index], media[index]) for index in chunk]

        results = await asyncio.gather(*(self.prepare_thread.run(partial(trip, chunk), priority=lanes[chunk[0]])
                                         for chunk in chunks))
        if order == list(range(len(order))):  # one lane (a fetch's text requests are grouped by lane): in order
            return [outcome for prepared in results for outcome in prepared]
        outcomes: list[tuple[Prepared, Any] | BaseException] = [RuntimeError("not prepared")] * len(requests)
        for chunk, prepared in zip(chunks, results, strict=True):
            for index, outcome in zip(chunk, prepared, strict=True):
                outcomes[index] = outcome
        return outcomes

    @staticmethod
    def _prepare(hosted: Hosted, request: Request, media: Media) -> tuple[Prepared, Any] | BaseException:
        """On the prepare thread: the prepared request and its shared-prefix plan, or what went wrong."""
        images, videos = media if media is not None else ([], [])
        try:
            prepared = hosted.model.prepare(request.state, request.questions, decoded_images=images,
                                            decoded_videos=videos, permutation_average=request.permutation_average)
            return prepared, hosted.passes.plan(prepared)
        except Exception as exc:  # noqa: BLE001 - handed back as this request's own error
            return exc

    def _answered(self, hosted: Hosted, item: PassItem) -> Served:
        work = item.work
        request = work.request
        assert request is not None  # it rode a pass: it was decoded
        if item.expired is not None:
            return self._served(work, self._expired(work, request, item.expired, "could ride a forward pass"))
        try:
            response = item.prepared.answers(item.probabilities)
            answer = hosted.answers.answered(work, request, response)
        except Exception as exc:  # noqa: BLE001 - a worker fault still gets its request an answer
            log.exception("answer not built", offset=work.source.offset)
            answer = hosted.answers.error(work, "internal_error", reason(exc), request=request)
        return self._served(work, answer)

    def _served(self, work: RequestWork, answer: Answer) -> Served:
        """The request's final answer event (with its id and size settled) and the records to publish."""
        if work.model is not None and not work.finished:
            self.routed[work.model] -= 1
        work.finished = True
        self.in_flight.tokens -= work.tokens
        if work.quota_tokens:
            self.quotas.give_back(work.tenant or "", work.quota_tokens)
            work.quota_tokens = 0
        if work.media_bytes:
            self.media_budget.release(work.media_bytes)
        position = work.position
        for each in self.hosted.values():
            each.passes.rows.finished(position)
        hosted = self._hosted(work)
        if work.tenant is not None:
            self.metrics.count_cost(work.tenant, hosted.name, work.device_seconds, work.tokens, work.padded_tokens)
        work.timings.total = ms(time.perf_counter() - work.received)
        answer.answer_id = answer_identity(answer, hosted.provenance_sha256)  # deterministic per model
        answer, outgoing = hosted.answers.fitted(work, answer)
        return Served(work, answer, [*work.extra, outgoing])


def request_tenant(settings: Settings, record: InputRecord, request: Request) -> str:
    """Who a request's cost counts for: its ``tenant``, else the ``tenant_header`` header, else the topic."""
    if request.tenant is not None:
        return request.tenant
    header = settings.tenant_header
    if header:
        for name, value in record.headers or ():
            if name == header and value:
                return value.decode("utf-8", "replace")[:128]
    return record.topic


def request_scheduling(settings: Settings, record: InputRecord, request: Request) -> Scheduling:
    """A request's lane and deadline (epoch seconds): the earlier of ``deadline`` and the record's timestamp
    plus ``ttl_ms``; none when ``honor_deadlines`` is off."""
    candidates = []
    if settings.honor_deadlines:
        if request.deadline is not None:
            candidates.append(request.deadline)
        if request.ttl_ms is not None and record.timestamp is not None and record.timestamp >= 0:
            candidates.append(record.timestamp + request.ttl_ms)
    lane = PRIORITIES.index(request.priority)
    return Scheduling(lane=lane, deadline=min(candidates) / 1000.0) if candidates else _UNDATED[lane]


# Each lane's scheduling without a deadline: most requests', built once (they are immutable).
_UNDATED = tuple(Scheduling(lane=lane) for lane in range(len(PRIORITIES)))
