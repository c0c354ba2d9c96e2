"""Requests and answers through a Schema Registry (Apicurio, Confluent's API), with clients nobody here wrote.

confluent-kafka's producer with its Avro and JSON Schema serializers publishes requests beside plain JSON ones;
the worker answers them all alike. Its answers, written as Avro or JSON Schema, are read by confluent-kafka's
consumer with the matching deserializer, read_committed. An unknown schema id is dead-lettered naming the id;
a registry outage makes the stream wait, not fail; a schema change the registry refuses stops the worker at
start.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import Schema, topic_record_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from d3stream_client import avro
from d3stream_client.contract import Answer, DeadLetter, Request
from d3stream_client.publisher import produce

from d3stream.dev.infra import SchemaRegistry
from d3stream.kafka.registry import registry_json_schema
from d3stream.ops.metrics import MetricsServer
from d3stream.service import Service
from tests.support.foreign_serdes import (
    avro_deserializer,
    avro_serializer,
    json_deserializer,
    json_serializer,
    registry_client,
)
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    Stack,
    assigned_and_ready,
    close_to,
    record,
    run,
    serve,
    stop,
)

pytestmark = pytest.mark.timeout(300)

STATE = {"speed": 12.5, "lane": "left", "signals": [1, 2, 3]}


def _request(request_id: str, **extra: object) -> dict[str, object]:
    return {"id": request_id, "state": STATE, "questions": {"n": Q_NOUL, "c": Q_CHOICE, "s": Q_SCORE},
            "metadata": {"origin": "test"}, **extra}


def _context(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


def _avro_serializer(registry: SchemaRegistry, schema: Mapping[str, object] | None = None) -> AvroSerializer:
    return avro_serializer(registry_client(registry.url), json.dumps(schema or avro.avro_schema(Request)),
                           lambda document, _: avro.to_avro(document, Request))


def _json_serializer(registry: SchemaRegistry) -> JSONSerializer:
    # Under a subject of its own (topic and record name): the topic's own subject holds the Avro versions.
    return json_serializer(registry_client(registry.url), json.dumps(registry_json_schema(Request)),
                           conf={"subject.name.strategy": topic_record_subject_name_strategy})


def _publish(bootstrap: str, topic: str, values: list[tuple[str, bytes]]) -> None:
    """confluent-kafka's producer (librdkafka) publishes the records, keyed by request id."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for key, value in values:
        producer.produce(topic, key=key.encode(), value=value)
    assert producer.flush(30) == 0


def _settings(stack: Stack, registry: SchemaRegistry, **overrides: object) -> Any:
    return stack.settings(schema_registry_url=registry.url, **overrides)


def test_framed_requests_are_answered_like_json_ones(stack: Stack, schema_registry: SchemaRegistry,
                                                      qwen35_model: Any) -> None:
    """Avro, JSON Schema and plain JSON requests on one topic; a v2 request schema with an added optional
    field beside v1: every request answered once, the same questions alike."""
    topic = stack.requests
    as_avro = _avro_serializer(schema_registry)
    v2 = avro.avro_schema(Request)
    v2 = {**v2, "fields": [*v2["fields"], {"name": "channel", "type": ["null", "string"], "default": None}]}  # type: ignore[misc]
    as_avro_v2 = avro_serializer(registry_client(schema_registry.url), json.dumps(v2),
                                 lambda document, _: {**avro.to_avro(document, Request), "channel": "web"})
    values = [
        ("avro-1", as_avro(_request("avro-1"), _context(topic))),
        ("json-schema-1", _json_serializer(schema_registry)(_request("json-schema-1"), _context(topic))),
        ("avro-v2-1", as_avro_v2(_request("avro-v2-1"), _context(topic))),
        ("plain-1", json.dumps(_request("plain-1")).encode()),
    ]
    assert all(value[0] == 0 for _, value in values[:3]) and values[3][1][:1] == b"{"
    ids = [key for key, _ in values]

    async def during(service: Service, reader: Reader, task: asyncio.Task) -> None:
        await asyncio.to_thread(_publish, stack.broker.bootstrap_servers, topic, values)

    _, reader = run(serve(stack, _settings(stack, schema_registry), qwen35_model, [], ids, during=during))
    answers = reader.by_id()
    assert reader.counts() == {key: 1 for key in ids}
    plain = answers["plain-1"]
    assert "error" not in plain, plain
    for key in ids[:3]:
        assert "error" not in answers[key], answers[key]
        assert answers[key]["metadata"] == {"origin": "test"}
        close_to(answers[key]["answers"], plain["answers"], key)


