"""The light client through a Schema Registry (``registry=RegistryFormat(...)``, the ``[registry]`` extra), against
the session's Apicurio registry and a worker in this process.

* The ``Publisher`` writes requests in Avro and in JSON Schema, framed, and the worker answers them as it
  answers the same request in plain JSON; confluent-kafka's own deserializers read the request records back.
  ``d3stream produce --format avro`` does the same from a JSON-lines file.
* Before anything is sent, a request is refused as without a registry (the worker's message), and a request
  schema the registry does not have is an error naming the subject.
* A worker switched from JSON answers to Avro answers mid-stream: ``ask()`` gets its Avro answer back, a
  subscriber reads the topic whole (the plain answer and the framed one), and ``d3stream consume
  --schema-registry-url`` prints both, and the framed dead letter, as JSON lines.

Without a registry nothing changes: the client's other tests (tests/integration/test_client.py,
tests/unit/client) run without one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.serialization import MessageField, SerializationContext
from d3stream_client import Answer, D3Client, EventError, Publisher, avro
from d3stream_client.contract import Request
from d3stream_client.registry import RegistryError, RegistryFormat
from d3stream_client.subscriber import consume_answers

from d3stream.cli import main
from d3stream.dev.infra import SchemaRegistry
from d3stream.service import Service
from tests.support.foreign_serdes import avro_deserializer, json_deserializer, registry_client
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    Stack,
    assigned_and_ready,
    close_to,
    read_all,
    run,
    serve,
    stop,
)

pytestmark = pytest.mark.timeout(300)

STATE = {"speed": 12.5, "lane": "left", "signals": [1, 2, 3]}


def _request(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "state": STATE, "questions": {"n": Q_NOUL, "c": Q_CHOICE, "s": Q_SCORE},
            "metadata": {"origin": "client"}}


def _context(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


def test_requests_published_in_avro_and_json_schema_are_answered_like_plain_ones(
        stack: Stack, schema_registry: SchemaRegistry, qwen35_model: Any, tmp_path: Path) -> None:
    bootstrap = stack.broker.bootstrap_servers
    requests_file = tmp_path / "requests.jsonl"
    requests_file.write_text(json.dumps(_request("cli-avro-1")) + "\n", encoding="utf-8")

    async def publish() -> None:
        # JSON Schema under a subject of its own (topic and record name): the topic's subject holds the Avro one.
        async with RegistryFormat(schema_registry.url, request_format="avro", schema_auto_register=True) as as_avro, \
                RegistryFormat(schema_registry.url, request_format="json_schema", schema_auto_register=True,
                               subject_name_strategy="topic_record") as as_json_schema:
            async with Publisher(bootstrap, stack.requests, registry=as_avro) as publisher:
                await publisher.publish(_request("avro-1"))
                await publisher.publish_many([_request("avro-2"), Request(**_request("avro-3"))])
            async with Publisher(bootstrap, stack.requests, registry=as_json_schema) as publisher:
                await publisher.publish(_request("json-schema-1"))
            async with Publisher(bootstrap, stack.requests) as publisher:
                await publisher.publish(_request("plain-1"))

    run(publish())
    # A newcomer's way: a JSON-lines file, checked and framed in Avro by the command line.
    assert main(["produce", stack.requests, str(requests_file), "--format", "avro", "--bootstrap-servers", bootstrap,
                 "--schema-registry-url", schema_registry.url, "--schema-auto-register"]) == 0

    # What is on the request topic is the registry's wire format, as any registry-aware consumer reads it.
    records = {record.key.decode(): record for record in run(read_all(bootstrap, stack.requests, partitions=4))}
    client = registry_client(schema_registry.url)
    for key in ("avro-1", "avro-2", "avro-3", "cli-avro-1"):
        assert dict(records[key].headers)["content-type"] == b"application/vnd.d3stream+avro"
        document = avro.from_avro(avro_deserializer(client)(records[key].value, _context(stack.requests)), Request)
        assert {name: document[name] for name in ("id", "state", "questions", "metadata")} == _request(key)
    read_json = json_deserializer(client)
    assert read_json(records["json-schema-1"].value, _context(stack.requests)) == _request("json-schema-1")
    assert records["plain-1"].value[:1] == b"{"

    ids = list(records)
    settings = stack.settings(schema_registry_url=schema_registry.url)
    _, reader = run(serve(stack, settings, qwen35_model, [], ids))
    assert reader.counts() == dict.fromkeys(ids, 1)
    answers = reader.by_id()
    plain = answers["plain-1"]
    assert "error" not in plain, plain
    for key in ids:
        assert "error" not in answers[key], answers[key]
        assert answers[key]["metadata"] == {"origin": "client"}
        close_to(answers[key]["answers"], plain["answers"], key)


def test_refusals_come_before_anything_is_sent(stack: Stack, schema_registry: SchemaRegistry) -> None:
    """The worker's checks run before encoding; a request schema the registry lacks is named by its subject."""
    bootstrap = stack.broker.bootstrap_servers

    async def main_() -> None:
        async with RegistryFormat(schema_registry.url, schema_auto_register=True) as registering, \
                RegistryFormat(schema_registry.url) as looking_up:
            async with Publisher(bootstrap, stack.requests, registry=registering) as publisher:
                with pytest.raises(EventError, match="the request has no questions") as refused:
                    await publisher.publish({"id": "empty", "state": "x", "questions": {}})
                assert refused.value.code == "invalid_request"
                with pytest.raises(EventError, match="NaN at state.x"):
                    await publisher.publish_many([_request("fine"), {**_request("nan"), "state": {"x": float("nan")}}])
            # Nobody registered a request schema under this topic's subject, and this format may not.
            async with Publisher(bootstrap, stack.requests, registry=looking_up) as publisher:
                with pytest.raises(RegistryError, match=f"'{stack.requests}-value'.*schema_auto_register=True"):
                    await publisher.publish(_request("unregistered"))

    run(main_())
    assert run(read_all(bootstrap, stack.requests, partitions=4)) == []


