"""What the stream tests share: a per-test ``Stack`` of names on the session's broker and object store (the
``stack`` fixture), a background ``Reader`` of committed records, and helpers to run a ``Service`` in
process (``serve``, ``stop``) and to inspect topics and group offsets.

Registered as a pytest plugin in ``tests/conftest.py``, so the ``stack`` fixture needs no import.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.service import Service
from d3stream.settings import Settings

Q_NOUL = {"type": "noul", "instructions": "Is anything unusual visible?"}
Q_CHOICE = {"type": "choice", "criteria": {"left": "turn left", "right": "turn right", "stop": "stop here"}}
Q_SCORE = {"type": "score", "criteria": ["none", "low", "high"]}
TOLERANCE = 1e-2


@dataclass
class Stack:
    """This test's names on the shared broker and store."""

    broker: Any
    store: Any
    bucket: str
    requests: str
    answers: str
    dead_letters: str
    provenance: str
    group: str
    unique: Callable[[str], str]

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = dict(
            bootstrap_servers=self.broker.bootstrap_servers,
            request_topics=[self.requests],
            answer_topic=self.answers,
            dead_letter_topic=self.dead_letters,
            provenance_topic=self.provenance,
            group_id=self.group,
            client_id=self.group,
            s3_endpoint_url=self.store.endpoint_url,
            s3_region=self.store.region,
            media_allowlist=[self.bucket],
            linger_ms=20,
            commit_interval_ms=100,
            shutdown_timeout_s=60,
            rebalance_drain_s=10,
            metrics_port=None,
        )
        values.update(overrides)
        return Settings.from_flat(**values)

    def serve_command(self, checkpoint: Any, *options: str, bootstrap_servers: str | None = None) -> list[str]:
        """A ``d3stream serve`` command line on this stack's topics, group and bucket, plus ``options``."""
        return [
            sys.executable, "-m", "d3stream", "serve",
            "--model", str(checkpoint),
            "--bootstrap-servers", bootstrap_servers or self.broker.bootstrap_servers,
            "--request-topics", self.requests,
            "--answer-topic", self.answers,
            "--dead-letter-topic", self.dead_letters,
            "--provenance-topic", self.provenance,
            "--group-id", self.group,
            "--s3-endpoint-url", self.store.endpoint_url,
            "--media-allowlist", self.bucket,
            *options,
        ]

    def put(self, key: str, data: bytes) -> str:
        self.store.client().put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}"

    def path(self, key: str) -> str:
        """The HTTP path of an object of this test's bucket (path-style), as the proxy logs it."""
        return f"/{self.bucket}/{key}"

    def create_topics(self, request_partitions: int = 4) -> None:
        self.broker.create_topic(self.requests, request_partitions, exist_ok=True)
        self.broker.create_topic(self.answers, 4, exist_ok=True)
        self.broker.create_topic(self.dead_letters, 4, exist_ok=True)


@pytest.fixture
def stack(kafka_broker, object_store, s3_bucket, topic_names, unique_name, monkeypatch) -> Stack:
    # The service reads S3 credentials from the standard AWS chain only.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", object_store.secret_key)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    stack = Stack(
        broker=kafka_broker,
        store=object_store,
        bucket=s3_bucket,
        requests=topic_names("req"),
        answers=topic_names("ans"),
        dead_letters=topic_names("dlq"),
        provenance=topic_names("prov"),
        group=unique_name("grp"),
        unique=unique_name,
    )
    stack.create_topics()
    return stack