def test_unknown_schema_ids_and_unreadable_payloads_are_answered(stack: Stack, schema_registry: SchemaRegistry,
                                                                  qwen35_model: Any) -> None:
    unknown = struct.pack(">bI", 0, 987_654) + b"\x02\x04ab"
    as_avro = _avro_serializer(schema_registry)
    good = as_avro(_request("fine"), _context(stack.requests))
    garbled = good[:5] + b"\xff\xff\xff"  # a known schema id, a payload it cannot read
    records = [(b"unknown-id", unknown), (b"garbled", garbled), (b"fine", good)]
    _, reader = run(serve(stack, _settings(stack, schema_registry), qwen35_model, records,
                          ["unknown-id", "garbled", "fine"]))
    answers = reader.by_id()
    assert answers["unknown-id"]["error"]["code"] == "schema_not_found"
    assert "987654" in answers["unknown-id"]["error"]["message"]
    assert answers["garbled"]["error"]["code"] == "invalid_request"
    assert "Avro" in answers["garbled"]["error"]["message"]
    assert "error" not in answers["fine"]

    async def letters() -> list[Any]:
        async with Reader(stack.broker.bootstrap_servers, stack.dead_letters) as dead:
            await dead.caught_up()
            return dead.answers()

    (letter,) = run(letters())
    assert "987654" in letter["reason"] and letter["key"] == "unknown-id"


