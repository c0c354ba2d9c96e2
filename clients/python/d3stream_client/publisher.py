"""Publishing decision requests: checked before they leave, keyed by id, acknowledged by the broker.

:class:`Publisher` runs the checks the worker would run on a request without its model (the schema, the
request limits, duplicate keys, the number of media references) and raises the worker's own
``invalid_request`` message before anything is sent. A request that passes is published keyed by its id
with the contract's headers, and the caller's ``traceparent`` when an OpenTelemetry span is active, so
the worker's spans join the caller's trace. Every ``publish`` returns once the broker has the record
(``acks=all``, idempotent), with where it landed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import msgspec
from aiokafka import AIOKafkaProducer

from d3stream_client.connection import start_client, without
from d3stream_client.contract import HEADERS, Label, Request
from d3stream_client.validation import DEFAULT_LIMITS, RequestLimits, validate_label, validate_request

# Sends in flight before the next is awaited: enough to fill batches, few enough to bound memory.
PIPELINE_DEPTH = 500
TRACE_HEADERS = ("traceparent", "tracestate")


class Published(NamedTuple):
    """Where a request record landed: the answer's ``source`` names the same three."""

    id: str
    topic: str
    partition: int
    offset: int


def trace_headers() -> list[tuple[str, bytes]]:
    """The W3C trace headers of the active OpenTelemetry span; none when OpenTelemetry is not in use."""
    if "opentelemetry" not in sys.modules:  # the application has not set tracing up: nothing to propagate
        return []
    try:
        from opentelemetry import propagate
    except ImportError:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(name, carrier[name].encode()) for name in TRACE_HEADERS if name in carrier]


def request_id(request: Request | dict[str, Any] | bytes, value: bytes) -> str:
    """The id of a request that passed validation (its key)."""
    if isinstance(request, Request):
        return request.id
    if isinstance(request, dict):
        return str(request["id"])
    return str(msgspec.json.decode(value)["id"])


class Publisher:
    """Publishes requests to one request topic. Use as ``async with Publisher(...) as publisher``.

    ``limits`` are the worker's request limits (its ``max_request_*`` and ``max_media_references``
    settings); the defaults are the worker's defaults. ``options`` go to aiokafka's producer as they are
    (security_protocol, ssl_context, sasl_*, client_id, ...).
    """

    def __init__(self, bootstrap_servers: str, topic: str = "d3.requests", *, limits: RequestLimits = DEFAULT_LIMITS,
                 **options: Any) -> None:
        self.topic = topic
        self.limits = limits
        self.producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", enable_idempotence=True,
                                         **without(options, "acks", "enable_idempotence", "bootstrap_servers"))
        self._started = False

    async def start(self) -> None:
        if not self._started:
            await start_client(self.producer)
            self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self.producer.stop()

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (from the cluster's metadata)."""
        await self.start()
        return len(await self.producer.partitions_for(topic))

    def prepared(self, request: Request | dict[str, Any] | bytes) -> tuple[bytes, bytes]:
        """(key, value) of a request that passes the worker's checks; EventError with its message otherwise."""
        value = validate_request(request, self.limits)
        return request_id(request, value).encode(), value

    async def publish(self, request: Request | dict[str, Any] | bytes) -> Published:
        """Check and publish one request; returns once the broker has acknowledged it."""
        return await self.publish_prepared(*self.prepared(request))

    async def publish_prepared(self, key: bytes, value: bytes) -> Published:
        """Publish a (key, value) that ``prepared`` returned; returns once the broker has acknowledged it."""
        return await _landed(key, await self._send(key, value))

    async def publish_many(self, requests: Iterable[Request | dict[str, Any] | bytes]) -> list[Published]:
        """Check every request first (nothing is sent when one fails), then publish them all, pipelined."""
        records = [self.prepared(request) for request in requests]
        published: list[Published] = []
        for start in range(0, len(records), PIPELINE_DEPTH):
            chunk = records[start:start + PIPELINE_DEPTH]
            published.extend(await asyncio.gather(*[_landed(key, await self._send(key, value)) for key, value in chunk]))
        return published

    async def publish_label(self, label: Label | dict[str, Any] | bytes) -> Published:
        """Check one label event against the schema (EventError ``invalid_label`` otherwise) and publish it keyed
        by its request id, on this publisher's topic (the label topic: ``Publisher(servers, "d3.labels")``), so
        it lands on the partition of its answer."""
        value = validate_label(label)
        key = str(msgspec.json.decode(value)["id"]).encode()
        return await self.publish_prepared(key, value)

    async def publish_raw(self, records: Iterable[tuple[bytes | None, bytes]],
                          on_sent: Callable[[], None] | None = None) -> int:
        """Publish (key, value) records as they are, unchecked: for replaying recorded bytes, or for testing
        how a worker treats records that are not requests. Returns how many were acknowledged."""
        count, pending = 0, []
        for key, value in records:
            pending.append(await self._send(key, value))
            count += 1
            if len(pending) >= PIPELINE_DEPTH:
                await asyncio.gather(*pending)
                pending.clear()
            if on_sent is not None:
                on_sent()
        await asyncio.gather(*pending)
        return count

    async def _send(self, key: bytes | None, value: bytes) -> asyncio.Future[Any]:
        """Hand one record to the producer; the future is resolved (with its RecordMetadata) when the broker
        acknowledges it."""
        await self.start()
        return await self.producer.send(self.topic, value=value, key=key, headers=HEADERS + trace_headers())


async def _landed(key: bytes, acknowledged: asyncio.Future[Any]) -> Published:
    """Where an acknowledged request record landed."""
    metadata = await acknowledged
    return Published(key.decode("utf-8", "replace"), metadata.topic, metadata.partition, metadata.offset)


async def produce(bootstrap_servers: str, topic: str, records: Iterable[tuple[bytes | None, bytes]], *,
                  security: dict[str, Any] | None = None, on_sent: Callable[[], None] | None = None) -> int:
    """Publish (key, value) records unchecked and wait until the broker has acknowledged all of them (what
    ``d3stream produce`` does with a JSON-lines file)."""
    async with Publisher(bootstrap_servers, topic, **(security or {})) as publisher:
        return await publisher.publish_raw(records, on_sent=on_sent)
