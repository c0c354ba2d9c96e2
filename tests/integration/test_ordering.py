"""A slow request does not hold up the requests behind it, and answers stay exactly once (issue: head-of-line).

On the session's broker and store, with the object store slowed for one image through the fault proxy:

* with ``ordering = key`` (the default) text requests queued behind a slow image request on its partition are
  answered (visible to read_committed readers) before it, and a request with the slow one's key is not;
  with ``ordering = partition`` every later request waits for it, as before;
* a partition read as far past its oldest request as the commit metadata can speak for is paused there, its
  commit metadata stays within ``offset_metadata_max_bytes``, and nothing is lost once the oldest is answered;
* the head-of-line and stream benchmarks run.

A worker killed or rebalanced in the middle: tests/system/test_ordering.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from d3stream_client.connection import partition_for

from d3stream.kafka.offsets import window_offsets
from d3stream.service import Service
from tests.support.media_makers import make_png
from tests.support.stream_helpers import Q_NOUL, Reader, run, serve

pytestmark = pytest.mark.timeout(300)

SLOW_S = 3.0


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


@pytest.mark.parametrize("ordering", ["key", "partition"])
def test_text_requests_pass_a_slow_image_request_unless_they_share_its_key(stack, proxy, qwen35_model, ordering):
    slow_key, *others = _keys_on(0, 9, "customer")
    records = [_record("slow", slow_key, _slow_image(stack, proxy, "a", SLOW_S)),
               _record("same-key", slow_key)]
    records += [_record(f"text-{n}", key) for n, key in enumerate(others)]
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, s3_read_timeout=30, ordering=ordering)
    ids = [json.loads(value)["id"] for _, value in records]
    _, reader = run(serve(stack, settings, qwen35_model, records, ids))

    counts = reader.counts()
    assert all(counts[i] == 1 for i in ids), counts
    assert all(answer["source"]["partition"] == 0 for answer in reader.answers())
    # Answers are keyed by request id, so they land on different answer partitions and the answers of one
    # transaction may be read in any order: their records' creation times say which left first.
    created = {json.loads(r.value)["id"]: r.timestamp for r in reader.records}
    passed = [i for i in ids[2:] if created[i] < created["slow"]]
    if ordering == "key":
        assert passed == ids[2:], "every text request of other keys left before the slow one"
        assert reader.seen_at[ids[-1]] < reader.seen_at["slow"], "and was readable before it"
    else:
        assert passed == [], "in partition order nothing passes the slow request"
    assert created["same-key"] >= created["slow"], "a request with the slow one's key never passes it"


async def _committed(bootstrap: str, group: str, partition: TopicPartition) -> tuple[int, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = (await admin.list_consumer_group_offsets(group, partitions=[partition]))[partition]
    finally:
        await admin.close()
    return found.offset, found.metadata


def test_a_full_read_window_pauses_the_partition_and_nothing_is_lost(stack, proxy, qwen35_model):
    window = window_offsets(64)
    keys = _keys_on(2, window + 40, "flood")
    slow = _slow_image(stack, proxy, "c", 6.0)
    records = [_record("slow", keys[0], slow)] + [_record(f"flood-{n}", key) for n, key in enumerate(keys[1:])]
    ids = [json.loads(value)["id"] for _, value in records]
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, s3_read_timeout=30, offset_metadata_max_bytes=64,
                              commit_interval_ms=100)
    partition = TopicPartition(stack.requests, 2)
    metadata_seen: list[str] = []

    async def watch(service: Service, reader: Reader, task: asyncio.Task) -> None:
        while "slow" not in reader.counts() and not task.done():
            point, metadata = await _committed(stack.broker.bootstrap_servers, stack.group, partition)
            metadata_seen.append(metadata)
            await asyncio.sleep(0.2)

    _, reader = run(serve(stack, settings, qwen35_model, records, ids, timeout=180, during=watch))
    counts = reader.counts()
    assert {i: c for i, c in counts.items() if c != 1} == {} and set(counts) == set(ids)
    before = [i for i in ids[1:] if reader.seen_at[i] < reader.seen_at["slow"]]
    assert 0 < len(before) <= window, f"{len(before)} answers passed the slow request; the window is {window}"
    assert len(before) < len(ids) - 1, "requests past the window waited for the slow one"
    assert metadata_seen and max(len(m.encode()) for m in metadata_seen) <= 64
    assert any(m for m in metadata_seen), "commits named answers beyond the slow request while it was pending"


def test_the_head_of_line_benchmark_reports_text_latency_for_each_run(stack, qwen35_checkpoint):
    from d3stream.benchmarks.bench_ordering import RUNS, head_of_line, head_of_line_markdown

    report = head_of_line(qwen35_checkpoint, seconds=2, delay_s=0.5, stack=(stack.broker, stack.store))
    assert report["stream"]["delay_s"] == 0.5
    for name, _, _ in RUNS:
        assert report[name]["text"]["p95_ms"] >= report[name]["text"]["p50_ms"] > 0
        assert report[name]["image"]["p50_ms"] > 0
    assert "text_p95_vs_fast_store" in report[RUNS[1][0]]
    assert head_of_line_markdown(report).count("| slow store") == 2


def test_the_stream_benchmark_answers_every_request_both_ways(stack, qwen35_checkpoint):
    from d3stream.benchmarks.bench_stream import RUNS, stream_bench, stream_markdown

    report = stream_bench(qwen35_checkpoint, 16, rounds=1, stack=(stack.broker, stack.store))
    assert report["with_images"] >= 1 and report["images"] >= report["with_images"]
    for name in RUNS:  # a run that answered any request with an error raises instead of reporting
        assert report[name]["requests_per_s"] > 0 and len(report["by_round"][name]) == 1
    assert report["mixed_ratio"] > 0 and report["text_ratio"] > 0
    assert "| mixed (images) |" in stream_markdown(report)