def _consume(bootstrap: str, topic: str, want: int, decode: Callable[[bytes], dict[str, Any]]) -> list[dict[str, Any]]:
    """confluent-kafka's consumer reads ``want`` records of ``topic``, read_committed, through ``decode``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"foreign-{topic}", "auto.offset.reset": "earliest",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    consumer.subscribe([topic])
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    try:
        while len(got) < want and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            got.append(decode(message.value()))
    finally:
        consumer.close()
    return got


@pytest.mark.parametrize("answer_format", ["avro", "json_schema"])
def test_answers_and_dead_letters_read_by_foreign_deserializers(stack: Stack, schema_registry: SchemaRegistry,
                                                                qwen35_model: Any, answer_format: str) -> None:
    settings = _settings(stack, schema_registry, answer_format=answer_format, schema_auto_register=True)
    records = [record(_request("a-1")), record(_request("a-2")), (b"junk", b"not json at all")]
    _framed_answers(stack, Service(settings, qwen35_model), records, 3)
    client = registry_client(schema_registry.url)
    if answer_format == "avro":
        read_answer = avro_deserializer(client)
        answers = _consume(stack.broker.bootstrap_servers, stack.answers, 3,
                           lambda value: avro.from_avro(read_answer(value, _context(stack.answers)), Answer))
        read_letter = avro_deserializer(client)
        letters = _consume(stack.broker.bootstrap_servers, stack.dead_letters, 1,
                           lambda value: avro.from_avro(read_letter(value, _context(stack.dead_letters)), DeadLetter))
    else:
        read = json_deserializer(client)
        answers = _consume(stack.broker.bootstrap_servers, stack.answers, 3,
                           lambda value: read(value, _context(stack.answers)))
        letters = _consume(stack.broker.bootstrap_servers, stack.dead_letters, 1,
                           lambda value: read(value, _context(stack.dead_letters)))
    by_id = {answer["id"]: answer for answer in answers}
    assert set(by_id) == {"a-1", "a-2", "junk"}
    assert by_id["a-1"]["answers"]["n"]["type"] == "noul"
    assert by_id["junk"]["error"]["code"] == "undecodable_event"
    assert letters[0]["source"]["topic"] == stack.requests and letters[0]["key"] == "junk"
    subjects = client.get_subjects()
    assert f"{stack.answers}-value" in subjects and f"{stack.dead_letters}-value" in subjects


def test_a_registry_outage_makes_the_stream_wait(stack: Stack, schema_registry: SchemaRegistry,
                                                 qwen35_model: Any) -> None:
    """The registry goes down before the worker has looked up a schema: the framed requests wait (not ready,
    saying why; the fault counted; nothing dead-lettered), and are answered once it is back."""
    as_avro = _avro_serializer(schema_registry)
    ids = [f"outage-{i}" for i in range(4)]
    values = [(each, as_avro(_request(each), _context(stack.requests))) for each in ids]
    service = Service(_settings(stack, schema_registry), qwen35_model)
    probes = MetricsServer(service.metrics, port=0)

    def readyz() -> str:
        try:
            with urllib.request.urlopen(f"{probes.url}/readyz", timeout=5) as response:
                return str(response.read().decode())
        except urllib.error.HTTPError as refused:
            return str(refused.read().decode())

    async def main() -> Reader:
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            probes.start()
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                schema_registry.stop()
                try:
                    await asyncio.to_thread(_publish, stack.broker.bootstrap_servers, stack.requests, values)
                    await reader.wait(lambda: service.registry is not None and service.registry.health.faults >= 2,
                                      60, task, what="failed lookups")
                    assert "Schema Registry" in await asyncio.to_thread(readyz)
                    assert reader.records == []
                finally:
                    await asyncio.to_thread(schema_registry.start)
                await reader.wait_ids(ids, 90, task)
                await reader.wait(lambda: service.registry_outage is None, 30, task, what="the registry back")
            finally:
                await stop(service, task)
            await reader.caught_up()
            return reader

    try:
        reader = run(main())
    finally:
        probes.stop()
    assert reader.counts() == {each: 1 for each in ids}
    assert all("error" not in answer for answer in reader.answers())
    assert service.default.answers.dead_letters == 0


def test_a_schema_change_the_registry_refuses_stops_the_worker_at_start(stack: Stack,
                                                                        schema_registry: SchemaRegistry,
                                                                        qwen35_model: Any) -> None:
    client = registry_client(schema_registry.url)
    subject = f"{stack.answers}-value"
    # What an older d3stream registered: an Answer whose id is a number. The new one cannot read it back.
    older = {"type": "record", "name": "Answer", "namespace": avro.NAMESPACE,
             "fields": [{"name": "id", "type": "long"}, {"name": "score", "type": "double"}]}
    client.register_schema(subject, Schema(json.dumps(older), "AVRO"))
    client.set_compatibility(subject, "FULL")
    settings = _settings(stack, schema_registry, answer_format="avro", schema_auto_register=True)
    with pytest.raises(RuntimeError, match=subject):
        run(Service(settings, qwen35_model).run())
    # Without auto-registration, a schema that is not registered stops it too, saying how to register it.
    other = stack.settings(schema_registry_url=schema_registry.url, answer_format="avro",
                           answer_topic=stack.unique("unregistered"))
    with pytest.raises(RuntimeError, match="register"):
        run(Service(other, qwen35_model).run())


def test_schemas_registered_ahead_let_a_production_worker_start(stack: Stack, schema_registry: SchemaRegistry,
                                                                qwen35_model: Any,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Production: ``d3stream schemas register`` once, then workers that do not register find the schemas."""
    from d3stream.cli import main

    assert main(["schemas", "register", "--schema-registry-url", schema_registry.url, "--answer-format", "avro",
                 "--request-topics", stack.requests, "--answer-topic", stack.answers,
                 "--dead-letter-topic", stack.dead_letters]) == 0
    printed = capsys.readouterr().out
    assert f"{stack.answers}\tAnswer\tschema id" in printed and f"{stack.requests}\tRequest" in printed
    settings = _settings(stack, schema_registry, answer_format="avro")
    assert not settings.registry.schema_auto_register
    answers = _framed_answers(stack, Service(settings, qwen35_model), [record(_request("prod-1"))], 1)
    assert answers[0][:1] == b"\x00"


