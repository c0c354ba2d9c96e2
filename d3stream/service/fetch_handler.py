"""The consume loop's handler: each fetch answered by the pipeline and handed to delivery, under a guard.

``FetchHandler.serve`` is what the consume loop (``kafka/consume.py``) runs as one task per fetch. The request
pipeline (``core/pipeline.py``) answers the fetch's records (through the Schema Registry first when one is
set: ``kafka/registry.py``), and each group of answers is handed to the commit policy (``kafka/commits.py``)
as soon as it is ready, beside the pipeline's further work; the handler counts and traces what it delivered.

It is also the guard for what escapes the pipeline anyway (``_answer_guarded``): a fetch whose answering
raises is answered again a record at a time, and a record whose own handling still raises is skipped
(answered ``internal_error`` naming the exception, dead-lettered, counted in
``d3stream_records_failed_total``), so its partition goes on; a handler that dies even so is logged and makes
the worker not ready (``Metrics.watch``). An error no retry can cure (``WorkerFatal``) stops the worker with
the records' offsets uncommitted.

Why a module of its own: answering a fetch needs the pipeline, the registry, the delivery, the in-flight
ledger, the metrics and the tracing, and nothing else of the worker; ``service.py`` composes those and hands
them over, so this path reads (and is tested) without the worker's start-up and shutdown around it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from d3stream.core.inflight import InFlightLedger
from d3stream.core.pipeline import RequestPipeline, skipped
from d3stream.core.record import RequestRecord, Stage
from d3stream.core.seams import InputRecord, Position, position_of
from d3stream.kafka.commits import Answered, CommitPolicy
from d3stream.kafka.consume import ConsumeLoop, Fetch
from d3stream.kafka.limits import WorkerFatal
from d3stream.kafka.registry import Registry
from d3stream.ops.metrics import Metrics
from d3stream.ops.tracing import Tracing
from d3stream.runtime.media import reason

__all__ = ["FetchHandler"]

log = structlog.get_logger(__name__)


class FetchHandler:
    """Answers each fetch and delivers its answers (see the module's docstring); counts what it delivered."""

    def __init__(self, pipeline: RequestPipeline, *, ledger: InFlightLedger, metrics: Metrics,
                 registry: Registry | None, tracing: Tracing | None):
        self.pipeline = pipeline
        self.ledger = ledger
        self.metrics = metrics
        self.registry = registry
        self.tracing = tracing
        # Made when the worker runs (``deliver_through``): where answers go, and the loop a fatal error stops.
        self.delivery: CommitPolicy | None = None
        self.loop: ConsumeLoop | None = None
        self.answered = 0  # requests delivered with an answer
        self.errors = 0  # requests delivered with an error answer

    def deliver_through(self, delivery: CommitPolicy, loop: ConsumeLoop) -> None:
        """Where answers go and which consume loop an error stops: the worker makes them when it runs, the
        loop with this handler's ``serve``."""
        self.delivery, self.loop = delivery, loop

    async def serve(self, fetched: Fetch) -> None:
        """The consume loop's handler: the pipeline answers the fetch, and each group of answers is delivered
        as it is ready (beside the pipeline's further work, not after it). Should answering raise anyway, the
        guard (``_answer_guarded``) answers each record not handed on yet by itself: a record at fault costs
        itself, never its neighbours, its partition or the worker. What escapes even that ends the task, which
        the consume loop watches (``Metrics.watch``: logged, and the worker is not ready)."""
        deliveries: list[asyncio.Future[None]] = []
        try:
            failed = await self._answer_guarded(fetched, deliveries)
            await asyncio.gather(*deliveries)
        except asyncio.CancelledError:  # the loop gave up on this fetch: nothing of it is handed on any more
            for delivery in deliveries:
                delivery.cancel()
            raise
        if failed is not None:
            raise failed

    async def _answer_guarded(self, fetched: Fetch, deliveries: list[asyncio.Future[None]]) -> Exception | None:
        """Answer the fetch, its records handed to delivery as they are answered (``deliveries``). If that
        raises (an unframing that recurses too deep, a stage's bug), the records not handed on yet are answered
        again each by itself, side by side, so that the one at fault is found and the others are answered as
        usual; one that still raises is skipped (``_answer_alone``). A worker-fatal error stops the worker as
        delivery's do; a cancellation goes through. Returns what even a skipped record's answer raised."""
        handed: set[Position] = set()
        try:
            await self._answer_unframing(fetched, fetched.records, deliveries, handed)
            return None
        except WorkerFatal as exc:
            self._stop_for(exc, fetched.records)
            return None
        except Exception as exc:  # noqa: BLE001 - the guard: a fault of the worker costs the record at fault only
            left = [record for record in fetched.records if position_of(record) not in handed]
            log.error("a fetch could not be answered: its records are answered one by one", records=len(left),
                      error=reason(exc), exc_info=exc)
        outcomes = await asyncio.gather(*(self._answer_alone(fetched, record, deliveries, handed) for record in left),
                                        return_exceptions=True)
        return next((outcome for outcome in outcomes if isinstance(outcome, Exception)), None)

    async def _answer_alone(self, fetched: Fetch, record: InputRecord, deliveries: list[asyncio.Future[None]],
                            handed: set[Position]) -> None:
        """One record of a fetch whose answering failed, answered by itself; should that raise too, the record is
        skipped: answered ``internal_error`` naming the exception and dead-lettered (``pipeline.skipped``),
        counted in ``d3stream_records_failed_total``, and its offset commits as an answered record's does, so
        its partition goes on. Raises what answering the skipped record raised (nothing is left to try)."""
        try:
            await self._answer_unframing(fetched, [record], deliveries, handed)
            return
        except WorkerFatal as exc:
            self._stop_for(exc, [record])
            return
        except Exception as exc:  # noqa: BLE001 - this record is the one at fault: skipped below
            fault = exc
        if position_of(record) in handed:  # it was answered before its handling failed: that answer stands
            log.error("a record's handling failed after it was answered", topic=record.topic,
                      partition=record.partition, offset=record.offset, error=reason(fault), exc_info=fault)
            return
        log.error("record skipped: the worker failed on it", topic=record.topic, partition=record.partition,
                  offset=record.offset, error=reason(fault), exc_info=fault,
                  then="answered internal_error and dead-lettered; its partition goes on")
        self.metrics.count_record_failed(type(fault).__name__)
        await self._answer(fetched, [skipped(record, fault)], deliveries, handed)

    async def _answer_unframing(self, fetched: Fetch, records: Sequence[InputRecord],
                                deliveries: list[asyncio.Future[None]], handed: set[Position]) -> None:
        """``_answer`` for records as they came: through the Schema Registry when one is set (registry.py). The
        records it can read now are answered while the schema ids of the others are looked up, so a flood of
        new ids delays no request whose id is known."""
        if self.registry is None:
            await self._answer(fetched, records, deliveries, handed)
            return
        ready, waiting = self.registry.unframe_known(records)
        looking = asyncio.ensure_future(self.registry.unframe_looked_up(waiting)) if waiting else None
        try:
            if ready:
                await self._answer(fetched, ready, deliveries, handed)
            if looking is not None:
                await self._answer(fetched, await looking, deliveries, handed)
        finally:
            if looking is not None and not looking.done():
                looking.cancel()  # the ready records failed: the guard answers them all again, one at a time
            elif looking is not None and not looking.cancelled():
                looking.exception()  # retrieved: it was awaited above, or given up with what failed before it

    async def _answer(self, fetched: Fetch, records: Sequence[InputRecord], deliveries: list[asyncio.Future[None]],
                      handed: set[Position]) -> None:
        """The pipeline answers ``records``; each group of answers is handed to delivery as it is ready, and
        ``handed`` keeps where each of its records was read."""
        async for answered in self.pipeline.answer(records):
            handed.update(record.position for record in answered)
            deliveries.append(asyncio.ensure_future(self._deliver(fetched, answered)))

    def _stop_for(self, exc: WorkerFatal, records: Sequence[InputRecord]) -> None:
        """A worker-fatal error while answering: the worker stops, these records' offsets stay uncommitted."""
        assert self.loop is not None
        log.error("records could not be answered; their offsets stay uncommitted",
                  offsets=[record.offset for record in records][:20], error=str(exc))
        self.loop.fail(exc)

    async def _deliver(self, fetched: Fetch, records: list[RequestRecord]) -> None:
        """Hand answers to the commit policy; count and trace them. Never raises: a worker-fatal error stops
        the worker (the offsets stay uncommitted), any other stops it too and is logged."""
        assert self.delivery is not None and self.loop is not None
        started = time.perf_counter()
        answered = []
        for record in records:
            record.publish_at = started
            partition, epoch = fetched.origin(record.input)
            answered.append(Answered(partition, record.source.offset, record.records, epoch))
        try:
            await self.delivery.deliver(answered)
        except WorkerFatal as exc:
            log.error("answers could not be published; their offsets stay uncommitted",
                      offsets=[record.source.offset for record in records][:20], error=str(exc))
            self.loop.fail(exc)
            return
        except Exception:  # noqa: BLE001 - stop rather than commit past an unpublished answer
            log.exception("answers could not be published; their offsets stay uncommitted")
            self.loop.stop()
            return
        finally:
            self.ledger.delivered(records)
            for record in records:
                record.advance(Stage.DELIVERED)
        published = time.perf_counter()
        metrics = self.metrics
        metrics.observe_stage("publish", published - started, len(records))  # delivered together
        errors: dict[str, int] = {}
        for record in records:
            metrics.observe_stage("end_to_end", published - record.received)
            assert record.answer is not None  # the pipeline hands on answered requests only
            error = record.answer.error
            if error is not None:
                errors[error.code] = errors.get(error.code, 0) + 1
        failed = sum(errors.values())
        self.answered += len(records) - failed
        self.errors += failed
        if len(records) > failed:
            metrics.count_answer(None, len(records) - failed)
        for code, count in errors.items():
            metrics.count_answer(code, count)
        if self.tracing is not None:
            for record in records:
                assert record.answer is not None  # as above: answered requests only
                self.tracing.request_served(record.input, record, record.answer, published)
        for record in records:
            record.drop_delivered()
