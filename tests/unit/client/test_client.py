"""The client's pieces without a broker (``d3stream_client``): its checks pass a valid request in every form,
an ask resolves once on the answer that matches where its request landed, and the answer partition is the one
Java's default partitioner picks."""

from __future__ import annotations

import asyncio
import json

import pytest
from d3stream_client import (
    AnswerWaiter,
    D3Client,
    EventError,
    Published,
    Request,
    validate_request,
)
from d3stream_client.asking import _Ask
from d3stream_client.contract import Answer, Label, Source
from d3stream_client.validation import decode_label, decode_request, validate_label

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


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"state": {"x": float("nan")}}, "NaN at state.x"),
        ({"state": [0.5, {"y": float("inf")}]}, "Infinity at state[1].y"),
        ({"metadata": {"scores": [1.0, float("-inf")]}}, "-Infinity at metadata.scores[1]"),
        ({"questions": {"q": {**Q_NOUL, "weight": float("nan")}}}, "NaN at questions.q.weight"),
    ],
)
def test_nan_and_infinities_are_refused_naming_where_not_sent_as_null(fields, where):
    request = {"id": "t-1", "state": "a quiet road", "questions": {"q": Q_NOUL}, **fields}
    refused = _refusal(validate_request, request)
    assert refused == ("invalid_request", f"the request has {where}: numbers must be finite (NaN and infinities "
                       "are not JSON, and are not turned into null)", "t-1")
    assert refused == _refusal(validate_request, Request(**request))
    # json.dumps writes NaN and Infinity: the worker reading that text answers the same.
    assert refused == _refusal(decode_request, json.dumps(request).encode())


def test_publish_and_ask_send_nothing_the_worker_would_refuse():
    async def scenario() -> list[bytes]:
        sent: list[bytes] = []
        client = D3Client("localhost:9")

        async def send(key, value):  # the broker is never reached: what would have been sent is kept
            sent.append(value)
            raise AssertionError("sent")

        client.publisher._send = send
        try:
            for request in ({"id": "t-1", "questions": {}},
                            {"id": "t-2", "questions": {"q": Q_NOUL}, "state": {"x": float("nan")}}):
                for attempt in (client.publish(request), client.publisher.publish_many([request]),
                                client.ask(request, timeout=1)):
                    with pytest.raises(EventError, match="no questions|NaN at state.x"):
                        await attempt
        finally:
            await client.publisher.producer.stop()
            await client.close()
        return sent

    assert asyncio.run(scenario()) == []


def test_a_label_holding_nan_is_refused_naming_where_as_the_evaluator_refuses_it():
    label = {"id": "t-1", "labels": {"q": True}, "metadata": {"score": float("nan")}}
    refused = _refusal(validate_label, label)
    assert refused[:2] == ("invalid_label", "the label has NaN at metadata.score: numbers must be finite (NaN and "
                           "infinities are not JSON, and are not turned into null)")
    assert refused == _refusal(validate_label, Label(**label))
    assert refused[:2] == _refusal(decode_label, json.dumps(label).encode())[:2]  # what the evaluator answers


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
