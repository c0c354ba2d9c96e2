"""The media stage of the request pipeline: a request's images and videos fetched and decoded, or the refusal
that ends the request (the pipeline answers it).

Limits come first: the number of references before any fetch (``max_media_references``), whether the model
takes the kind at all, then objects sized with HEAD by the fetcher (``storage.py``: allowlist, strict size
limits, ETag-pinned GETs), then pixel and frame totals from headers before any decode (``decoding.py``:
images on a thread, videos in killable processes, under ``media_decode_timeout_s``). Decoded media hold their
share of ``max_inflight_media_bytes`` until the request is answered.
"""

from __future__ import annotations

import asyncio
import time

from d3stream_client.validation import EventError, check_media_references

from d3stream.core.answers import media_record, ms
from d3stream.core.decoding import MediaDecoder
from d3stream.core.inflight import InFlightLedger
from d3stream.core.record import Refusal, RequestRecord, Stage
from d3stream.core.seams import DecisionModel
from d3stream.core.storage import MediaError, MediaFetcher
from d3stream.ops.metrics import Metrics
from d3stream.runtime.kinds import IMAGE, MEDIA_KINDS, VIDEO
from d3stream.runtime.media import MediaBudgetExceeded
from d3stream.settings import MediaSettings


class MediaStage:
    """Fetch and decode the media of requests, under the worker's limits and budgets."""

    def __init__(self, media: MediaSettings, *, fetcher: MediaFetcher, decoder: MediaDecoder, ledger: InFlightLedger,
                 metrics: Metrics):
        self.limits = media
        self.fetcher = fetcher
        self.decoder = decoder
        self.ledger = ledger  # the media budget's share of each request is taken and given back through it
        self.metrics = metrics

    async def load(self, model: DecisionModel, record: RequestRecord) -> Refusal | None:
        """Fetch and decode a request's media into ``record.decoded``, or the refusal that ends it. The reference
        count is checked before any fetch, pixel and frame totals (from headers) before any decode; identical
        references are fetched and decoded once."""
        request = record.request
        assert request is not None  # admitted: decoded
        try:
            check_media_references(request, self.limits.max_media_references)
        except EventError as exc:
            return Refusal(exc.code, str(exc))
        for kind in MEDIA_KINDS:
            unavailable = kind.unavailable(model)
            if kind.references(request) and unavailable is not None:
                return Refusal("media_unreadable", f"{kind.name} inputs are not available: {unavailable}")
        try:
            started = record.fetch_at = time.perf_counter()
            images, videos = await asyncio.gather(
                *(self.fetcher.fetch_all(kind.references(request), kind.name) for kind in (IMAGE, VIDEO)))
            record.timings.fetch = ms(time.perf_counter() - started)
            self.metrics.observe_stage("fetch", time.perf_counter() - started)
            record.media = [media_record(item) for item in (*images, *videos)]
            fetched = {id(item): len(item.data) for item in (*images, *videos)}  # a repeated reference once
            self.metrics.add_media_bytes(sum(fetched.values()))
        except MediaError as exc:
            return Refusal(exc.code, exc.message)

        async def reserve(estimate: int) -> None:
            await self.ledger.reserve_media(record, estimate)

        try:
            started = record.decode_at = time.perf_counter()
            decoded = await self.decoder.decode([i.data for i in images], [v.data for v in videos], reserve)
            record.timings.decode = ms(time.perf_counter() - started)
            self.metrics.observe_stage("decode", time.perf_counter() - started)
        except MediaBudgetExceeded as exc:
            return Refusal("invalid_request", str(exc))
        except ValueError as exc:
            return Refusal("media_unreadable", str(exc))
        memory = decoded.memory
        self.ledger.keep_media(record, memory.total)  # what the media really take; the rest of the estimate back
        record.media_kept = memory.kept  # what is left once the request is prepared
        record.decoded = (decoded.images, decoded.videos)
        record.advance(Stage.MEDIA)
        return None
