"""The client's pieces without a broker (``d3stream_client``): its checks pass a valid request in every form,
an ask resolves once on the answer that matches where its request landed, and the answer partition is the one
Java's default partitioner picks."""

from __future__ import annotations

import asyncio
import json

import pytest
from d3stream_client import (
    AnswerWaiter,
    EventError,
    Published,
    Request,
    validate_request,
)
from d3stream_client.asking import _Ask
from d3stream_client.contract import Answer, Source
from d3stream_client.validation import decode_request

from tests.support.stream_helpers import Q_NOUL

# ------------------------------------------------------------------------------------------ checks


def test_checks_pass_a_valid_request_in_every_form():
    request = {"id": "t-1", "state": "a quiet road", "questions": {"q": Q_NOUL}}
    value = validate_request(request)
    assert json.loads(value) == request
    typed = json.loads(validate_request(Request(id="t-1", questions={"q": Q_NOUL}, priority="high")))
    assert (typed["id"], typed["questions"], typed["priority"]) == ("t-1", {"q": Q_NOUL}, "high")
    assert validate_request(value) == value


def _refusal(check, value) -> tuple[str, str, str | None]:
    with pytest.raises(EventError) as caught:
        check(value)
    return caught.value.code, str(caught.value), caught.value.request_id


def test_a_request_without_questions_is_refused_in_every_form_with_the_workers_answer():
    request = {"id": "t-1", "state": "a quiet road", "questions": {}}
    refused = _refusal(validate_request, request)
    assert refused[0] == "invalid_request" and "the request has no questions" in refused[1]
    assert refused == _refusal(validate_request, Request(**request)) == _refusal(validate_request, json.dumps(request).encode())
    assert refused == _refusal(decode_request, json.dumps(request).encode())  # what the worker answers


def test_a_repeated_answer_resolves_an_ask_once_and_a_stale_one_never():
    async def scenario() -> None:
        ask = _Ask(asyncio.get_running_loop().create_future())
        mine = Answer(id="r", source=Source(topic="req", partition=1, offset=7), answers={})
        stale = Answer(id="r", source=Source(topic="req", partition=1, offset=3), answers={})
        ask.offer(stale)  # read before the publish said where the request landed
        ask.offer(mine)
        assert not ask.future.done()
        ask.landed(Published("r", "req", 1, 7))
        assert ask.future.result() is mine
        ask.offer(Answer(id="r", source=Source(topic="req", partition=1, offset=7), answers={"again": 1}))
        assert ask.future.result() is mine

        other = _Ask(asyncio.get_running_loop().create_future(), source=Published("r", "req", 1, 9))
        other.offer(stale)
        other.offer(mine)
        assert not other.future.done()

    asyncio.run(scenario())


def test_the_answer_partition_is_the_java_default_partitioners():
    """murmur2 positive-masked modulo the partition count, as Kafka's Java clients (and the worker) place keys."""
    async def four(_: str) -> int:
        return 4

    waiter = AnswerWaiter("127.0.0.1:1", "answers", partitions=four)
    # Values from Kafka's own Utils.murmur2 test vectors, masked and taken modulo 4.
    expected = {"21": (-973932308 & 0x7FFFFFFF) % 4, "foobar": (-790332482 & 0x7FFFFFFF) % 4,
                "a-little-bit-long-string": (-985981536 & 0x7FFFFFFF) % 4}
    got = {key: asyncio.run(waiter.answer_partition(key)) for key in expected}
    assert got == expected
