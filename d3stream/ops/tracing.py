"""Request headers that travel to the answer, and optional OpenTelemetry traces of each request.

**Headers.** A producer that traces its requests sets W3C ``traceparent`` / ``tracestate`` headers on the
request record; the answer record carries them back (beside ``content-type`` and ``d3stream-schema``), with
any other header named in ``forward_headers``, so a consumer of the answers can join each one to the trace
of the request it answers. Whoever publishes requests is untrusted: only the first occurrence of each
allowed name travels, within ``forward_headers_max_bytes`` in all (the trace headers first), so an answer
stays a bounded size under its topic's message limit.

**Traces** (``otlp_endpoint``; off by default; needs the ``otel`` extra). Each request gets one span, a
child of its ``traceparent`` when the record has one, with a child span per stage it went through (fetch,
decode, prepare, queue, forward, publish) and the forward passes that carried it as attributes. The spans
are built after the answer is handed to delivery, from the start times and durations the service records
for the answer's ``provenance.timings`` anyway: with tracing off the service makes no span objects and the
only extra work per request is one ``if``. In ``exactly_once`` delivery the ``publish`` span is the hand-over
to the partition's transaction; the answer becomes visible when that commits (``commit_interval_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

import structlog

from d3stream import __version__

if TYPE_CHECKING:
    from d3stream_client.contract import Answer, BatchRecord, Timings
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.util.types import AttributeValue

    from d3stream.settings import DeliverySettings, ObservabilitySettings

log = structlog.get_logger(__name__)

# Forwarded whatever forward_headers says: the W3C Trace Context headers.
TRACE_HEADERS = ("traceparent", "tracestate")


def forwarded_headers(incoming: Sequence[tuple[str, bytes | None]] | None, names: Sequence[str],
                      max_bytes: int) -> list[tuple[str, bytes]]:
    """The request headers an answer carries: the first occurrence of each of ``names`` (in that order of
    priority) whose name and value fit in what is left of ``max_bytes``."""
    if not incoming:
        return []
    found: dict[str, bytes] = {}
    for name, value in incoming:
        if value is not None and name in names and name not in found:
            found[name] = value
    kept: list[tuple[str, bytes]] = []
    left = max_bytes
    for name in names:
        value = found.get(name)
        if value is None:
            continue
        size = len(name.encode()) + len(value)
        if size > left:
            log.debug("request header not forwarded: over forward_headers_max_bytes", header=name, bytes=size)
            continue
        kept.append((name, value))
        left -= size
    return kept


def header_names(forward_headers: Sequence[str]) -> tuple[str, ...]:
    """The trace headers, then the configured ones, each once."""
    return tuple(dict.fromkeys((*TRACE_HEADERS, *forward_headers)))


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint given as a collector's base address gets the traces path."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


class ReadRecord(Protocol):
    """Where a served request was read (``core.seams.InputRecord``, an aiokafka record, is one)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...


class ServedWork(Protocol):
    """What the service recorded of a request on its way (``core.record.RequestRecord`` is one): the passes
    that carried it, its stage durations (ms) and the perf_counter second each stage started at (0: not
    reached)."""

    @property
    def batch(self) -> BatchRecord: ...
    @property
    def timings(self) -> Timings: ...
    @property
    def media(self) -> Sized: ...
    @property
    def tokens(self) -> int: ...
    @property
    def received(self) -> float: ...
    @property
    def fetch_at(self) -> float: ...
    @property
    def decode_at(self) -> float: ...
    @property
    def prepare_at(self) -> float: ...
    @property
    def submitted_at(self) -> float: ...
    @property
    def publish_at(self) -> float: ...


