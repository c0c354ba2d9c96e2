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
  (kind ``"shadow"``) of the request's ``Served``. So with ``exactly_once`` they commit in the same
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

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import structlog

from d3stream.config import Settings
from d3stream.core.agreement import join_slots, parse_slot
from d3stream.core.answers import AnswerBuilder, RequestWork, answer_identity
from d3stream.core.events import PRIORITIES, Answer, Request
from d3stream.core.jobthread import JobThread
from d3stream.core.outgoing import Outgoing
from d3stream.core.passes import PassItem
from d3stream.core.seams import Scheduling
from d3stream.ops.metrics import Metrics
from d3stream.runtime.media import reason
from d3stream.runtime.model import Prepared

log = structlog.get_logger(__name__)

# Salt of the share's hash, so the shadow's choice is independent of any other hash of request ids.
SHARE_SALT = b"d3stream-shadow\x00"


def shadow_topic(settings: Settings) -> str:
    """Where shadow answers go: ``shadow_topic``, else the answer topic's name + ``.shadow``."""
    return settings.shadow_topic or f"{settings.answer_topic}.shadow"


def chosen(request_id: str, share: float) -> bool:
    """Whether the shadow also answers this request: the first 64 bits of SHA-256(salt + id) below ``share``
    of their range. A function of the id only: every worker, restart and replay picks the same requests."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    digest = hashlib.sha256(SHARE_SALT + request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < share * 2.0**64


OnServed = Callable[[list[Any]], Awaitable[None]]  # pipeline.OnServed: a list of pipeline.Served
# A request's decoded media (images, videos), or None for a text-only request (pipeline.Media).
Media = tuple[list[Any], list[Any]] | None


class Shadow:
    """The shadow of one worker: its model's passes, an answer builder for the shadow topic, the share."""

    def __init__(self, settings: Settings, hosted: Any, *, prepare_thread: JobThread, metrics: Metrics):
        self.hosted = hosted
        self.name: str = hosted.name
        self.topic = shadow_topic(settings)
        self.share = settings.shadow_share
        self.lanes = settings.priority_lanes
        self.prepare_thread = prepare_thread
        self.metrics = metrics
        live: AnswerBuilder = hosted.answers
        # Its answers are fitted to the shadow topic's message limit, and name the shadow model.
        self.answers = AnswerBuilder(msgspec.structs.replace(settings, answer_topic=self.topic),
                                     model_record=live.model_record, worker=live.worker, fit=live.fit,
                                     metrics=metrics, replay_id=live.replay_id)

    def following(self, live: Any, items: Sequence[tuple[RequestWork, Request]], media: Sequence[Media],
                  on_served: OnServed) -> Following | None:
        """The ``on_served`` of requests routed to ``live`` that also sends the chosen ones to the shadow;
        None when the shadow is that model itself."""
        if live.name == self.name:
            return None
        return Following(self, live.name, {id(work): (request, each) for (work, request), each
                                           in zip(items, media, strict=True)}, on_served)

    async def answer(self, live: str, pending: list[tuple[Any, Request, Media]], on_served: OnServed) -> None:
        """Answer ``pending`` (live ``Served``, its request, its media) with the shadow; each live Served is
        delivered once its shadow record is attached to it. Never raises: a failure is a shadow error answer."""
        works = [self._work(served.work, request) for served, request, _ in pending]
        left = dict(enumerate(pending))
        try:
            lanes = [self._lane(request) for _, request, _ in pending]
            prepared = await self.prepare_thread.run(
                partial(self._prepare_all, [(request, media) for _, request, media in pending]), priority=min(lanes))
            items: list[PassItem] = []
            index_of: dict[int, int] = {}
            ready: list[int] = []
            for index, outcome in enumerate(prepared):
                if isinstance(outcome, BaseException):
                    code = "invalid_request" if isinstance(outcome, ValueError) else "internal_error"
                    self._attach(live, pending[index], works[index],
                                 self.answers.error(works[index], code, reason(outcome), request=pending[index][1]))
                    ready.append(index)
                    continue
                prepared_request, plan = outcome
                works[index].tokens = prepared_request.input_tokens
                item = PassItem(works[index], prepared_request, works[index].position, plan,
                                scheduling=Scheduling(lane=lanes[index], deadline=None))  # never late
                index_of[id(item)] = index
                items.append(item)
            await self._deliver(ready, left, on_served)
            async for done in self.hosted.passes.run(items):
                finished = [index_of[id(item)] for item in done]
                for item, index in zip(done, finished, strict=True):
                    self._attach(live, pending[index], item.work, self._answered(item, pending[index][1]))
                await self._deliver(finished, left, on_served)
        except Exception as exc:  # noqa: BLE001 - a shadow fault is the shadow's error answer, never the live one's
            log.exception("shadow answers failed", shadow=self.name, requests=len(left))
            for index in list(left):
                self._attach(live, pending[index], works[index],
                             self.answers.error(works[index], "internal_error", reason(exc), request=pending[index][1]))
            await self._deliver(list(left), left, on_served)

    # ------------------------------------------------------------------------------------ steps

    def _lane(self, request: Request) -> int:
        """The request's priority lane (``priority_lanes=false``: the middle one, as for its live rows)."""
        return PRIORITIES.index(request.priority) if self.lanes else 1

    def _work(self, live: RequestWork, request: Request) -> RequestWork:
        """The shadow answer's own record of the request (its passes, timings, cost), read where the live one was."""
        return RequestWork(record=live.record, source=live.source, received=time.perf_counter(), position=live.position,
                           request=request,
                           model=self.name, headers=live.headers, tenant=live.tenant, media=live.media)

    def _prepare_all(self, pending: list[tuple[Request, Media]]) -> list[tuple[Prepared, Any] | BaseException]:
        """On the prepare thread (in its requests' lane): each request prepared for the shadow model, or what went wrong."""
        outcomes: list[tuple[Prepared, Any] | BaseException] = []
        for request, media in pending:
            images, videos = media if media is not None else ([], [])
            try:
                prepared = self.hosted.model.prepare(request.state, request.questions, decoded_images=images,
                                                     decoded_videos=videos,
                                                     permutation_average=request.permutation_average)
                outcomes.append((prepared, self.hosted.passes.plan(prepared)))
            except Exception as exc:  # noqa: BLE001 - that request's own shadow error
                outcomes.append(exc)
        return outcomes

    def _answered(self, item: PassItem, request: Request) -> Answer:
        try:
            if item.expired is not None:
                raise RuntimeError("the shadow's rows were dropped at a deadline")
            return self.answers.answered(item.work, request, item.prepared.answers(item.probabilities))
        except Exception as exc:  # noqa: BLE001 - the shadow's own error answer
            log.exception("shadow answer not built", offset=item.work.source.offset)
            return self.answers.error(item.work, "internal_error", reason(exc), request=request)

    def _attach(self, live: str, pending: tuple[Any, Request, Media], work: RequestWork, answer: Answer) -> None:
        """The shadow answer as the last record of the live request's Served (one transaction), and measured."""
        served = pending[0]
        answer.answer_id = answer_identity(answer, self.hosted.provenance_sha256)
        answer, outgoing = self.answers.fitted(work, answer)
        served.records.append(as_shadow(outgoing))
        self.observe(live, served.answer, answer)

    @staticmethod
    async def _deliver(indices: list[int], left: dict[int, tuple[Any, Request, Media]], on_served: OnServed) -> None:
        served = [left.pop(index)[0] for index in indices if index in left]
        if served:
            await on_served(served)

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


