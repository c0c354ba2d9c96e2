"""Small Kafka and S3 clients for people and tests: publish requests, upload media, read answers.

``produce`` publishes JSON lines as request events (keyed by their ``id``), optionally uploading the
local media files a request names and rewriting them to ``s3://`` references first. ``consume_answers``
reads answer events (committed ones only) until it has what it was asked for or a timeout passes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from d3stream.core.events import HEADERS
from d3stream.runtime.kinds import MEDIA_KINDS


def upload_media(client: Any, bucket: str, path: Path) -> str:
    """Store a local file under a content-addressed key and return its ``s3://`` reference."""
    data = path.read_bytes()
    key = f"media/{hashlib.sha256(data).hexdigest()[:16]}/{path.name}"
    client.put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def rewrite_media(request: dict[str, Any], client: Any, bucket: str, base: Path) -> dict[str, Any]:
    """The request with every local media path uploaded and replaced by its ``s3://`` reference."""
    for kind in MEDIA_KINDS:
        field = kind.request_attribute
        values = request.get(field)
        if not isinstance(values, list):
            continue
        rewritten = []
        for value in values:
            candidate = (base / value) if isinstance(value, str) and not value.startswith(("s3://", "data:")) else None
            rewritten.append(upload_media(client, bucket, candidate) if candidate and candidate.is_file() else value)
        request[field] = rewritten
    return request


def encode_line(line: str) -> tuple[bytes | None, bytes]:
    """(key, value) of one JSON line; a line that is not a JSON object is sent verbatim without a key."""
    try:
        document = json.loads(line)
    except json.JSONDecodeError:
        return None, line.encode("utf-8", "surrogateescape")
    key = document.get("id") if isinstance(document, dict) else None
    return (str(key).encode() if key is not None else None), line.encode("utf-8")


async def _start(client: Any) -> None:
    """Start an aiokafka client; one that cannot connect is closed before the error goes on."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


async def produce(
    bootstrap_servers: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    security: dict[str, Any] | None = None,
    on_sent: Callable[[], None] | None = None,
) -> int:
    """Publish (key, value) records and wait until the broker has acknowledged all of them."""
    from aiokafka import AIOKafkaProducer

    # ``security``: the connection's other keyword arguments (connection.client_options), which may also
    # carry kafka_options tuning values
    producer = AIOKafkaProducer(
        **{"bootstrap_servers": bootstrap_servers, "acks": "all", "enable_idempotence": True, **(security or {})}
    )
    await _start(producer)
    count = 0
    try:
        pending = []
        for key, value in records:
            pending.append(await producer.send(topic, value=value, key=key, headers=HEADERS))
            count += 1
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending.clear()
            if on_sent:
                on_sent()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return count


async def consume_answers(
    bootstrap_servers: str,
    topic: str,
    *,
    expected: int | None = None,
    timeout_s: float = 60.0,
    idle_s: float | None = None,
    security: dict[str, Any] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """Committed answer events of ``topic`` from the beginning, until ``expected`` distinct ids are seen,
    ``stop()`` says so, ``idle_s`` passes without a new record, or ``timeout_s`` passes."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, **{
        "bootstrap_servers": bootstrap_servers,
        "group_id": None,
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        "isolation_level": "read_committed",
        **(security or {}),
    })
    await _start(consumer)
    answers: list[dict[str, Any]] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            if expected is not None and len(seen) >= expected:
                break
            if stop is not None and stop():
                break
            if idle_s is not None and time.monotonic() - last > idle_s:
                break
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    answer = json.loads(record.value)
                    answers.append(answer)
                    seen.add(answer.get("id"))
                    last = time.monotonic()
                    if on_record:
                        on_record(answer)
    finally:
        await consumer.stop()
    return answers