class Tracing:
    """Spans of served requests, exported through an OpenTelemetry SDK tracer provider of this worker's own
    (the process's global provider is left alone)."""

    def __init__(self, *, endpoint: str | None = None, exporter: SpanExporter | None = None,
                 group_id: str | None = None):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError(
                "otlp_endpoint needs the OpenTelemetry SDK and OTLP exporter: pip install 'd3stream[otel]' "
                "(or unset otlp_endpoint)"
            ) from exc
        import os

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor: SpanProcessor = BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint or "")))
        else:  # a test's in-memory exporter: every span at once, in order
            processor = SimpleSpanProcessor(exporter)
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, say what this worker is called.
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "d3stream"}
        self.provider = TracerProvider(resource=Resource.create({**attributes, "service.version": __version__}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("d3stream", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.group_id = group_id
        self._failed = False

    @classmethod
    def from_settings(cls, observability: ObservabilitySettings,
                      delivery: DeliverySettings) -> Tracing | None:
        """Tracing to ``otlp_endpoint``, its spans naming the consumer group; none when it is unset."""
        if not observability.otlp_endpoint:
            return None
        return cls(endpoint=observability.otlp_endpoint, group_id=delivery.group_id)

    def request_served(self, record: ReadRecord, work: ServedWork, answer: Answer, finished: float) -> None:
        """The spans of one request, from ``work``'s recorded stage starts and durations (perf_counter
        seconds; ``finished``: when delivery took the answer). Never raises into the service."""
        try:
            self._spans(record, work, answer, finished)
        except Exception as exc:  # noqa: BLE001 - a tracing fault must not fail the request
            if not self._failed:
                self._failed = True
                log.warning("request span not recorded", error=f"{type(exc).__name__}: {exc}")

    def _spans(self, record: ReadRecord, work: ServedWork, answer: Answer, finished: float) -> None:
        from opentelemetry import trace

        to_ns = _clock(time.time_ns() - time.perf_counter_ns())
        carrier = {name: value.decode("latin-1") for name, value in (record.headers or ()) if name in TRACE_HEADERS
                   and value is not None}
        parent = self.propagator.extract(carrier) if carrier else None
        batch = work.batch
        batch_attributes: dict[str, AttributeValue] = {
            "d3stream.batch.passes": batch.passes,
            "d3stream.batch.rows": batch.rows,
            "d3stream.batch.real_tokens": batch.real_tokens,
            "d3stream.batch.padded_tokens": batch.padded_tokens,
            "d3stream.batch.shared_prefix": batch.shared_prefix,
            "d3stream.batch.saved_tokens": batch.saved_tokens,
        }
        attributes: dict[str, AttributeValue] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": record.topic,
            "messaging.destination.partition.id": str(record.partition),
            "messaging.kafka.offset": record.offset,
            "d3stream.request.id": answer.id,
            "d3stream.answer_id": answer.answer_id or "",
            "d3stream.model": answer.model,
            **batch_attributes,
        }
        if self.group_id:
            attributes["messaging.consumer.group.name"] = self.group_id
        if answer.error is not None:
            attributes["error.type"] = answer.error.code
        span = self.tracer.start_span(f"process {record.topic}", context=parent, kind=trace.SpanKind.CONSUMER,
                                      attributes=attributes, start_time=to_ns(work.received))
        if answer.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{answer.error.code}: {answer.error.message[:200]}"))
        inside = trace.set_span_in_context(span)
        timings = work.timings
        stages: list[tuple[str, float, float, Mapping[str, AttributeValue]]] = [
            ("fetch", work.fetch_at, timings.fetch / 1e3, {"d3stream.media.count": len(work.media)}),
            ("decode", work.decode_at, timings.decode / 1e3, {}),
            ("prepare", work.prepare_at, timings.prepare / 1e3, {"d3stream.tokens": work.tokens}),
            ("queue", work.submitted_at, timings.queued / 1e3, batch_attributes),
            ("forward", work.submitted_at + timings.queued / 1e3, timings.forward / 1e3, batch_attributes),
            ("publish", work.publish_at, max(0.0, finished - work.publish_at) if work.publish_at else 0.0, {}),
        ]
        for name, started, seconds, extra in stages:
            if not started:  # the request never reached this stage
                continue
            stage = self.tracer.start_span(name, context=inside, attributes=extra, start_time=to_ns(started))
            stage.end(end_time=to_ns(started + seconds))
        span.end(end_time=to_ns(finished))

    def flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


def _clock(offset_ns: int) -> Callable[[float], int]:
    """perf_counter seconds -> epoch nanoseconds, for spans built after the fact."""
    return lambda seconds: int(seconds * 1e9) + offset_ns