def close_to(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Two System One answers agree within TOLERANCE (question errors: the same code)."""
    assert got.keys() == want.keys(), where
    for key, expected in want.items():
        actual = got[key]
        label = f"{where}/{key}"
        if "error" in expected:
            assert actual.get("error") == expected["error"], label
            continue
        assert "error" not in actual, (label, actual)
        assert actual["type"] == expected["type"], label
        assert actual["probabilities"].keys() == expected["probabilities"].keys(), label
        for option, p in expected["probabilities"].items():
            assert abs(actual["probabilities"][option] - p) <= TOLERANCE, (label, option, actual, expected)
        kind = expected["type"]
        if kind in ("noul", "score"):
            assert abs(actual[kind] - expected[kind]) <= TOLERANCE * len(expected["probabilities"]), label
        elif kind == "choice":
            top = sorted(expected["probabilities"].values(), reverse=True)
            if len(top) < 2 or top[0] - top[1] > 2 * TOLERANCE:
                assert actual["choice"] == expected["choice"], label


class SlowModel:
    """The real model, with ``forward`` slowed down by ``delay_s`` so in-flight work piles up (or a stream lasts
    long enough to be interrupted); ``forward_calls`` counts the passes."""

    def __init__(self, model: Any, delay_s: float):
        self._model = model
        self.delay_s = delay_s
        self.forward_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, rows):
        self.forward_calls += 1
        time.sleep(self.delay_s)
        return self._model.forward(rows)


class GatedModel:
    """The real model, whose forward passes wait while the gate is closed (a worker stuck in a long pass)."""

    def __init__(self, model: Any):
        import threading

        self._model = model
        self.gate = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, rows):
        if not self.gate.wait(120):
            raise RuntimeError("the test never opened the gate")
        return self._model.forward(rows)


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the OS picks it): for a second broker's listeners, a metrics
    endpoint, or an address nobody listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record(request: dict[str, Any]) -> tuple[bytes, bytes]:
    return request["id"].encode(), json.dumps(request).encode()


class Reader:
    """Reads a topic from the beginning in the background (every partition, committed records only).

    ``seen_at[id]`` is when (monotonic) the first answer of each id was read.
    """

    def __init__(self, bootstrap: str, topic: str, partitions: int = 4, *, security: dict[str, Any] | None = None,
                 isolation_level: str = "read_committed"):
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.security = security or {}
        self.isolation_level = isolation_level
        self.records: list[Any] = []
        self.seen_at: dict[str, float] = {}
        self.next_offset: dict[int, int] = {}
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Reader:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=self.isolation_level,
            **self.security,
        )
        await self.consumer.start()
        self.consumer.assign([TopicPartition(self.topic, p) for p in range(self.partitions)])
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        await self.consumer.stop()

    async def _loop(self) -> None:
        while True:
            try:
                batches = await self.consumer.getmany(timeout_ms=100)
                for records in batches.values():
                    for item in records:
                        self.records.append(item)
                        try:
                            rid = json.loads(item.value).get("id")
                        except (ValueError, AttributeError):
                            rid = None
                        self.seen_at.setdefault(rid, time.monotonic())
                # Positions, not record offsets: transaction markers take offsets too.
                for tp in self.consumer.assignment():
                    self.next_offset[tp.partition] = await self.consumer.position(tp)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a broker restart: keep reading
                await asyncio.sleep(0.2)

    def answers(self) -> list[dict[str, Any]]:
        return [json.loads(r.value) for r in self.records]

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {a["id"]: a for a in self.answers()}

    def counts(self) -> collections.Counter:
        return collections.Counter(a["id"] for a in self.answers())

    async def wait(self, predicate: Callable[[], bool], timeout: float, *tasks: asyncio.Task, what: str = "") -> None:
        """Until ``predicate()``; fails early when a service task ended by itself."""
        deadline = time.monotonic() + timeout
        while not predicate():
            for task in tasks:
                if task.done():
                    task.result()  # raises what the service raised
                    raise AssertionError(f"a service stopped by itself while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; have {len(self.records)}")
            await asyncio.sleep(0.05)

    async def wait_ids(self, ids: Iterable[str], timeout: float, *tasks: asyncio.Task) -> None:
        ids = set(ids)
        await self.wait(lambda: ids <= set(self.counts()), timeout, *tasks,
                        what=f"answers to {len(ids)} ids (missing {sorted(ids - set(self.counts()))[:5]})")

    async def caught_up(self, timeout: float = 30) -> None:
        """Until everything on the topic now has been read. A read_committed reader's end is the last stable
        offset, which lags for a moment behind a transaction that was just committed (its markers are
        written after the commit returns): so read on until the stable end reaches the log end, or the
        timeout passes (a transaction left open, by a killed worker say, holds it back longer)."""
        from aiokafka import TopicPartition

        partitions = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        deadline = time.monotonic() + timeout
        while True:
            ends = await self.consumer.end_offsets(partitions)
            await self.wait(
                lambda ends=ends: all(self.next_offset.get(tp.partition, 0) >= end for tp, end in ends.items() if end),
                max(0.1, deadline - time.monotonic()),
                what="the end of the topic",
            )
            stable = self.isolation_level != "read_committed" or all(
                (self.consumer.highwater(tp) or 0) <= end for tp, end in ends.items()
            )
            if stable or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)


async def stop(service: Service, task: asyncio.Task, timeout: float = 90) -> None:
    service.stop()
    await asyncio.wait_for(task, timeout)


def assigned_and_ready(service: Service) -> bool:
    """The service has its partitions, and (exactly_once) a transactional producer for each of them."""
    if not service.ready or service.consumer is None:
        return False
    assignment = service.consumer.assignment()
    producers = getattr(service.delivery, "producers", None)
    return bool(assignment) and (producers is None or all(tp in producers for tp in assignment))


async def serve(stack: Stack, settings: Settings, model: Any, records: list[tuple[bytes | None, bytes]],
                ids: Iterable[str], *, timeout: float = 90,
                during: Callable[[Service, Reader, asyncio.Task], Any] | None = None,
                **service_options: Any) -> tuple[Service, Reader]:
    """Run one service, publish ``records`` once it is assigned and ready (so the test knows what the service
    saw first), wait until every id of ``ids`` is answered, stop it, read to the end. ``service_options`` go to
    ``Service`` (e.g. ``tracing``)."""
    bootstrap = stack.broker.bootstrap_servers
    service = Service(settings, model, **service_options)
    async with Reader(bootstrap, stack.answers) as reader:
        task = asyncio.create_task(service.run())
        try:
            await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the service's assignment")
            await produce(bootstrap, stack.requests, records)
            if during is not None:
                await during(service, reader, task)
            await reader.wait_ids(ids, timeout, task)
        finally:
            await stop(service, task)
        await reader.caught_up()
    return service, reader


async def read_all(bootstrap: str, topic: str, partitions: int = 1) -> list[Any]:
    async with Reader(bootstrap, topic, partitions) as reader:
        await reader.caught_up()
        return list(reader.records)


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {
        p: offsets[TopicPartition(topic, p)].offset
        for p in range(partitions)
        if TopicPartition(topic, p) in offsets and offsets[TopicPartition(topic, p)].offset >= 0
    }


def run(coroutine):
    return asyncio.run(coroutine)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample a metrics endpoint at ``url`` serves, keyed by (sample name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
