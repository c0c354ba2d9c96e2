"""Publishing decision requests: checked before they leave, keyed by id, acknowledged by the broker.

:class:`Publisher` runs the checks the worker would run on a request without its model (the schema, the
request limits, duplicate keys, the number of media references) and raises the worker's own
``invalid_request`` message before anything is sent. A request that passes is published keyed by its id
with the contract's headers, and the caller's ``traceparent`` when an OpenTelemetry span is active, so
the worker's spans join the caller's trace. Every ``publish`` returns once the broker has the record
(``acks=all``, idempotent), with where it landed.

Given a ``registry`` (``d3stream_client.registry.RegistryFormat``, the ``[registry]`` extra), a request that
passed the same checks is written in the Schema Registry's wire format (Avro or JSON Schema) instead of plain
JSON. Without one nothing of the registry is imported.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from aiokafka import AIOKafkaProducer

from d3stream_client.connection import start_client, without
from d3stream_client.contract import HEADERS, Label, Request
from d3stream_client.validation import DEFAULT_LIMITS, RequestLimits, validate_label, validate_request

if TYPE_CHECKING:  # imported for its type only: the registry code needs the [registry] extra
    from d3stream_client.registry import RegistryFormat

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
    settings); the defaults are the worker's defaults. ``registry`` writes requests in a Schema Registry's wire
    format (module docstring). ``options`` go to aiokafka's producer as they are (security_protocol,
    ssl_context, sasl_*, client_id, ...).
    """

    def __init__(self, bootstrap_servers: str, topic: str = "d3.requests", *, limits: RequestLimits = DEFAULT_LIMITS,
                 registry: RegistryFormat | None = None, **options: Any) -> None:
        self.topic = topic
        self.limits = limits
        self.registry = registry
        # A framed request says so in its content type, as the worker's framed answers do.
        self.headers = HEADERS if registry is None else [
            (name, registry.content_type if name == "content-type" else value) for name, value in HEADERS]
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
        """(key, JSON value) of a request that passes the worker's checks; EventError with its message otherwise."""
        value = validate_request(request, self.limits)
        return request_id(request, value).encode(), value

    async def record(self, request: Request | dict[str, Any] | bytes) -> tuple[bytes, bytes]:
        """(key, value) of the record that carries a request: checked (``prepared``), then framed for the
        registry when this publisher has one (``RegistryError`` when the registry lacks the schema)."""
        key, value = self.prepared(request)
        return key, await self._framed(value)

    async def publish(self, request: Request | dict[str, Any] | bytes) -> Published:
        """Check and publish one request; returns once the broker has acknowledged it."""
        return await self.publish_prepared(*await self.record(request))

    async def publish_prepared(self, key: bytes, value: bytes) -> Published:
        """Publish a (key, value) that ``record`` returned; returns once the broker has acknowledged it."""
        return await _landed(key, await self._send(key, value, self.headers))

    async def publish_many(self, requests: Iterable[Request | dict[str, Any] | bytes]) -> list[Published]:
        """Check every request first, then write each in the registry's format when there is one (nothing is
        sent when one fails either), then publish them all, pipelined."""
        records = [self.prepared(request) for request in requests]
        if self.registry is not None:
            records = [(key, await self._framed(value)) for key, value in records]
        published: list[Published] = []
        for start in range(0, len(records), PIPELINE_DEPTH):
            chunk = records[start:start + PIPELINE_DEPTH]
            published.extend(await asyncio.gather(*[_landed(key, await self._send(key, value, self.headers))
                                                    for key, value in chunk]))
        return published

    async def publish_label(self, label: Label | dict[str, Any] | bytes) -> Published:
        """Check one label event against the schema (EventError ``invalid_label`` otherwise) and publish it keyed
        by its request id, on this publisher's topic (the label topic: ``Publisher(servers, "d3.labels")``), so
        it lands on the partition of its answer."""
        value = validate_label(label)
        key = str(msgspec.json.decode(value)["id"]).encode()
        return await _landed(key, await self._send(key, value, HEADERS))  # labels are JSON, registry or not

    async def publish_raw(self, records: Iterable[tuple[bytes | None, bytes]],
                          on_sent: Callable[[], None] | None = None) -> int:
        """Publish (key, value) records as they are, unchecked: for replaying recorded bytes, or for testing
        how a worker treats records that are not requests. Returns how many were acknowledged."""
        count, pending = 0, []
        for key, value in records:
            pending.append(await self._send(key, value, HEADERS))
            count += 1
            if len(pending) >= PIPELINE_DEPTH:
                await asyncio.gather(*pending)
                pending.clear()
            if on_sent is not None:
                on_sent()
        await asyncio.gather(*pending)
        return count

    async def _framed(self, value: bytes) -> bytes:
        """A checked request's JSON value, in the registry's wire format when this publisher has a registry."""
        return value if self.registry is None else await self.registry.encode_request(value, self.topic)

    async def _send(self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> asyncio.Future[Any]:
        """Hand one record to the producer; the future is resolved (with its RecordMetadata) when the broker
        acknowledges it."""
        await self.start()
        return await self.producer.send(self.topic, value=value, key=key, headers=headers + trace_headers())


async def _landed(key: bytes, acknowledged: asyncio.Future[Any]) -> Published:
    """Where an acknowledged request record landed."""
    metadata = await acknowledged
    return Published(key.decode("utf-8", "replace"), metadata.topic, metadata.partition, metadata.offset)


async def produce(bootstrap_servers: str, topic: str, records: Iterable[tuple[bytes | None, bytes]], *,
                  security: dict[str, Any] | None = None, on_sent: Callable[[], None] | None = None,
                  registry: RegistryFormat | None = None) -> int:
    """Publish (key, value) records unchecked and wait until the broker has acknowledged all of them (what
    ``d3stream produce`` does with a JSON-lines file). With a ``registry`` every value must be a request: all
    are checked and framed before any is sent (only a request has an Avro form), keyed by their ids."""
    async with Publisher(bootstrap_servers, topic, registry=registry, **(security or {})) as publisher:
        if registry is None:
            return await publisher.publish_raw(records, on_sent=on_sent)
        published = await publisher.publish_many([value for _, value in records])
        if on_sent is not None:  # acknowledged all together: the progress moves at the end
            for _ in published:
                on_sent()
        return len(published)
