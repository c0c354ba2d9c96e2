"""Nothing unwritable is retried forever: records over the message limit, and topics the worker cannot write.

On the real broker with its default limits (``message.max.bytes`` 1,048,588):

* A request whose answer is over the answer topic's limit (here a 1 MB request whose metadata the answer
  echoes) used to halt its partition for good (exactly_once: "transaction failed; will retry" forever;
  at_least_once: the worker exited with 0 and every restart did the same). With compression off it now gets
  an ``answer_too_large`` error answer under its id; with the default compression (zstd) it is answered.
  A 1 MB record that is not JSON gets a dead letter that carries only the first ``dead_letter_max_bytes`` raw
  bytes with the size and hash of all of them. Requests after either on the same partition are answered,
  each exactly once, and the committed offset moves past them.
* The answer topic's limit lowered under a running worker: the broker refuses the answer (record-fatal),
  the worker publishes the ``answer_too_large`` replacement and the partition flows on.
* An answer topic the worker may not write to (a broker with Kafka's authorizer and a DENY ACL): the worker
  stops by itself with ``WorkerFatal`` naming the topic and the cause, in both modes, committing nothing.

Worker processes killed or exiting: tests/system/test_unwritable.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.kafka.limits import BROKER_DEFAULT_MAX_MESSAGE_BYTES
from tests.support.stream_helpers import Q_NOUL, committed, read_all, record, run, serve

# Its module-scoped broker starts once on one pytest worker (xdist_group, make test's --dist loadgroup), not
# once on each worker that runs one of its tests: in a CI run three such JVMs started at once beside the others.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("authorizing-broker")]

# These requests are larger than max_request_bytes allows by default (a request that large is refused
# unread, tests/integration/test_limits.py); the workers here raise it so that the answer and dead-letter limits are met.
RAISED_REQUEST_BYTES = 2_000_000
# The largest value the tests' producer sends (its max_request_size is 1,048,576, with the record's framing).
MAX_REQUEST_VALUE = 1_048_400


def echoing(request_id: str, size: int, *, compressible: bool = False) -> dict[str, Any]:
    """A request of ``size`` bytes whose answer is larger: its metadata comes back with the answer, plus the
    answers and the provenance. (Many questions of many options amplify more, but take minutes on a CPU.)
    Random metadata stays over the limit when compressed; repetitive metadata compresses to almost nothing."""
    request = {"id": request_id, "state": "echo", "questions": {"a": Q_NOUL, "b": Q_NOUL}, "metadata": {"blob": ""}}
    room = size - len(json.dumps(request))
    blob = "abcdefgh" * (room // 8 + 1) if compressible else base64.b64encode(hashlib.shake_256(
        request_id.encode()).digest(room)).decode()
    request["metadata"]["blob"] = blob[:room]
    return request


def small(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "state": "after the poison", "questions": {"seen": Q_NOUL}}


def junk(size: int = 1_000_000) -> bytes:
    """Bytes that are not JSON and do not compress (a dead letter of them cannot hide behind zstd)."""
    return hashlib.shake_256(b"not json").digest(size)


def one_partition(stack) -> None:
    """Requests on a single partition: the records after the poison are the ones it would have halted."""
    stack.requests = stack.unique("req1")
    stack.broker.create_topic(stack.requests, 1)


async def set_topic_limit(bootstrap: str, topic: str, max_message_bytes: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic,
                                                  configs={"max.message.bytes": str(max_message_bytes)})])
    finally:
        await admin.close()


@pytest.mark.parametrize("mode", ["exactly_once", "at_least_once"])
def test_over_limit_answers_and_dead_letters_are_replaced_and_the_partition_flows(stack, qwen35_text_model, mode):
    one_partition(stack)
    settings = stack.settings(delivery=mode, compression="none", max_request_bytes=RAISED_REQUEST_BYTES)
    raw = junk()
    first = [record(echoing("huge", MAX_REQUEST_VALUE)), (b"junk", raw), record(small("after-1"))]
    second = [record(echoing("medium", 200_000)), record(small("after-2"))]

    async def lower_the_limit_then_publish(service, reader, task) -> None:
        # The worker read the default limit at start; lowered now, only the broker's refusal tells it.
        await reader.wait_ids(["huge", "junk", "after-1"], 120, task)
        await set_topic_limit(stack.broker.bootstrap_servers, stack.answers, 100_000)
        await produce(stack.broker.bootstrap_servers, stack.requests, second)

    service, reader = run(serve(stack, settings, qwen35_text_model, first,
                                ["huge", "junk", "after-1", "medium", "after-2"], timeout=120,
                                during=lower_the_limit_then_publish))
    assert service.fatal is None
    assert reader.counts() == {"huge": 1, "junk": 1, "after-1": 1, "medium": 1, "after-2": 1}
    answers = reader.by_id()
    for request_id, seen in (("huge", "max.message.bytes"), ("medium", "the broker refused it")):
        error = answers[request_id]["error"]
        assert error["code"] == "answer_too_large", answers[request_id]
        assert seen in error["message"] and stack.answers in error["message"], error
        assert "answers" not in answers[request_id]
    assert answers["junk"]["error"]["code"] == "undecodable_event"
    assert "answers" in answers["after-1"] and "answers" in answers["after-2"]
    assert all(len(item.value) <= BROKER_DEFAULT_MAX_MESSAGE_BYTES for item in reader.records)
    # The partition's committed offset moved past every record.
    assert run(committed(stack.broker.bootstrap_servers, stack.group, stack.requests, 1)) == {0: 5}

    (letter,) = [json.loads(item.value) for item in run(read_all(stack.broker.bootstrap_servers,
                                                                  stack.dead_letters, 4))]
    kept = base64.b64decode(letter["value_base64"])
    assert len(kept) == settings.delivery.dead_letter_max_bytes and raw.startswith(kept)
    assert letter["value_bytes"] == len(raw) and letter["value_truncated"] is True
    assert letter["value_sha256"] == hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize("mode", ["exactly_once", "at_least_once"])
def test_answers_that_fit_a_lowered_limit_alone_are_answered_though_their_batch_was_refused(
        stack, qwen35_text_model, mode):
    """The answer topic's limit lowered to 6 KB under a running worker, whose producer batches up to 128 KiB:
    the broker refuses batches of the 60 answers of about 1.5 KB. Each is sent again in a batch of its own, fits,
    and is answered as usual; none becomes an answer_too_large error."""
    one_partition(stack)
    settings = stack.settings(delivery=mode, compression="none")
    later = [record(small(f"later-{n}")) for n in range(60)]

    async def lower_the_limit_then_publish(service, reader, task) -> None:
        await reader.wait_ids(["first"], 120, task)
        await set_topic_limit(stack.broker.bootstrap_servers, stack.answers, 6_000)
        await produce(stack.broker.bootstrap_servers, stack.requests, later)

    service, reader = run(serve(stack, settings, qwen35_text_model, [record(small("first"))],
                                ["first", *(f"later-{n}" for n in range(60))], timeout=120,
                                during=lower_the_limit_then_publish))
    assert service.fatal is None
    answers = reader.by_id()
    assert len(answers) == 61 and all(reader.counts()[request_id] == 1 for request_id in answers)
    assert all("answers" in answer for answer in answers.values()), [
        answer["error"] for answer in answers.values() if "error" in answer][:3]
    assert run(committed(stack.broker.bootstrap_servers, stack.group, stack.requests, 1)) == {0: 61}


def test_a_worker_starting_on_a_small_answer_topic_limit_batches_under_it_from_its_first_answer(
        stack, qwen35_text_model):
    """The answer topic's limit is 6 KB before the worker starts: it reads the topics' limits before it starts
    its producer, whose batches (128 KiB by default) are then kept under the limit, so the 60 answers of about
    1.5 KB go out in batches the broker takes. Read after the producer starts, the limits would leave it at
    128 KiB: its first batches refused, sent again alone on a fresh producer (the test above)."""
    one_partition(stack)
    stack.broker.create_topic(stack.answers, 1, exist_ok=True)
    run(set_topic_limit(stack.broker.bootstrap_servers, stack.answers, 6_000))
    settings = stack.settings(delivery="at_least_once", compression="none")
    producers = []
    ids = [f"small-{n}" for n in range(60)]

    async def note_the_producer_then_publish(service, reader, task) -> None:
        producers.append(service.sink.producer)  # before any answer could have had it replaced
        await produce(stack.broker.bootstrap_servers, stack.requests, [record(small(request_id)) for request_id in ids])

    service, reader = run(serve(stack, settings, qwen35_text_model, [], ids, timeout=120,
                                during=note_the_producer_then_publish))
    assert service.fatal is None
    answers = reader.by_id()
    assert set(answers) == set(ids) and all("answers" in answer for answer in answers.values())
    (producer,) = producers
    assert producer._message_accumulator._batch_size < 6_000  # the limit, less the batch's framing
    assert service.sink.producer is producer  # never replaced: no batch of it was refused


def test_compressed_answers_over_the_limit_uncompressed_are_answered(stack, qwen35_text_model):
    one_partition(stack)
    settings = stack.settings(max_request_bytes=RAISED_REQUEST_BYTES)  # compression: zstd by default
    records = [record(echoing("huge", MAX_REQUEST_VALUE)), record(small("after"))]
    _, reader = run(serve(stack, settings, qwen35_text_model, records, ["huge", "after"], timeout=120))
    answers = reader.by_id()
    assert reader.counts() == {"huge": 1, "after": 1}
    assert len(answers["huge"]["answers"]) == 2, answers["huge"].get("error")
    (huge,) = [item for item in reader.records if json.loads(item.value)["id"] == "huge"]
    assert len(huge.value) > BROKER_DEFAULT_MAX_MESSAGE_BYTES  # it fitted only compressed


# ================================================================================ a broker with an authorizer


@pytest.fixture(scope="module")
def authorizing_broker(kafka_broker):
    """A second broker with Kafka's StandardAuthorizer, which allows what no ACL names (so only the DENY ACLs a
    test adds apply; clients connect as User:ANONYMOUS). It asks for ``kafka_broker`` only to share its
    skip-or-fail rule when java or the jars are missing."""
    from d3stream.dev.infra import KafkaBroker

    extra = {"authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
             "allow.everyone.if.no.acl.found": "true"}
    with KafkaBroker(extra_properties=extra) as broker:
        yield broker


async def deny_writes(bootstrap: str, topic: str) -> None:
    """A DENY ACL: User:ANONYMOUS may not write to ``topic``. (aiokafka has no create_acls yet; the request is
    the protocol's own.)"""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.protocol.admin import CreateAclsRequest

    topic_resource, literal, write, deny = 2, 3, 4, 2
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin._send_request(  # noqa: SLF001 - no public call for ACLs in aiokafka
            CreateAclsRequest(topic_resource, topic, literal, "User:ANONYMOUS", "*", write, deny))
        assert all(result[0] == 0 for result in response.creation_responses), response
    finally:
        await admin.close()


@pytest.mark.parametrize("mode", ["exactly_once", "at_least_once"])
def test_an_answer_topic_the_worker_may_not_write_to_stops_it_naming_the_topic(authorizing_broker, unique_name,
                                                                                qwen35_text_model, mode):
    from d3stream.kafka.limits import WorkerFatal
    from d3stream.service import Service
    from d3stream.settings import Settings

    broker, bootstrap = authorizing_broker, authorizing_broker.bootstrap_servers
    names = {kind: unique_name(kind) for kind in ("req", "ans", "dlq", "prov", "grp")}
    broker.create_topic(names["req"], 1)
    for kind in ("ans", "dlq", "prov"):
        broker.create_topic(names[kind], 1)
    run(deny_writes(bootstrap, names["ans"]))
    settings = Settings.from_flat(bootstrap_servers=bootstrap, request_topics=[names["req"]], answer_topic=names["ans"],
                        dead_letter_topic=names["dlq"], provenance_topic=names["prov"], group_id=names["grp"],
                        delivery=mode, commit_interval_ms=100, linger_ms=10, metrics_port=None)

    async def scenario() -> BaseException | None:
        service = Service(settings, qwen35_text_model)
        task = asyncio.create_task(service.run())
        await produce(bootstrap, names["req"], [record(small("denied"))])
        try:
            await asyncio.wait_for(task, 90)
        except WorkerFatal as exc:
            return exc
        return None

    stopped = run(scenario())
    assert isinstance(stopped, WorkerFatal), "the worker should stop by itself"
    assert names["ans"] in str(stopped) and "TopicAuthorizationFailed" in str(stopped), stopped
    # Nothing was committed past the request it could not answer.
    assert run(committed(bootstrap, names["grp"], names["req"], 1)) == {}