def test_a_worker_switched_to_avro_answers_is_read_whole(stack: Stack, schema_registry: SchemaRegistry,
                                                         qwen35_model: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Plain answers, then Avro ones (and an Avro dead letter) on the same topics: ``ask()`` gets its Avro answer,
    the subscriber and ``d3stream consume`` read both kinds."""
    bootstrap = stack.broker.bootstrap_servers

    async def before() -> None:
        async with Publisher(bootstrap, stack.requests) as publisher:
            await publisher.publish(_request("before-1"))

    run(before())
    run(serve(stack, stack.settings(schema_registry_url=schema_registry.url), qwen35_model, [], ["before-1"]))

    settings = stack.settings(schema_registry_url=schema_registry.url, answer_format="avro", schema_auto_register=True)
    service = Service(settings, qwen35_model)

    async def after() -> tuple[Answer, dict[str, Answer], list[dict[str, Any]]]:
        async with RegistryFormat(schema_registry.url, schema_auto_register=True) as registry, \
                D3Client(bootstrap, request_topic=stack.requests, answer_topic=stack.answers, worker_group=stack.group,
                         registry=registry) as client, \
                Reader(bootstrap, stack.dead_letters) as dead_letters:
            task = asyncio.create_task(service.run())
            try:
                await dead_letters.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                asked = await client.ask(_request("after-1"), timeout=90)
                await client.publisher.publish_raw([(b"junk", b"not json at all")])
                await dead_letters.wait(lambda: len(dead_letters.records) >= 1, 60, task, what="the dead letter")
            finally:
                await stop(service, task)
            subscribed: dict[str, Answer] = {}
            async with asyncio.timeout(60), client.answers(group_id=stack.unique("router")) as answers:
                async for answer in answers:
                    subscribed[answer.id] = answer
                    if {"before-1", "after-1", "junk"} <= set(subscribed):
                        break
                assert answers.undecodable == 0
            letters = await consume_answers(bootstrap, stack.dead_letters, expected=1, timeout_s=30, registry=registry)
        return asked, subscribed, letters

    asked, subscribed, letters = run(after())
    raw = {record.key.decode(): record.value for record in run(read_all(bootstrap, stack.answers, partitions=4))}
    assert raw["before-1"][:1] == b"{" and raw["after-1"][:1] == b"\x00"  # a plain answer, then a framed one

    assert asked.id == "after-1" and asked.error is None
    assert asked.metadata == {"origin": "client"}
    assert asked.answers is not None and subscribed["before-1"].answers is not None
    close_to(asked.answers, subscribed["before-1"].answers, "after-1")
    assert subscribed["after-1"] == asked
    assert subscribed["junk"].error is not None and subscribed["junk"].error.code == "undecodable_event"
    (letter,) = letters
    assert letter["key"] == "junk" and letter["source"]["topic"] == stack.requests

    capsys.readouterr()
    assert main(["consume", stack.answers, "--max", "3", "--timeout", "60", "--bootstrap-servers", bootstrap,
                 "--schema-registry-url", schema_registry.url]) == 0
    printed = {line["id"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(printed) == {"before-1", "after-1", "junk"}
    assert printed["after-1"]["answers"] == asked.answers