def test_a_production_worker_writes_with_the_latest_registered_version(stack: Stack, schema_registry: SchemaRegistry,
                                                                       qwen35_model: Any) -> None:
    """Without auto-registration the worker writes with the subject's latest version (use.latest.version): a
    later answer schema with a field added with a default is used as it is, and a foreign deserializer reads
    the default; a latest version that requires a field an answer does not carry stops the worker at start,
    naming the field."""
    client = registry_client(schema_registry.url)
    contract = avro.avro_schema(Answer)
    later = {**contract, "fields": [*contract["fields"], {"name": "region", "type": "string", "default": "eu"}]}  # type: ignore[misc]
    later_id = client.register_schema(f"{stack.answers}-value", Schema(json.dumps(later), "AVRO"))
    client.register_schema(f"{stack.dead_letters}-value", Schema(json.dumps(avro.avro_schema(DeadLetter)), "AVRO"))
    settings = _settings(stack, schema_registry, answer_format="avro")
    (value,) = _framed_answers(stack, Service(settings, qwen35_model), [record(_request("latest-1"))], 1)
    assert value[:1] == b"\x00" and int.from_bytes(value[1:5], "big") == later_id
    read = avro_deserializer(client)(value, _context(stack.answers))
    assert read["id"] == "latest-1" and read["region"] == "eu"

    answers = stack.unique("strict-answers")
    strict = {**contract, "fields": [*contract["fields"], {"name": "tenant_id", "type": "string"}]}  # type: ignore[misc]
    client.register_schema(f"{answers}-value", Schema(json.dumps(strict), "AVRO"))
    with pytest.raises(RuntimeError, match="requires tenant_id"):
        run(Service(stack.settings(schema_registry_url=schema_registry.url, answer_format="avro",
                                   answer_topic=answers), qwen35_model).run())


def _framed_answers(stack: Stack, service: Service, records: list[tuple[bytes, bytes]], count: int) -> list[bytes]:
    """Run ``service`` until ``count`` answer records are on the answer topic; their values, as written."""

    async def main() -> list[bytes]:
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                await produce(stack.broker.bootstrap_servers, stack.requests, records)
                await reader.wait(lambda: len(reader.records) >= count, 90, task, what=f"{count} answers")
            finally:
                await stop(service, task)
            return [each.value for each in reader.records]

    return run(main())


