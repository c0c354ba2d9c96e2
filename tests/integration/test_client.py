"""The client distribution (clients/python, ``d3stream_client``) on the real broker, with a real worker in process.

* Its checks refuse a request with the very message the worker puts in the request's ``invalid_request``
  answer (the worker answers the same bytes, published unchecked, here).
* ``ask``: one round trip, a thousand concurrent asks on one consumer, a timeout that says where the request
  is and how far the workers got; the produce command's helper and the ask benchmark.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from d3stream_client import (
    AskTimeout,
    D3Client,
    EventError,
    Published,
    Request,
    validate_request,
)
from d3stream_client.contract import Answer, decode_answer
from d3stream_client.publisher import produce
from d3stream_client.validation import RequestLimits

from d3stream.service import Service
from tests.support.stream_helpers import Q_CHOICE, Q_NOUL, Reader, assigned_and_ready, run, stop


def _client(stack, **options) -> D3Client:
    return D3Client(stack.broker.bootstrap_servers, request_topic=stack.requests, answer_topic=stack.answers,
                    worker_group=stack.group, **options)


async def _serving(stack, model, **settings) -> tuple[Service, asyncio.Task]:
    service = Service(stack.settings(**settings), model)
    task = asyncio.create_task(service.run())
    async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
        await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the service's assignment")
    return service, task


def _invalid_requests(bucket: str) -> dict[str, bytes]:
    many = [f"s3://{bucket}/img-{n}.png" for n in range(33)]
    return {
        "no-questions": json.dumps({"id": "no-questions", "state": "x"}).encode(),
        "too-many-questions": json.dumps({"id": "too-many-questions",
                                          "questions": {f"q{n}": Q_NOUL for n in range(4)}}).encode(),
        "duplicate-key": b'{"id": "duplicate-key", "questions": {"q": {"type": "noul"}}, "state": 1, "state": 2}',
        "bad-priority": json.dumps({"id": "bad-priority", "questions": {"q": Q_NOUL}, "priority": "urgent"}).encode(),
        "too-many-media": json.dumps({"id": "too-many-media", "questions": {"q": Q_NOUL}, "images": many}).encode(),
        "too-many-options": json.dumps({"id": "too-many-options", "questions": {"q": Q_CHOICE, "r": Q_CHOICE}}).encode(),
    }


def test_the_client_refuses_with_the_workers_message_before_sending(stack, qwen35_model):
    """The same bytes published unchecked get an invalid_request answer whose message is the client's."""
    limits = {"max_request_questions": 3, "max_request_options": 5}
    invalid = _invalid_requests(stack.bucket)
    client_limits = RequestLimits(questions=3, options=5)
    refused = {}
    for name, value in invalid.items():
        with pytest.raises(EventError) as caught:
            validate_request(value, client_limits)
        assert caught.value.code == "invalid_request", name
        refused[name] = str(caught.value)

    async def scenario() -> dict[str, Answer]:
        service, task = await _serving(stack, qwen35_model, **limits)
        try:
            async with _client(stack, limits=client_limits) as client:
                with pytest.raises(EventError):  # nothing is sent
                    await client.publish(json.loads(invalid["no-questions"]))
                await client.publisher.publish_raw([(name.encode(), value) for name, value in invalid.items()])
                async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
                    await reader.wait_ids(invalid, 90, task)
                    return {answer["id"]: decode_answer(json.dumps(answer).encode()) for answer in reader.answers()}
        finally:
            await stop(service, task)

    answers = run(scenario())
    assert set(answers) == set(invalid), "only the unchecked records reached the worker"
    for name, message in refused.items():
        error = answers[name].error
        assert error is not None and error.code == "invalid_request", (name, answers[name])
        assert error.message == message, name


# ------------------------------------------------------------------------------------------- asking


def test_ask_returns_the_typed_answer_of_its_request(stack, qwen35_model):
    async def scenario() -> tuple[Answer, Answer, Published]:
        service, task = await _serving(stack, qwen35_model)
        try:
            async with _client(stack) as client:
                first = await client.ask({"id": "ask-1", "state": "a red car", "questions": {"q": Q_NOUL}},
                                         timeout=60)
                # The same id asked again is a new request: its answer names the new record, not the first.
                again = await client.ask(Request(id="ask-1", state="a blue car", questions={"c": Q_CHOICE}),
                                         timeout=60)
                published = await client.publish({"id": "ask-2", "questions": {"q": Q_NOUL}})
                return first, again, published
        finally:
            await stop(service, task)

    first, again, published = run(scenario())
    assert isinstance(first, Answer) and first.id == "ask-1" and first.error is None
    assert first.answers is not None and first.answers["q"]["type"] == "noul" and 0 <= first.answers["q"]["noul"] <= 1
    assert first.source.topic == stack.requests
    assert again.answers is not None and set(again.answers) == {"c"}
    assert again.source.offset != first.source.offset or again.source.partition != first.source.partition
    assert published.id == "ask-2" and published.topic == stack.requests and published.offset >= 0


