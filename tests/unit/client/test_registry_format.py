"""``d3stream_client.registry`` without a registry: what a user configures is checked where it is written, a
missing extra is named with the command that installs it, plain JSON passes untouched, and the subjects and
the registered JSON Schema are Confluent's and Apicurio's (the worker imports them from here).

(That importing the client loads nothing of the extra is checked in a fresh interpreter:
tests/system/test_client.py; the registry itself in tests/integration/test_client_registry.py.)
"""

from __future__ import annotations

import asyncio
import importlib
import sys

import pytest
from d3stream_client.contract import Answer, DeadLetter, Request
from d3stream_client.registry import (
    RegistryError,
    RegistryFormat,
    frame,
    is_framed,
    record_name,
    subject_name,
)
from d3stream_client.schemas import json_schema, registry_json_schema

NOBODY = "http://127.0.0.1:9"  # a registry address nobody answers on: these tests never reach it


def test_without_the_extra_configuring_a_registry_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("confluent_kafka", "confluent_kafka.schema_registry", "confluent_kafka.schema_registry.error"):
        monkeypatch.setitem(sys.modules, name, None)  # import of it fails, as where it is not installed
    monkeypatch.delitem(sys.modules, "d3stream_client.registry")
    with pytest.raises(ImportError, match=r"pip install 'd3stream-client\[registry\]'"):
        importlib.import_module("d3stream_client.registry")
    with pytest.raises(ImportError, match=r"pip install 'd3stream-client\[registry\]'"):
        from d3stream_client import RegistryFormat  # noqa: F401


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"request_format": "json"}, "leave registry= out"),
        ({"subject_name_strategy": "record_topic"}, "topic, record or topic_record"),
        ({"schema_registry_basic_auth": "token-only"}, "user:password"),
        ({"schema_registry_ssl_keyfile": "key.pem"}, "needs schema_registry_ssl_certfile"),
    ],
)
def test_a_misconfigured_format_is_refused_where_it_is_written(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RegistryFormat(NOBODY, **options)


def test_its_repr_shows_no_credentials() -> None:
    shown = repr(RegistryFormat(NOBODY, schema_registry_basic_auth="reader:s3cret", schema_registry_bearer_token="tok"))
    assert "s3cret" not in shown and "tok" not in shown and NOBODY in shown


def test_plain_json_passes_untouched_without_asking_the_registry() -> None:
    registry = RegistryFormat(NOBODY)
    plain = b'{"id": "t-1", "source": {"topic": "a", "partition": 0, "offset": 1}}'
    assert asyncio.run(registry.document(plain)) == plain
    assert asyncio.run(registry.document(b"not json at all")) == b"not json at all"  # left to the JSON decoder
    assert is_framed(frame(7, b"{}")) and not is_framed(plain) and not is_framed(b"\x00\x00")


def test_a_registry_that_does_not_answer_is_an_error_naming_its_address_and_the_setting() -> None:
    """Nothing listens at NOBODY: framing a request and reading a framed answer both fail with a RegistryError
    that says where it looked and which setting to check (the command line prints it, not a traceback)."""
    registry = RegistryFormat(NOBODY, schema_registry_timeout_s=2)

    async def framing() -> bytes:
        async with registry:
            return await registry.encode_request(b'{"id": "r", "questions": {}}', "d3.requests")

    async def reading() -> bytes:
        async with registry:
            return await registry.document(frame(7, b"{}"))

    for attempt in (framing, reading):
        with pytest.raises(RegistryError, match=r"at http://127\.0\.0\.1:9 did not answer .*schema_registry_url"):
            asyncio.run(attempt())


def test_subjects_follow_confluents_three_strategies() -> None:
    assert record_name(Request) == "d3stream.v2.Request"
    assert subject_name("topic", "d3.requests", record_name(Request)) == "d3.requests-value"
    assert subject_name("record", "d3.requests", record_name(Request)) == "d3stream.v2.Request"
    assert subject_name("topic_record", "d3.requests", record_name(Request)) == "d3.requests-d3stream.v2.Request"
    formats = [RegistryFormat(NOBODY, subject_name_strategy=strategy)
               for strategy in ("topic", "record", "topic_record")]
    assert [each.subject("t") for each in formats] == ["t-value", "d3stream.v2.Request", "t-d3stream.v2.Request"]


@pytest.mark.parametrize("event", [Request, Answer, DeadLetter])
def test_the_registered_json_schema_says_its_type_at_the_top(event: type) -> None:
    """Apicurio refuses a top-level $ref: the root definition is inlined, the rest kept as they are."""
    schema = registry_json_schema(event)
    assert "$ref" not in schema and schema["type"] == "object"
    name = {Request: "request", Answer: "answer", DeadLetter: "dead-letter"}[event]
    assert schema["properties"] == json_schema(name)["$defs"][event.__name__]["properties"]
