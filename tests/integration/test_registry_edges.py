"""One record framed through the Schema Registry must never take a worker down (issue 42's findings).

Each test publishes hostile framed records beside good ones to a worker reading through Apicurio, and checks
what a producer and an operator see: every record answered (the hostile ones with an error that says why,
those framed with a refused schema dead-lettered too), the good ones answered normally behind them, the
worker still up and not waiting on an outage. On the code before these checks a recursive schema crashed the
interpreter (SIGSEGV in fastavro), deep JSON text raised out of the fetch (no answer, the partition stuck), a
schema Apicurio's own API accepted but nobody can parse looked like an outage that never ends, and a bare
frame or a JSON Schema payload that is not JSON was ``undecodable_event``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema
from d3stream_client import avro
from d3stream_client.avro_binary import _varlong  # a long as Avro writes it, for forging payloads
from d3stream_client.contract import Request
from d3stream_client.registry import AvroCodec, frame
from d3stream_client.validation import TOO_DEEP
from d3stream_client.writer_schemas import admit

from d3stream.dev.infra import SchemaRegistry
from d3stream.service import Service
from tests.support.foreign_serdes import registry_client
from tests.support.stream_helpers import Q_NOUL, Reader, Stack, run, serve

pytestmark = pytest.mark.timeout(300)

REQUEST_SCHEMA = avro.avro_schema(Request)


def _request(request_id: str, **extra: object) -> dict[str, object]:
    return {"id": request_id, "questions": {"n": Q_NOUL}, **extra}


def _avro(document: dict[str, object]) -> bytes:
    return AvroCodec(admit(json.dumps(REQUEST_SCHEMA), Request), Request).write(document)


def _register(registry: SchemaRegistry, subject: str, schema: dict[str, object], kind: str = "AVRO") -> int:
    return registry_client(registry.url).register_schema(subject, Schema(json.dumps(schema), kind))


def _register_natively(registry: SchemaRegistry, artifact: str, text: str) -> int:
    """A schema registered through Apicurio's own API, which takes content its Confluent API refuses; its id as
    the Confluent API gives it."""
    root = registry.url.split("/apis/")[0]
    body = {"artifactId": artifact, "artifactType": "AVRO",
            "firstVersion": {"content": {"content": text, "contentType": "application/json"}}}
    request = urllib.request.Request(f"{root}/apis/registry/v3/groups/default/artifacts", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30):
        pass
    with urllib.request.urlopen(f"{registry.url}/subjects/{artifact}/versions/1", timeout=30) as answer:
        return int(json.load(answer)["id"])


def _dead_letters(stack: Stack) -> dict[str, Any]:
    async def letters() -> list[Any]:
        async with Reader(stack.broker.bootstrap_servers, stack.dead_letters) as dead:
            await dead.caught_up()
            return dead.answers()

    return {letter["key"]: letter for letter in run(letters())}


def _serve(stack: Stack, registry: SchemaRegistry, model: Any, records: list[tuple[bytes, bytes]],
           **settings: object) -> tuple[Service, dict[str, Any]]:
    ids = [key.decode() for key, _ in records]
    service, reader = run(serve(stack, stack.settings(schema_registry_url=registry.url, **settings), model,
                                records, ids))
    assert reader.counts() == dict.fromkeys(ids, 1)  # each answered once, none lost
    return service, reader.by_id()


def _error(answer: dict[str, Any]) -> tuple[str, str]:
    error = answer.get("error")
    assert error is not None, answer
    return error["code"], error["message"]


def test_hostile_writer_schemas_are_refused_as_answers_and_the_worker_goes_on(
        stack: Stack, schema_registry: SchemaRegistry, qwen35_model: Any) -> None:
    """A recursive schema with a record nested 20,000 deep (finding 1), an array of nulls claiming 80 million
    items (finding 3), a schema only Apicurio's own API took (finding 5), and a good schema registered under a
    subject of no topic here: each record answered invalid_request naming the id and why, dead-lettered; the
    requests around them answered; the registry never counted as down."""
    topic_subject = f"{stack.requests}-value"
    node = {"type": "record", "name": "Node", "namespace": "attack",
            "fields": [{"name": "next", "type": ["null", "attack.Node"]}]}
    recursive_id = _register(schema_registry, stack.unique("unrelated"), node)
    fields = REQUEST_SCHEMA["fields"]
    assert isinstance(fields, list)
    nulls = {**REQUEST_SCHEMA, "fields": [*fields, {"name": "junk", "type": {"type": "array", "items": "null"},
                                                    "default": []}]}
    nulls_id = _register(schema_registry, topic_subject, nulls)
    unparsable_id = _register_natively(
        schema_registry, stack.unique("native"),
        json.dumps({"type": "record", "name": "Request", "namespace": "d3stream.v2",
                    "fields": [{"name": "id", "type": {"type": "array"}}]}))
    elsewhere = {**REQUEST_SCHEMA, "fields": [*fields, {"name": "note", "type": ["null", "string"], "default": None}]}
    elsewhere_id = _register(schema_registry, stack.unique("elsewhere"), elsewhere)
    good = _avro(_request("good-before"))
    records = [
        (b"good-before", frame(_register(schema_registry, topic_subject, REQUEST_SCHEMA), good)),
        (b"recursive", frame(recursive_id, b"\x02" * 20_000 + b"\x00")),
        (b"count-bomb", frame(nulls_id, _avro(_request("count-bomb")) + _varlong(80_000_000) + b"\x00")),
        (b"unparsable", frame(unparsable_id, b"\x02x")),
        (b"elsewhere", frame(elsewhere_id, _avro(_request("elsewhere")) + b"\x00")),
        (b"plain-after", json.dumps(_request("plain-after")).encode()),
    ]
    service, answers = _serve(stack, schema_registry, qwen35_model, records)
    for key in ("good-before", "plain-after"):
        assert "error" not in answers[key], answers[key]
    expected = {"recursive": (recursive_id, "recursive: the record attack.Node contains itself"),
                "count-bomb": (nulls_id, "an array whose items take no bytes"),
                "unparsable": (unparsable_id, "not a valid Avro schema"),
                "elsewhere": (elsewhere_id, "is not registered under a subject of topic")}
    letters = _dead_letters(stack)
    for key, (schema_id, why) in expected.items():
        code, message = _error(answers[key])
        assert code == "invalid_request", (key, message)
        assert f"id {schema_id}" in message and why in message, (key, message)
        assert why in letters[key]["reason"], (key, letters[key])
    assert service.registry is not None and service.registry.health.faults == 0  # never an outage


def test_hostile_payloads_are_answered_with_what_was_wrong_and_where(
        stack: Stack, schema_registry: SchemaRegistry, qwen35_model: Any) -> None:
    """JSON text nested 10,000 deep in an Avro request's state (finding 2): the plain JSON request's answer;
    a frame with no payload, a JSON Schema frame whose payload is not JSON, and a truncated Avro payload
    (finding 6): invalid_request saying what was expected at which byte."""
    topic_subject = f"{stack.requests}-value"
    avro_id = _register(schema_registry, topic_subject, REQUEST_SCHEMA)
    from d3stream_client.schemas import registry_json_schema

    json_id = _register(schema_registry, f"{stack.requests}-Request", registry_json_schema(Request), "JSON")
    marker = json.dumps({"marker": 1}, separators=(",", ":")).encode()
    shallow = _avro(_request("deep-state", state={"marker": 1}))
    deep = b"[" * 10_000 + b"]" * 10_000
    assert shallow.count(_varlong(len(marker)) + marker) == 1
    deep_state = shallow.replace(_varlong(len(marker)) + marker, _varlong(len(deep)) + deep)
    truncated = _avro(_request("truncated", state={"marker": 1}))[:6]
    records = [
        (b"deep-state", frame(avro_id, deep_state)),
        (b"bare-frame", frame(avro_id, b"")),
        (b"json-schema-garbage", frame(json_id, b"\x00\x01 not json")),
        (b"truncated", frame(avro_id, truncated)),
        (b"plain-deep", b'{"id": "plain-deep", "state": ' + deep + b', "questions": {"n": {"type": "noul"}}}'),
        (b"good-after", frame(avro_id, _avro(_request("good-after")))),
    ]
    _, answers = _serve(stack, schema_registry, qwen35_model, records)
    assert "error" not in answers["good-after"], answers["good-after"]
    assert _error(answers["deep-state"]) == ("invalid_request", TOO_DEEP) == _error(answers["plain-deep"])
    code, message = _error(answers["bare-frame"])
    assert code == "invalid_request" and "the payload is empty" in message, message
    code, message = _error(answers["json-schema-garbage"])
    assert code == "invalid_request" and f"JSON Schema of id {json_id} is not JSON" in message, message
    code, message = _error(answers["truncated"])
    assert code == "invalid_request" and re.search(r"ends at byte 6 where .+ was expected", message), message


def test_a_flood_of_unknown_schema_ids_is_answered_and_remembered_within_bounds(
        stack: Stack, schema_registry: SchemaRegistry, qwen35_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 records framed with 150 ids the registry does not know, each id twice (finding 4), between good
    requests: every one answered schema_not_found naming its id, the good ones answered; the worker remembers
    no more unknown ids than its bound."""
    from d3stream.kafka import registry as registry_module

    monkeypatch.setattr(registry_module, "UNKNOWN_IDS", 100)
    avro_id = _register(schema_registry, f"{stack.requests}-value", REQUEST_SCHEMA)
    unknown = [(f"unknown-{n}-{copy}".encode(), frame(7_000_000 + n, b"\x00")) for copy in range(2) for n in range(150)]
    records = [(b"good-first", frame(avro_id, _avro(_request("good-first")))), *unknown,
               (b"good-last", json.dumps(_request("good-last")).encode())]
    service, answers = _serve(stack, schema_registry, qwen35_model, records)
    assert "error" not in answers["good-first"] and "error" not in answers["good-last"]
    for key, _ in unknown:
        code, message = _error(answers[key.decode()])
        number = int(key.decode().split("-")[1])
        assert code == "schema_not_found" and f"no schema with id {7_000_000 + number}" in message, message
    assert service.registry is not None
    assert len(service.registry._unknown) <= 100  # noqa: SLF001 - the bound is what this test is about