@pytest.mark.parametrize("delivery", ["exactly_once", "at_least_once"])
def test_a_thousand_concurrent_asks_share_one_consumer(stack, qwen35_model, delivery):
    """All asks start at once, so most find their answer partition being positioned by another ask; with
    at_least_once answers come back within milliseconds, so an ask that published before its partition's
    position was known would miss its answer (it once did, under load)."""
    count = 1000

    async def scenario() -> tuple[list[Answer], set[int], int]:
        service, task = await _serving(stack, qwen35_model, delivery=delivery)
        try:
            async with _client(stack) as client:
                asks = [client.ask({"id": f"many-{n}", "state": f"case {n}", "questions": {"q": Q_NOUL}},
                                   timeout=240) for n in range(count)]
                answers = await asyncio.gather(*asks)
                consumer = client.waiter._consumer
                assert consumer is not None
                return answers, {tp.partition for tp in consumer.assignment()}, len(client.waiter._waiting)
        finally:
            await stop(service, task)

    answers, partitions, still_waiting = run(scenario())
    assert [answer.id for answer in answers] == [f"many-{n}" for n in range(count)]
    assert all(answer.error is None for answer in answers)
    assert partitions <= set(range(4)) and still_waiting == 0


def test_ask_timeout_says_where_the_request_is_and_that_no_worker_committed(stack):
    async def scenario() -> AskTimeout:
        async with _client(stack) as client:
            with pytest.raises(AskTimeout) as caught:
                await client.ask({"id": "nobody-home", "questions": {"q": Q_NOUL}}, timeout=1.5)
            return caught.value

    error = run(scenario())
    published = error.published
    assert published is not None and published.topic == stack.requests
    message = str(error)
    assert f"{stack.requests}[{published.partition}] offset {published.offset}" in message
    assert f"worker group {stack.group!r} has committed nothing on that partition" in message


def test_ask_timeout_counts_the_records_the_workers_still_owe(stack, qwen35_model):
    """A worker that answered the partition's first request and stopped: the message gives the lag."""
    async def scenario() -> AskTimeout:
        async with _client(stack) as client:
            service, task = await _serving(stack, qwen35_model)
            try:
                key = "lagging"  # everything below lands on this key's partition
                await client.ask({"id": key, "questions": {"q": Q_NOUL}}, timeout=60)
            finally:
                await stop(service, task)
            await client.publisher.publish_raw([(key.encode(), b'{"id": "lagging", "questions": {}}')] * 2)
            with pytest.raises(AskTimeout) as caught:
                await client.ask({"id": key, "questions": {"q": Q_NOUL}}, timeout=1.5)
            return caught.value

    message = str(run(scenario()))
    assert "has committed up to offset 1: 3 records of that partition, this one included, are not answered" \
        in message, message


def test_the_produce_command_helper_publishes_records_as_they_are(stack):
    """``d3stream produce`` sends what a file holds, requests or not: the worker answers the rest."""
    async def scenario() -> list:
        count = await produce(stack.broker.bootstrap_servers, stack.requests, [(None, b"not json"), (b"k", b"{}")])
        assert count == 2
        async with Reader(stack.broker.bootstrap_servers, stack.requests) as reader:
            await reader.caught_up()
            return reader.records

    records = run(scenario())
    assert sorted(record.value for record in records) == [b"not json", b"{}"]
    assert all(dict(record.headers)["d3stream-schema"] == b"2" for record in records)


def test_the_ask_benchmark_reports_ask_and_worker_latency_in_both_modes(stack, qwen35_checkpoint):
    from d3stream.benchmarks.bench_ask import ask_latency, ask_markdown

    report = ask_latency(qwen35_checkpoint, 12, rate=40, broker=stack.broker)
    assert set(report) == {"exactly_once", "at_least_once"}
    for figures in report.values():
        assert figures["asks"] == 12
        assert figures["ask_p50_ms"] > 0 and figures["ask_p99_ms"] >= figures["ask_p50_ms"]
        assert figures["worker_p99_ms"] >= figures["worker_p50_ms"] > 0
    assert ask_markdown(report).count("\n") == 3
