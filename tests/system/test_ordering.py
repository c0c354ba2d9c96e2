"""A ``d3stream serve`` SIGKILLed, or rebalanced away, while answers beyond a slow request are committed (named
in the commit's metadata) and the slow one is not: the restarted worker skips what was answered, answers the
rest, and no answer is lost or doubled (issue: head-of-line). The object store is slowed for one image through
the fault proxy.
"""

from __future__ import annotations

import collections
import json

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from d3stream_client.connection import partition_for

from d3stream.benchmarks.chaos import WorkerProcess, worker_env
from d3stream.kafka.offsets import decode_done
from tests.support.media_makers import make_png
from tests.support.stream_helpers import Q_NOUL, Reader, run

pytestmark = pytest.mark.timeout(300)


MOVED = 3  # the partition the scenarios put their requests on


def _keys_on(partition: int, count: int, prefix: str) -> list[str]:
    """``count`` record keys the default partitioner puts on ``partition`` of a 4-partition topic."""
    keys, n = [], 0
    while len(keys) < count:
        key = f"{prefix}-{n}"
        if partition_for(key.encode(), 4) == partition:
            keys.append(key)
        n += 1
    return keys


def _record(request_id: str, key: str, image: str | None = None) -> tuple[bytes, bytes]:
    request = {"id": request_id, "state": f"case {request_id}", "questions": {"q": Q_NOUL}}
    if image is not None:
        request["images"] = [image]
    return key.encode(), json.dumps(request).encode()


def _slow_image(stack, proxy, name: str, seconds: float) -> str:
    uri = stack.put(f"slow/{name}.png", make_png(48, 40, seed=5))
    proxy.delay(seconds, path=stack.path(f"slow/{name}.png"))
    return uri


async def _committed(bootstrap: str, group: str, partition: TopicPartition) -> tuple[int, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = (await admin.list_consumer_group_offsets(group, partitions=[partition]))[partition]
    finally:
        await admin.close()
    return found.offset, found.metadata


@pytest.mark.parametrize("how", ["kill", "rebalance"])
def test_a_worker_killed_or_rebalanced_while_answers_complete_out_of_order_loses_and_doubles_nothing(
        stack, proxy, qwen35_checkpoint, tmp_path, how):
    # Partition 3: when the second worker joins, the sticky assignor (kafka/assignor.py) lets the first keep its
    # first two partitions and hands on its last two, so the slow request's partition is the one that moves.
    keys = _keys_on(MOVED, 21, "ticket")
    # For the rebalance the slow fetch outlasts the second worker's start (its model loads first) and the
    # first one's revocation drain (rebalance_drain_s), so the slow request is handed over unanswered.
    slow = _slow_image(stack, proxy, "b", 8.0 if how == "kill" else 60.0)
    first = [_record("slow", keys[0], slow)] + [_record(f"early-{n}", key) for n, key in enumerate(keys[1:11])]
    later = [_record(f"late-{n}", key) for n, key in enumerate(keys[11:])]
    ids = [json.loads(value)["id"] for _, value in first + later]
    bootstrap = stack.broker.bootstrap_servers
    env = worker_env({
        "bootstrap_servers": bootstrap, "request_topics": [stack.requests], "answer_topic": stack.answers,
        "dead_letter_topic": stack.dead_letters, "provenance_topic": stack.provenance, "group_id": stack.group,
        "group_instance_id": f"{stack.group}-0", "session_timeout_ms": 6000, "model": str(qwen35_checkpoint),
        "s3_endpoint_url": proxy.endpoint_url, "s3_region": stack.store.region, "s3_read_timeout": 30,
        "media_allowlist": [stack.bucket], "commit_interval_ms": 200, "metrics_port": "", "log_format": "json",
    })
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = stack.store.access_key, stack.store.secret_key
    env.pop("D3STREAM_CONFIG", None)
    worker = WorkerProcess(env, tmp_path / "worker.log")
    # The rebalance: a second worker joins the group mid-stream; every partition is revoked, and the slow request's
    # goes to the second worker.
    second = WorkerProcess({**env, "D3STREAM_GROUP_INSTANCE_ID": f"{stack.group}-1"}, tmp_path / "second.log")
    partition = TopicPartition(stack.requests, MOVED)

    async def scenario() -> tuple[collections.Counter, set[int], int, str]:
        from d3stream_client.publisher import produce

        async with Reader(bootstrap, stack.answers) as reader:
            worker.start()
            try:
                await produce(bootstrap, stack.requests, first)
                early = {f"early-{n}" for n in range(10)}
                await reader.wait(lambda: early <= set(reader.counts()) or worker.process.poll() is not None, 120,
                                  what="the early answers, past the slow request")
                assert worker.process.poll() is None, worker.log_path.read_text()[-3000:]
                assert "slow" not in reader.counts(), "the slow request must still be pending at the kill"
                point, metadata = await _committed(bootstrap, stack.group, partition)
                if how == "kill":
                    proxy.clear()  # the restarted worker fetches the image at once: the test need not wait twice
                    worker.kill()
                    worker.start()
                else:
                    second.start()
                    await reader.wait(lambda: second.log_path.exists()
                                      and '"partitions assigned"' in second.log_path.read_text(), 120,
                                      what="the second worker in the group")
                    proxy.release()  # the new owner fetches the image at once; the old one's fetch ends too
                await produce(bootstrap, stack.requests, later)
                running = [w for w in (worker, second) if w.process is not None]
                await reader.wait(lambda: set(ids) <= set(reader.counts())
                                  or any(w.process.poll() is not None for w in running), 120,
                                  what=f"every answer after the {how}")
                assert all(w.process.poll() is None for w in running), worker.log_path.read_text()[-3000:]
            finally:
                for w in (worker, second):
                    if w.process is not None:
                        assert w.terminate(60) == 0, w.log_path.read_text()[-3000:]
            await reader.caught_up()
            logs = "".join(w.log_path.read_text() for w in (worker, second) if w.log_path.exists())
            return reader.counts(), decode_done(point, metadata), point, logs

    counts, named, point, log = run(scenario())
    assert point == 0, "the slow request at offset 0 held the commit point"
    assert named == set(range(1, 11)), "the commit named the ten early answers beyond the point"
    assert {i: c for i, c in counts.items() if c != 1} == {}, "an answer lost or doubled"
    assert set(counts) == set(ids)
    assert '"skipped requests answered before"' in log and '"count": 10' in log, log[-3000:]