def test_the_evaluator_joins_framed_answers_and_labels_and_writes_avro(kafka_broker: Any, topic_names: Any,
                                                                       schema_registry: SchemaRegistry) -> None:
    """d3stream evaluate beside Avro answers: answers and labels framed as Avro are joined, and the
    evaluations are written in Avro, which confluent-kafka's AvroDeserializer reads."""
    import random

    from d3stream_client.contract import Evaluation, Label

    from d3stream.jobs.evaluate import run_worker
    from d3stream.kafka.registry import Registry
    from tests.support.evaluate_events import answer_event, evaluate_settings, keyed, label_event

    settings = evaluate_settings(kafka_broker, topic_names).replaced(
        schema_registry_url=schema_registry.url, answer_format="avro", schema_auto_register=True)
    servers = settings.connection.bootstrap_servers
    answers_topic, labels_topic = settings.delivery.answer_topic, settings.evaluation.label_topic
    rng = random.Random(3)
    ids = [f"framed-{n}" for n in range(12)]
    answers = keyed([answer_event(each, rng) for each in ids])
    labels = keyed([label_event(each, rng) for each in ids[:8]])

    async def scenario() -> None:
        framing = await Registry(settings.registry).writers_for({answers_topic: Answer, labels_topic: Label})
        await produce(servers, answers_topic, [(key, framing.encode(answers_topic, value)) for key, value in answers])
        await produce(servers, labels_topic, [(key, framing.encode(labels_topic, value)) for key, value in labels])
        stopping = asyncio.Event()
        worker = asyncio.ensure_future(run_worker(settings, stopping))
        try:
            await asyncio.to_thread(_wait_for_evaluations, 8)
        finally:
            stopping.set()
            await worker

    found: list[dict[str, Any]] = []

    def _wait_for_evaluations(count: int) -> None:
        read = avro_deserializer(registry_client(schema_registry.url))
        topic = settings.evaluation.evaluation_topic
        found.extend(_consume(servers, topic, count, lambda value: avro.from_avro(read(value, _context(topic)),
                                                                                  Evaluation)))

    run(scenario())
    assert sorted(each["id"] for each in found) == sorted(ids[:8])
    assert all(set(each["questions"]) == {"team", "refund", "urgency"} for each in found)


def test_the_evaluator_stops_promptly_while_it_waits_for_a_hung_registry(kafka_broker: Any, topic_names: Any,
                                                                         schema_registry: SchemaRegistry) -> None:
    """Framed answers arrive while the registry answers nothing: the evaluator waits for their schema (counting
    the faults) and, asked to stop meanwhile, gives the wait up and stops within seconds, committing nothing."""
    import random

    from d3stream.jobs.evaluate import make_evaluator
    from d3stream.kafka.registry import Registry
    from tests.support.evaluate_events import answer_event, evaluate_settings, keyed

    settings = evaluate_settings(kafka_broker, topic_names).replaced(
        schema_registry_url=schema_registry.url, schema_auto_register=True, schema_registry_timeout_s=1)
    servers = settings.connection.bootstrap_servers
    answers_topic = settings.delivery.answer_topic
    answers = keyed([answer_event(f"hung-{n}", random.Random(n)) for n in range(3)])

    async def scenario() -> tuple[float, int]:
        framing = await Registry(msgspec.structs.replace(settings.registry, answer_format="avro")).writers_for(
            {answers_topic: Answer})
        await produce(servers, answers_topic, [(key, framing.encode(answers_topic, value)) for key, value in answers])
        evaluator = await make_evaluator(settings, None)
        await evaluator.start()
        stopping = asyncio.Event()
        schema_registry.pause()  # the registry is shared: resumed below whatever happens
        task = asyncio.ensure_future(evaluator.run(stopping))
        try:
            assert evaluator.registry is not None
            deadline = time.monotonic() + 60
            while evaluator.registry.health.faults == 0:
                assert not task.done() and time.monotonic() < deadline, "the evaluator never asked the registry"
                await asyncio.sleep(0.1)
            stopping.set()
            asked = time.monotonic()
            await asyncio.wait_for(task, 30)  # before: it waited for the registry for ever
            return time.monotonic() - asked, await committed_offsets(servers, settings.evaluation.evaluate_group_id)
        finally:
            schema_registry.resume()
            await evaluator.stop()

    stopped_after, committed = run(scenario())
    assert stopped_after < 10 and not committed


