"""The request record: one typed object per request, from the fetch that read it to the sink that takes its
answer.

A record read from a topic becomes a ``RequestRecord`` once, when the pipeline takes it, and every stage
works on that same object: where it was read (``source``, once), what admission made of it (the decoded
request, its model, tenant, lane and what it holds in flight), what the passes made of it (its prepared
rows, their probabilities, the passes that carried it) and, at the end, its answer event and the records to
publish for it. Nothing re-wraps it on the way, so what a stage learns is simply there for the next one.

Where a record is on that way is its ``stage`` (``Stage``), and only ``RequestRecord.advance`` moves it,
checking the step against ``NEXT``. Why a stage rather than reading it off which optional fields happen to
be set: those say what a record holds, not what has been done with it (a refused request may hold a decoded
request, or none), and a step the pipeline never takes (a second answer, a shadow answer after an error
answer) raises where it goes wrong instead of going out as a second answer event. The stages::

    READ -> DECODED -> ROUTED -> (MEDIA ->) PREPARED -> SCORED -> ANSWERED (-> SHADOWED) -> DELIVERED
    any stage before an answer -> REFUSED -> DELIVERED

A stage that refuses a request, or a worker fault, ends it at REFUSED from wherever it was. A shadow's own
record of a request (``shadow.py``) starts ROUTED (to the shadow model) and ends SCORED: its answer is
appended to the live record's records, and the live record moves to SHADOWED.

What a record holds is let go as soon as nothing further needs it, since a worker keeps records until their
answers are delivered and large media must not wait that long: the decoded media once it is prepared
(``drop_decoded``), its prompts and vision inputs once its answer is built (``drop_prepared``), its answer, request
and records once they are delivered (``drop_delivered``; the record itself lives as long as its fetch). Nothing a
record holds refers back to it, so it is freed the moment the last stage lets go of it, without waiting for
Python's cyclic collector (which large pixel and tensor buffers do not prompt to run).

A stage that ends a request early does not build an answer itself: it returns a ``Refusal`` (an error code
and a message), and the pipeline turns every refusal into an error answer in one place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from d3stream_client.contract import HEADERS, Answer, BatchRecord, Cost, MediaRecord, Request, Source, Timings

from d3stream.core.outgoing import Outgoing
from d3stream.core.seams import DEFAULT_SCHEDULING, DeadlineExceeded, InputRecord, Position, Scheduling
from d3stream.runtime import Prepared, Row

if TYPE_CHECKING:
    from PIL import Image

    from d3stream.runtime.media import Video
    from d3stream.runtime.prefix_passes import Plan

# A request's decoded media (images, videos), or None for a text-only request.
Media = tuple[list["Image.Image"], list["Video"]] | None


class Stage(enum.Enum):
    """Where a request is on its way through a worker (see the module's docstring); what each stage adds to
    the record is there from that stage on."""

    READ = "read"  # taken from a fetch: its bytes and where they were read (input, source, headers)
    DECODED = "decoded"  # its request decoded: request, tenant, scheduling
    ROUTED = "routed"  # routed to a served model: model, and its questions count in flight
    MEDIA = "media"  # its images and videos fetched and decoded (requests that name any): media, decoded
    PREPARED = "prepared"  # rendered and tokenized: prepared, plan, and its tokens count in flight
    SCORED = "scored"  # the passes are done with its rows: probabilities, batch (or expired: a deadline passed)
    ANSWERED = "answered"  # its answer event is built from the model's output: answer, records
    REFUSED = "refused"  # its error answer is built instead: a stage refused it, or a fault ended it
    SHADOWED = "shadowed"  # its shadow answer is among its records too (shadow.py)
    DELIVERED = "delivered"  # the sink took its records (or gave up on them): nothing is held for it any more

    # A member is equal only to itself, so it may hash as itself: ``Enum``'s own hash is Python code hashing
    # the member's name, and every request takes about a dozen steps through sets of stages (bench kafka).
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        """Its answer event is built: whatever happens next, it gets no second one."""
        return self in _FINISHED


# The steps a record may take from each stage (RequestRecord.advance); any stage before an answer may end in a
# refusal, since a worker fault is answered wherever the request was.
NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.READ: frozenset({Stage.DECODED, Stage.REFUSED}),
    Stage.DECODED: frozenset({Stage.ROUTED, Stage.REFUSED}),
    Stage.ROUTED: frozenset({Stage.MEDIA, Stage.PREPARED, Stage.REFUSED}),
    Stage.MEDIA: frozenset({Stage.PREPARED, Stage.REFUSED}),
    Stage.PREPARED: frozenset({Stage.SCORED, Stage.REFUSED}),
    Stage.SCORED: frozenset({Stage.ANSWERED, Stage.REFUSED}),
    Stage.ANSWERED: frozenset({Stage.SHADOWED, Stage.DELIVERED}),
    Stage.REFUSED: frozenset({Stage.DELIVERED}),
    Stage.SHADOWED: frozenset({Stage.DELIVERED}),
    Stage.DELIVERED: frozenset(),
}
_FINISHED = frozenset({Stage.ANSWERED, Stage.REFUSED, Stage.SHADOWED, Stage.DELIVERED})


class IllegalTransition(RuntimeError):
    """A record asked to take a step its stage does not allow: a fault of this worker, not of the request."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a stage ends a request without the model's answer: the error answer's code and message."""

    code: str
    message: str
    request_id: str | None = None  # the id an undecodable record still names, if any
    late_ms: int | None = None  # deadline_exceeded: how late it was


@dataclass(slots=True, eq=False, weakref_slot=True)
class RequestRecord:
    """One request on its way through a worker (see the module's docstring)."""

    # -- where it was read, and its bytes
    input: InputRecord  # key, value and headers as read (any object with ``seams.InputRecord``'s attributes)
    source: Source  # topic, partition, offset and timestamp: what its answer names as its source
    received: float  # perf_counter when the pipeline took it
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS)  # of its answer and dead letter
    stage: Stage = Stage.READ  # where it is: moved by ``advance`` only

    # -- admission: the decoded request, where it goes, what it holds in flight
    request: Request | None = None  # once decoded: even a worker fault is answered under its id
    model: str | None = None  # the served model it was routed to (None: not routed; the default's records)
    tenant: str | None = None  # who its cost counts for (None: not a request; it has no cost)
    scheduling: Scheduling = DEFAULT_SCHEDULING  # its lane and deadline, once decoded
    questions: int = 0
    media: list[MediaRecord] = field(default_factory=list)  # the objects read for it (provenance)
    decoded: Media = None  # its decoded images and videos
    media_bytes: int = 0  # held of the in-flight media budget
    media_kept: int = 0  # of which what stays held once the request is prepared (the processor's copies are gone)
    tokens: int = 0  # its prompt tokens, once prepared
    quota_tokens: int = 0  # taken of its tenant's quota (tenant_max_inflight_tokens), given back when answered

    # -- the passes
    prepared: Prepared | None = None
    plan: Plan | None = None  # its shared-prefix plan (runtime.prefix), if it has one
    probabilities: dict[Row, list[float]] = field(default_factory=dict)
    expired: DeadlineExceeded | None = None  # its deadline passed before a pass carried all its rows
    batch: BatchRecord = field(default_factory=BatchRecord)
    device_seconds: float = 0.0  # its share of the passes' device time, by tokens
    padded_tokens: int = 0

    # -- when each stage started (perf_counter; 0: not reached) and how long it took: spans and provenance
    timings: Timings = field(default_factory=Timings)
    fetch_at: float = 0.0
    decode_at: float = 0.0
    prepare_at: float = 0.0
    submitted_at: float = 0.0
    publish_at: float = 0.0

    # -- the outcome: its answer event and what is published for it (dead letters first, the answer, a shadow's)
    answer: Answer | None = None
    records: list[Outgoing] = field(default_factory=list)

    # Where it was read: (topic, partition, offset), what source-ordered schedulers keep places by and what a fetch
    # tracks as handed on. Made once from ``source`` (read several times a request; a record's source is fixed).
    position: Position = field(init=False, repr=False)

    def __post_init__(self) -> None:
        source = self.source
        self.position = (source.topic, source.partition, source.offset)

    def advance(self, stage: Stage) -> None:
        """Move it to ``stage``, one of the steps ``NEXT`` allows from where it is; any other step raises
        ``IllegalTransition`` (a second answer, a shadow of an error answer), since going on would publish
        what the request's one answer event must not be."""
        if stage not in NEXT[self.stage]:
            source = self.source
            raise IllegalTransition(f"the request read at {source.topic}/{source.partition}/{source.offset} is "
                                    f"{self.stage.name}: it cannot move to {stage.name}")
        self.stage = stage

    def drop_decoded(self) -> None:
        """Its decoded images and videos are no longer needed: it is prepared (the vision inputs hold what the
        passes read), or ended before it was."""
        self.decoded = None

    def drop_prepared(self) -> None:
        """Its answer is built: its prompts, vision inputs and row probabilities are no longer needed. What is
        left (the answer and the records to publish) waits for delivery."""
        self.prepared = None
        self.plan = None
        self.probabilities = {}

    def drop_delivered(self) -> None:
        """Its answer is delivered: the answer event, the records published for it (the sink keeps what it still
        needs itself) and the request are no longer needed here. Let go now, while they are fresh in the CPU's
        caches, not when the fetch that read it is done: a fetch's records live until its last one is answered,
        and freeing thousands of cold ones at once cost about a tenth of the pipeline's time (bench kafka)."""
        self.answer = None
        self.request = None
        self.records = []

    def cost(self) -> Cost | None:
        """Its cost record, once the request is decoded (a record that is no request has no tenant)."""
        if self.tenant is None:
            return None
        return Cost(tenant=self.tenant, prompt_tokens=self.tokens, padded_tokens=self.padded_tokens,
                    device_seconds=self.device_seconds,
                    media_bytes=sum(media.bytes for media in self.media) if self.media else 0)
