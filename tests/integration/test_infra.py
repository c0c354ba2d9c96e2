"""The local test stack is real: Kafka (transactions, restarts) and S3 (ETags, restarts) behave as in production."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from d3stream.dev.infra import JVM_OPTIONS_ENV, KafkaBroker, ObjectStore, class_data
from d3stream.dev.infra.class_data import ARCHIVES_ENV
from d3stream.dev.infra.jars import _jvm_options

pytestmark = pytest.mark.timeout(180)


async def _consume(
    broker: KafkaBroker,
    topic: str,
    group: str,
    want: int,
    *,
    read_committed: bool = False,
    timeout: float = 30,
) -> list[tuple[bytes | None, bytes | None]]:
    """Read ``want`` records from the start of ``topic`` (or whatever arrived when ``timeout`` runs out)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap_servers,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
    )
    await consumer.start()
    got: list[tuple[bytes | None, bytes | None]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(got) < want and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                got.extend((r.key, r.value) for r in records)
    finally:
        await consumer.stop()
    return got


def test_kafka_produce_consume(kafka_broker: KafkaBroker, topic_names: Callable[[str], str]) -> None:
    from aiokafka import AIOKafkaProducer

    topic = topic_names("plain")
    kafka_broker.create_topic(topic, partitions=2)

    async def run() -> list[tuple[bytes | None, bytes | None]]:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"hello", key=b"k1")
        finally:
            await producer.stop()
        return await _consume(kafka_broker, topic, f"{topic}-g", want=1)

    assert asyncio.run(run()) == [(b"k1", b"hello")]


def test_kafka_transactions_read_committed(
    kafka_broker: KafkaBroker, topic_names: Callable[[str], str]
) -> None:
    """A read_committed consumer sees the committed transaction and never the aborted one."""
    from aiokafka import AIOKafkaProducer

    topic = topic_names("txn")
    kafka_broker.create_topic(topic, partitions=1)

    async def run() -> list[tuple[bytes | None, bytes | None]]:
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_broker.bootstrap_servers,
            transactional_id=f"{topic}-tx",
            enable_idempotence=True,
        )
        await producer.start()
        try:
            async with producer.transaction():
                await producer.send_and_wait(topic, b"committed", key=b"a")
            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"aborted", key=b"b")
            await producer.abort_transaction()
            async with producer.transaction():
                await producer.send_and_wait(topic, b"after-abort", key=b"c")
        finally:
            await producer.stop()
        return await _consume(kafka_broker, topic, f"{topic}-g", want=2, read_committed=True)

    assert asyncio.run(run()) == [(b"a", b"committed"), (b"c", b"after-abort")]


def test_kafka_restart_keeps_data(kafka_broker: KafkaBroker, topic_names: Callable[[str], str]) -> None:
    from aiokafka import AIOKafkaProducer

    topic = topic_names("restart")
    kafka_broker.create_topic(topic, partitions=1)
    address, pid = kafka_broker.bootstrap_servers, kafka_broker.pid

    async def produce(value: bytes) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topic, value)
        finally:
            await producer.stop()

    asyncio.run(produce(b"before"))
    kafka_broker.restart()
    assert kafka_broker.bootstrap_servers == address
    assert kafka_broker.pid not in (None, pid)
    asyncio.run(produce(b"after"))
    got = asyncio.run(_consume(kafka_broker, topic, f"{topic}-g", want=2))
    assert [v for _, v in got] == [b"before", b"after"]


def test_object_store_put_get_etag(object_store: ObjectStore, s3_bucket: str) -> None:
    s3 = object_store.client()
    body = b"\x00d3stream\xff" * 1000
    put = s3.put_object(Bucket=s3_bucket, Key="media/frame 0.bin", Body=body)
    assert put["ETag"].strip('"') == hashlib.md5(body).hexdigest()
    got = s3.get_object(Bucket=s3_bucket, Key="media/frame 0.bin")
    assert got["ETag"] == put["ETag"]
    assert got["Body"].read() == body
    part = s3.get_object(Bucket=s3_bucket, Key="media/frame 0.bin", Range="bytes=1-8")
    assert part["Body"].read() == body[1:9]


def test_object_store_restart_keeps_objects(object_store: ObjectStore, s3_bucket: str) -> None:
    from botocore.exceptions import EndpointConnectionError

    s3 = object_store.client(retries={"max_attempts": 1}, connect_timeout=2)
    put = s3.put_object(Bucket=s3_bucket, Key="k", Body=b"persist me")
    object_store.stop()
    try:
        with pytest.raises(EndpointConnectionError):
            s3.get_object(Bucket=s3_bucket, Key="k")
    finally:
        object_store.start()
    got = s3.get_object(Bucket=s3_bucket, Key="k")
    assert got["Body"].read() == b"persist me"
    assert got["ETag"] == put["ETag"]


def test_both_servers_start_with_the_extra_jvm_options(
    kafka_broker: KafkaBroker, object_store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``D3STREAM_EMBEDDED_JVM_OPTIONS`` reaches both JVMs (the suite sets C1-only compiling in tests/conftest.py),
    after the defaults, so a flag given there wins over a default of the same name."""
    wanted = _jvm_options()
    assert wanted, "tests/conftest.py sets the option for the suite's servers"
    for server in (kafka_broker, object_store):
        with open(f"/proc/{server.pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().decode().split("\0")
        assert all(flag in arguments for flag in wanted), arguments[:12]
        assert arguments.index(wanted[0]) > next(i for i, a in enumerate(arguments) if a.startswith("-Xmx"))
    monkeypatch.setenv(JVM_OPTIONS_ENV, "-Xmx1g  -Dd3stream.note='two words'")
    assert _jvm_options() == ["-Xmx1g", "-Dd3stream.note=two words"]


def _mapped(pid: int, path: Path) -> bool:
    """Whether the process has ``path`` mapped into its memory (a JVM maps the class-data archive it uses)."""
    with open(f"/proc/{pid}/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


def test_a_server_writes_its_class_data_archive_on_a_clean_exit_and_starts_from_it_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With archives asked for (the suite asks), a server's first start writes the archive of its classes when it
    exits cleanly, and the next start maps it; a killed server's archive is never taken (it may be half
    written)."""
    monkeypatch.setenv(ARCHIVES_ENV, "1")
    monkeypatch.setattr(class_data, "archive_folder", lambda: tmp_path / "archives")
    store = ObjectStore(tmp_path / "store")
    try:
        store.start()
        store.kill()
        assert not list((tmp_path / "archives").glob("*")), "a killed JVM's archive was kept"
        store.start()
        assert store.pid is not None
        store.stop()
        archives = list((tmp_path / "archives").glob("*.jsa"))
        assert len(archives) == 1 and not list((tmp_path / "archives").glob("*.partial")), archives
        store.start()
        assert store.pid is not None and _mapped(store.pid, archives[0]), "the second start did not use the archive"
        s3 = store.client()
        s3.create_bucket(Bucket="after-the-archive")  # and it serves
        assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["after-the-archive"]
    finally:
        store.close()