class Following:
    """An ``on_served`` that delivers what is not shadowed at once and hands the chosen requests' live answers
    to the shadow, which delivers each with its shadow answer (``finished`` waits for those)."""

    def __init__(self, shadow: Shadow, live: str, requests: dict[int, tuple[Request, Media]], on_served: OnServed):
        self.shadow = shadow
        self.live = live
        self.requests = requests
        self.on_served = on_served
        self._tasks: list[asyncio.Future[None]] = []

    async def __call__(self, served: list[Any]) -> None:
        now: list[Any] = []
        later: list[tuple[Any, Request, Media]] = []
        for each in served:
            known = self.requests.get(id(each.work))
            if known is None or each.answer.error is not None or not chosen(known[0].id, self.shadow.share):
                now.append(each)  # refused or failed live: the shadow compares answers, not refusals
            else:
                later.append((each, *known))
        if later:
            # Its own task: the live answers of later passes are not held up behind this shadow work.
            self._tasks.append(asyncio.ensure_future(self.shadow.answer(self.live, later, self.on_served)))
        if now:
            await self.on_served(now)

    async def finished(self) -> None:
        """Until every shadowed request of this step is delivered."""
        while self._tasks:
            tasks, self._tasks = self._tasks, []
            await asyncio.gather(*tasks)


def as_shadow(record: Outgoing) -> Outgoing:
    """``record`` (an answer to the shadow topic) as a shadow record, its too-large replacement one too."""
    replacement = record.replacement
    record.kind = "shadow"
    if replacement is not None:
        record.replacement = lambda cause: as_shadow(replacement(cause))
    return record