async def committed_offsets(servers: str, group: str) -> dict[Any, Any]:
    """The group's committed offsets (none: nothing was committed)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=servers)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp: each.offset for tp, each in offsets.items() if each.offset >= 0}


def test_a_registry_behind_tls_is_reached_through_its_ca(stack: Stack, qwen35_model: Any, tmp_path: Any) -> None:
    """schema_registry_ssl_cafile: with the CA that signs the registry's certificate the framed request is
    answered; without it the registry is unreachable for the worker, which waits and says why."""
    import trustme

    authority = trustme.CA()
    server = authority.issue_cert("127.0.0.1")
    client = authority.issue_cert("d3stream-worker")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "server", "server-key", "client", "client-key")}
    authority.cert_pem.write_to_path(paths["ca"])
    server.cert_chain_pems[0].write_to_path(paths["server"])
    server.private_key_pem.write_to_path(paths["server-key"])
    client.cert_chain_pems[0].write_to_path(paths["client"])
    client.private_key_pem.write_to_path(paths["client-key"])
    with SchemaRegistry(tls=(paths["server"], paths["server-key"], paths["ca"])) as registry:
        assert registry.url.startswith("https://")
        serializer = avro_serializer(registry_client(registry.url, **{"ssl.ca.location": str(paths["ca"])}),
                                     json.dumps(avro.avro_schema(Request)),
                                     lambda document, _: avro.to_avro(document, Request))
        value = serializer(_request("over-tls"), _context(stack.requests))
        trusted = stack.settings(schema_registry_url=registry.url, schema_registry_ssl_cafile=str(paths["ca"]),
                                 schema_registry_ssl_certfile=str(paths["client"]),
                                 schema_registry_ssl_keyfile=str(paths["client-key"]))
        _, reader = run(serve(stack, trusted, qwen35_model, [(b"over-tls", value)], ["over-tls"]))
        assert "error" not in reader.by_id()["over-tls"]

        untrusting = Service(stack.settings(schema_registry_url=registry.url, group_id=stack.unique("untrusting")),
                             qwen35_model)

        async def refused() -> str | None:
            task = asyncio.create_task(untrusting.run())
            try:
                while untrusting.registry is None or untrusting.registry.health.faults == 0:
                    assert not task.done(), "the worker stopped instead of waiting for the registry"
                    await asyncio.sleep(0.1)
                return untrusting.registry_outage
            finally:
                await stop(untrusting, task)

        reason = run(refused())
        assert reason is not None and "CERTIFICATE_VERIFY_FAILED" in reason.upper().replace(" ", "_")


def test_a_worker_started_while_its_registry_hangs_waits_for_it(stack: Stack, schema_registry: SchemaRegistry,
                                                                qwen35_model: Any) -> None:
    """The registry answers nothing as a worker writing Avro answers starts: the worker waits to register its
    schemas (not ready, saying why) instead of failing, stops cleanly if asked meanwhile, and serves once the
    registry answers."""

    def worker(name: str) -> Service:
        return Service(stack.settings(schema_registry_url=schema_registry.url, answer_format="avro",
                                      schema_auto_register=True, schema_registry_timeout_s=1,
                                      group_id=stack.unique(name)), qwen35_model)

    async def waiting(service: Service, task: asyncio.Task[None]) -> None:
        assert service.registry is not None
        while service.registry.health.faults == 0:
            assert not task.done(), "the worker stopped instead of waiting for the registry"
            await asyncio.sleep(0.1)
        assert not service.ready and "did not answer" in (service.registry_outage or "")

    async def stopped_while_waiting() -> None:
        service = worker("stopped")
        task = asyncio.create_task(service.run())
        try:
            await waiting(service, task)
        finally:
            await stop(service, task)  # raises if the worker ended in an error

    async def served_once_back(service: Service) -> list[bytes]:
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await waiting(service, task)
                schema_registry.resume()
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                await produce(stack.broker.bootstrap_servers, stack.requests, [record(_request("late-registry"))])
                await reader.wait(lambda: len(reader.records) >= 1, 90, task, what="the answer")
            finally:
                await stop(service, task)
            return [each.value for each in reader.records]

    schema_registry.pause()
    try:
        run(stopped_while_waiting())
        values = run(served_once_back(worker("served")))
    finally:
        schema_registry.resume()
    assert [value[:1] for value in values] == [b"\x00"]  # the registry's wire format
