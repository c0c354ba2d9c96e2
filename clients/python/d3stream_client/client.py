"""One object for a service on either side of d3stream: publish, ask, subscribe.

    async with D3Client("kafka:9092") as client:
        answer = await client.ask({"id": "ticket-4312", "state": "...", "questions": {...}}, timeout=30)

``D3Client`` holds one producer and, once the first ``ask`` needs it, one answer consumer for the whole
process; subscriptions have consumers of their own (they belong to a consumer group). ``connection``
keyword arguments go to every aiokafka client it makes (security_protocol, ssl_context, sasl_mechanism,
sasl_plain_username, sasl_plain_password, client_id, ...).

``registry=RegistryFormat(...)`` (``d3stream_client.registry``, the ``[registry]`` extra) publishes requests
in a Schema Registry's wire format and reads answers framed or plain; the client does not close it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from d3stream_client.asking import AnswerWaiter
from d3stream_client.contract import Answer, Request
from d3stream_client.publisher import Published, Publisher
from d3stream_client.subscriber import DEDUPE_WINDOW, AnswerSubscription
from d3stream_client.validation import DEFAULT_LIMITS, RequestLimits

if TYPE_CHECKING:  # imported for its type only: the registry code needs the [registry] extra
    from d3stream_client.registry import RegistryFormat


class D3Client:
    """Requests to ``request_topic``, answers from ``answer_topic``; ``worker_group`` is the workers' consumer
    group (read only to explain a timed-out ask). ``limits`` are the workers' request limits. ``registry``
    frames requests for a Schema Registry and reads framed answers (module docstring)."""

    def __init__(self, bootstrap_servers: str, *, request_topic: str = "d3.requests",
                 answer_topic: str = "d3.answers", worker_group: str = "d3stream",
                 limits: RequestLimits = DEFAULT_LIMITS, registry: RegistryFormat | None = None,
                 **connection: Any) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.answer_topic = answer_topic
        self.connection = connection
        self.registry = registry
        self.publisher = Publisher(bootstrap_servers, request_topic, limits=limits, registry=registry, **connection)
        self.waiter = AnswerWaiter(bootstrap_servers, answer_topic, partitions=self.publisher.partitions,
                                   worker_group=worker_group, registry=registry, **connection)

    async def __aenter__(self) -> D3Client:
        await self.publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self.waiter.close()
        finally:
            await self.publisher.stop()

    async def publish(self, request: Request | dict[str, Any] | bytes) -> Published:
        """Check and publish one request (``Publisher.publish``)."""
        return await self.publisher.publish(request)

    async def publish_many(self, requests: list[Request | dict[str, Any] | bytes]) -> list[Published]:
        """Check all, then publish all (``Publisher.publish_many``)."""
        return await self.publisher.publish_many(requests)

    async def ask(self, request: Request | dict[str, Any] | bytes, *, timeout: float = 30.0) -> Answer:
        """Publish ``request`` and return its answer; ``AskTimeout`` saying what is known after ``timeout`` s,
        EventError (the worker's own message) when the request would be refused."""
        key, value = await self.publisher.record(request)

        async def publish() -> Published:
            return await self.publisher.publish_prepared(key, value)

        return await self.waiter.ask(key.decode(), publish, timeout)

    def answers(self, group_id: str, *, topic: str | None = None, dedupe_window: int = DEDUPE_WINDOW,
                auto_offset_reset: str = "earliest") -> AnswerSubscription:
        """``async for answer in client.answers(group_id="billing-router")``: each answer once, its offset
        committed when the loop body is done with it (``AnswerSubscription``)."""
        return AnswerSubscription(self.bootstrap_servers, topic or self.answer_topic, group_id,
                                  dedupe_window=dedupe_window, auto_offset_reset=auto_offset_reset,
                                  registry=self.registry, **self.connection)
