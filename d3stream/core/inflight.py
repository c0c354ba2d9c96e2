"""What the requests in flight hold, and the one owner that takes it and gives it back.

A request read and not yet handed to the sink holds a place among ``max_inflight_requests``, its questions,
its prompt tokens (``max_inflight_tokens``), maybe a part of its tenant's quota (``core/quotas.py``), maybe a
share of ``max_inflight_media_bytes``, and a count against the model it was routed to (a retired model is
dropped when that reaches zero). Each of these changes only through ``InFlightLedger``: taken as the
request advances (read, routed, prepared, its quota, its media), and given back in two steps, because the
answer frees most of it before the sink has it: ``answered`` when its answer event is built (tokens, quota,
media, its model's count), ``delivered`` when the sink has taken the answer (its place and its questions,
which backpressure keeps counting until then). The consume loop reads the counts (``seams.InFlight``) to
decide when to pause.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from d3stream.core.decoding import ByteBudget
from d3stream.core.quotas import TenantQuotas
from d3stream.core.record import RequestRecord
from d3stream.core.seams import InFlight


class InFlightLedger:
    """The one owner of what in-flight requests hold (see the module's docstring)."""

    def __init__(self, *, media_budget: ByteBudget, tenant_max_inflight_tokens: int = 0):
        self.counts = InFlight()
        self.media = media_budget
        self.quotas = TenantQuotas(tenant_max_inflight_tokens, self.counts)
        # Requests routed to each model and not answered yet.
        self.routed: Counter[str] = Counter()

    # ---------------------------------------------------------------------------------- taken

    def read(self, count: int) -> None:
        """``count`` records were read and handed to the pipeline."""
        self.counts.requests += count

    def route(self, record: RequestRecord, model: str) -> None:
        """The decoded request goes to ``model``; its questions count from now on."""
        assert record.request is not None  # routed once decoded
        record.model = model
        record.questions = len(record.request.questions)
        self.routed[model] += 1
        self.counts.questions += record.questions

    def prepared(self, records: Sequence[RequestRecord]) -> None:
        """These requests were prepared (``record.tokens`` set): their prompt tokens count from now on, and the
        media budget they took for the processor's copies goes back."""
        self.counts.tokens += sum(record.tokens for record in records)
        for record in records:
            if record.media_bytes > record.media_kept:
                self.keep_media(record, record.media_kept)

    def try_quota(self, record: RequestRecord) -> bool:
        """Take the request's tokens of its tenant's quota if they fit now (always, with quotas off)."""
        taken = self.quotas.try_take(record.tenant or "", record.tokens)
        record.quota_tokens = record.tokens if taken else 0
        return taken

    async def wait_for_quota(self, record: RequestRecord) -> None:
        """Hold the request until its tokens fit its tenant's quota, then take them (its partition is reported
        as held meanwhile, and the consume loop pauses it)."""
        source = record.source
        await self.quotas.take(record.tenant or "", record.tokens, (source.topic, source.partition))
        record.quota_tokens = record.tokens

    async def reserve_media(self, record: RequestRecord, estimate: int) -> None:
        """Wait for the request's share of the media budget (its decoded size, estimated from headers)."""
        record.media_bytes = await self.media.acquire(estimate)

    def keep_media(self, record: RequestRecord, held: int) -> None:
        """The request's media are decoded and take ``held`` bytes: the rest of its estimate goes back."""
        if held < record.media_bytes:
            self.media.release(record.media_bytes - held)
            record.media_bytes = held

    # ------------------------------------------------------------------------------ given back

    def answered(self, record: RequestRecord) -> None:
        """The request's answer event is built: its tokens, quota, media and its model's count go back
        (once: the pipeline calls it as the request moves to ANSWERED or REFUSED, which it does once)."""
        if record.model is not None:
            self.routed[record.model] -= 1
        self.counts.tokens -= record.tokens
        if record.quota_tokens:
            self.quotas.give_back(record.tenant or "", record.quota_tokens)
            record.quota_tokens = 0
        if record.media_bytes:
            self.media.release(record.media_bytes)
            record.media_bytes = 0

    def delivered(self, records: Sequence[RequestRecord]) -> None:
        """The sink took these requests' answers (or gave up on them): their places and questions go back."""
        self.counts.requests -= len(records)
        self.counts.questions -= sum(record.questions for record in records)

    def released(self, count: int) -> None:
        """``count`` records read were handled without becoming requests (the evaluator joins them, it answers
        none): their places go back."""
        self.counts.requests -= count
