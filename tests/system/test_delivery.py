"""Delivery guarantees under crashes, broker restarts, zombies and rebalances, on the real broker.

* Crash cycles: real ``d3stream serve`` processes (``d3stream.benchmarks.chaos.WorkerProcess``) SIGKILLed at random
  moments while a stream of valid and hostile requests (``d3stream.benchmarks.chaos.build_stream``) is being served,
  then restarted; the answer topic is counted with a fresh ``read_committed`` reader
  (``d3stream.benchmarks.chaos.count_topic``). exactly_once: every request exactly one committed answer.
  at_least_once: every request at least one, and the duplicates carry the same key and ``answer_id``.
* The broker restarts under an in-process service: nothing lost, nothing doubled.
* A zombie: two ``CommitInTransaction`` policies whose producers share a partition's transactional id. Once the
  newer one initialised, the older one's commit is fenced and its buffered answers never become visible.
* A second worker joins and leaves during a stream: each request exactly one committed answer. (This
  once failed now and then: a new owner read the committed offset before the previous owner's last
  transaction was complete; newly assigned partitions now settle first, see service.py.)
* A commit while the rebalance callback is creating a partition's transactional producer does not create a
  second one (which would fence the worker itself: its requests of that partition were then never answered,
  or committed past).
* Work that outlives ``rebalance_drain_s`` is not committed a second time when its partition comes back.
"""


from __future__ import annotations

import asyncio
import collections
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.benchmarks.chaos import WorkerProcess, build_stream, count_topic, worker_env
from d3stream.kafka.commits import Answered, CommitInTransaction
from d3stream.kafka.offsets import OffsetTracker
from d3stream.kafka.publishing import Outgoing
from d3stream.service import Service
from tests.support.media_makers import make_png
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    GatedModel,
    Reader,
    SlowModel,
    assigned_and_ready,
    committed,
    read_all,
    record,
    run,
    stop,
)

pytestmark = pytest.mark.timeout(300)


# ====================================================================================== crash cycles


def crash_cycles(stack, checkpoint: Path, folder: Path, *, mode: str, requests: int, fuzzed: int, kills: int,
                 commit_interval_ms: int, kill_after_s: tuple[float, float], seed: int) -> dict[str, Any]:
    """Serve ``build_stream(requests, fuzzed)`` with one ``d3stream serve`` process that is SIGKILLed and
    restarted ``kills`` times, each time a random ``kill_after_s`` after the new incarnation started serving
    (at_least_once: after its first new answers), while the stream is published one chunk per incarnation
    (so kills land with answers computed but not committed). Returns the count from a fresh reader."""
    rng = random.Random(seed)
    image_uri = stack.put("chaos/img.png", make_png(48, 40, seed=seed))
    records = build_stream(requests, fuzzed, seed, image_uri)
    ids = {key.decode() for key, _ in records}
    assert len(ids) == len(records)
    chunks = [records[n::kills + 1] for n in range(kills + 1)]
    bootstrap = stack.broker.bootstrap_servers
    env = worker_env({
        "bootstrap_servers": bootstrap,
        "request_topics": [stack.requests],
        "answer_topic": stack.answers,
        "dead_letter_topic": stack.dead_letters,
        "provenance_topic": stack.provenance,
        "group_id": stack.group,
        "group_instance_id": f"{stack.group}-worker-0",  # static membership: a restarted worker rejoins at once
        "session_timeout_ms": 6000,
        "model": str(checkpoint),
        "delivery": mode,
        "s3_endpoint_url": stack.store.endpoint_url,
        "s3_region": stack.store.region,
        "s3_max_attempts": 2,
        "s3_connect_timeout": 1,
        "s3_read_timeout": 2,
        "media_allowlist": [stack.bucket],
        "commit_interval_ms": commit_interval_ms,
        "linger_ms": 10,
        "metrics_port": "",
        "log_format": "json",
        "log_level": "info",
    })
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = stack.store.access_key, stack.store.secret_key
    env.pop("D3STREAM_CONFIG", None)
    worker = WorkerProcess(env, folder / f"worker-{mode}.log")
    published: set[str] = set()
    at_kill: list[tuple[int, int]] = []  # (records published, records committed) when each SIGKILL landed

    async def scenario() -> None:
        async with Reader(bootstrap, stack.answers) as reader:
            worker.start()
            try:
                for cycle, chunk in enumerate(chunks):
                    await produce(bootstrap, stack.requests, chunk)
                    published.update(key.decode() for key, _ in chunk)
                    if cycle == kills:
                        break
                    # Kill this incarnation at a random moment once it serves: before or after its first
                    # commit (every commit_interval_ms), with answers computed but not yet committed.
                    await reader.wait(lambda: _serving(worker) >= worker.starts or worker.process.poll() is not None,
                                      120, what=f"worker start {worker.starts} serving")
                    assert worker.process.poll() is None, worker.log_path.read_text()[-3000:]
                    if mode == "at_least_once":  # published at once: wait for some, so the kill leaves duplicates
                        before = len(reader.counts())
                        await reader.wait(lambda before=before: len(reader.counts()) > before, 60, what="new answers")
                    await asyncio.sleep(rng.uniform(*kill_after_s))
                    worker.kill()
                    at_kill.append((len(published), await _committed_records(bootstrap, stack.group, stack.requests)))
                    worker.start()
                await _until_all_answered(reader, ids, worker, stall_s=45)
            finally:
                rc = worker.terminate(60)
            assert rc == 0, f"the last worker did not stop cleanly: {rc}"

    run(scenario())
    answers = run(count_topic(bootstrap, stack.answers))
    letters = run(count_topic(bootstrap, stack.dead_letters))
    counts = collections.Counter(a["id"] for a in answers)
    return {
        "ids": ids,
        "answers": answers,
        "letters": letters,
        "counts": counts,
        "lost": sorted(i for i in ids if counts[i] == 0),
        "duplicated": {i: c for i, c in counts.items() if c > 1},
        "strangers": sorted(set(counts) - ids),
        "at_kill": at_kill,
        "starts": worker.starts,
        "log": worker.log_path.read_text(errors="replace"),
    }


async def _committed_records(bootstrap: str, group: str, topic: str, partitions: int = 4) -> int:
    """Records of ``topic`` the group has committed (the sum of its committed offsets)."""
    return sum((await committed(bootstrap, group, topic, partitions)).values())


def _serving(worker: WorkerProcess) -> int:
    """How many incarnations of the worker reached "serving" (JSON log lines)."""
    try:
        return worker.log_path.read_text(errors="replace").count('"event": "serving"')
    except FileNotFoundError:
        return 0


async def _until_all_answered(reader: Reader, ids: set[str], worker: WorkerProcess, stall_s: float,
                              limit_s: float = 180) -> None:
    """Until every id is answered; fails fast when the worker died or no new answer came for ``stall_s``."""
    deadline = time.monotonic() + limit_s
    answered, last_progress = 0, time.monotonic()
    while not ids <= set(reader.counts()):
        now_answered = len(ids & set(reader.counts()))
        if now_answered > answered:
            answered, last_progress = now_answered, time.monotonic()
        log = worker.log_path.read_text(errors="replace")
        assert worker.process.poll() is None, f"the worker exited:\n{log[-3000:]}"
        if time.monotonic() - last_progress > stall_s or time.monotonic() > deadline:
            # A worker that fenced its own partition's producer stops answering that partition: say so.
            incarnation = log.rsplit('"event": "serving"', 1)[-1]
            fenced = incarnation.count("fenced: another worker owns this partition now")
            raise AssertionError(
                f"stalled at {answered}/{len(ids)} answers (missing {sorted(ids - set(reader.counts()))[:8]}); "
                f"self-fencing warnings in the last incarnation: {fenced}\n{log[-2500:]}"
            )
        await asyncio.sleep(0.2)


def _check_common(result: dict[str, Any], stack, kills: int) -> None:
    assert result["starts"] == kills + 1
    assert not result["lost"], f"requests without a committed answer: {result['lost'][:10]}"
    assert not result["strangers"], result["strangers"][:10]
    # Kills landed mid-stream: most of them with published requests whose offsets were not committed yet.
    busy = sum(1 for published, committed in result["at_kill"] if committed < published)
    assert busy >= (kills + 1) // 2, result["at_kill"]
    # Every fuzzed event got an error answer; the valid ones got answers (or a per-request error).
    by_id = {a["id"]: a for a in result["answers"]}
    for rid, answer in by_id.items():
        if rid.startswith("fuzz-"):
            assert "error" in answer or "answers" in answer
        else:
            assert "answers" in answer, (rid, answer.get("error"))
    # The workers' logs (info level, credentials in their environment) never show the secret.
    assert stack.store.secret_key not in result["log"]


def test_exactly_once_survives_sigkill_cycles(stack, qwen35_checkpoint, tmp_path, capsys):
    kills = 3  # each incarnation costs a worker start (about 7 CPU-seconds): three kills cover both sides of a commit
    # Commits every 3 s, kills 0.3-5 s after an incarnation starts serving: some kills land before its first
    # commit (everything it answered is lost with it and answered again), some after.
    result = crash_cycles(stack, qwen35_checkpoint, tmp_path, mode="exactly_once", requests=150, fuzzed=50,
                          kills=kills, commit_interval_ms=3000, kill_after_s=(0.3, 5.0), seed=7)
    with capsys.disabled():
        print(f"\n[exactly_once crash cycles] sent {len(result['ids'])}, answers {len(result['answers'])}, "
              f"duplicated {len(result['duplicated'])}, lost {len(result['lost'])}, kills at (published, committed) "
              f"{result['at_kill']}")
    _check_common(result, stack, kills)
    assert not result["duplicated"], f"answered more than once: {result['duplicated']}"
    # Dead letters are inside the same transactions: exactly one per undecodable record too.
    undecodable = sum(1 for a in result["answers"] if (a.get("error") or {}).get("code") == "undecodable_event")
    assert undecodable > 0
    assert len(result["letters"]) == undecodable, (len(result["letters"]), undecodable)
    assert collections.Counter(json.dumps(letter["source"], sort_keys=True) for letter in result["letters"]).most_common(1)[0][1] == 1


def test_at_least_once_duplicates_after_sigkill_share_key_and_answer_id(stack, qwen35_checkpoint, tmp_path, capsys):
    kills = 1
    # A long commit interval: each kill leaves published but uncommitted answers, which are answered again.
    result = crash_cycles(stack, qwen35_checkpoint, tmp_path, mode="at_least_once", requests=50, fuzzed=16,
                          kills=kills, commit_interval_ms=10_000, kill_after_s=(0.3, 2.0), seed=11)
    with capsys.disabled():
        print(f"\n[at_least_once crash cycles] sent {len(result['ids'])}, answers {len(result['answers'])}, "
              f"duplicated {len(result['duplicated'])}, lost {len(result['lost'])}")
    _check_common(result, stack, kills)
    assert result["duplicated"], "no kill left an uncommitted answer behind: the scenario proved nothing"
    # Read again with the keys: duplicates carry the same key, answer_id and source record.
    raw = run(_read_keyed(stack.broker.bootstrap_servers, stack.answers))
    groups: dict[str, list[tuple[bytes | None, dict[str, Any]]]] = collections.defaultdict(list)
    for key, answer in raw:
        groups[answer["id"]].append((key, answer))
    for rid in result["duplicated"]:
        copies = groups[rid]
        assert len(copies) >= 2
        assert {key for key, _ in copies} == {rid.encode()}, rid
        assert len({answer["answer_id"] for _, answer in copies}) == 1, (rid, [a["answer_id"] for _, a in copies])
        assert len({json.dumps(answer["source"], sort_keys=True) for _, answer in copies}) == 1
        # Different worker incarnations answered them (the duplicate is a re-answer after a crash).
        assert len({answer["provenance"]["worker"]["pid"] for _, answer in copies}) >= 2
    # And two different requests never share an answer id.
    ids_by_answer_id = collections.defaultdict(set)
    for _, answer in raw:
        ids_by_answer_id[answer["answer_id"]].add(answer["id"])
    assert all(len(v) == 1 for v in ids_by_answer_id.values())


async def _read_keyed(bootstrap: str, topic: str) -> list[tuple[bytes | None, dict[str, Any]]]:
    async with Reader(bootstrap, topic) as reader:
        await reader.caught_up()
        return [(r.key, json.loads(r.value)) for r in reader.records]


# ===================================================================================== broker restart


def test_broker_restart_mid_stream_loses_and_doubles_nothing(stack, qwen35_model, capsys):
    """The broker stops and starts again while the service is committing. The verdict reads the answer
    topic afresh once the service is done (what a downstream consumer would see); a live reader only
    decides when to restart. When it fails it says where each missing answer is: written but never
    committed (an open or aborted transaction), or not written at all."""
    model = SlowModel(qwen35_model, 0.04)
    settings = stack.settings(max_inflight_requests=8, max_batch_rows=2, linger_ms=5, commit_interval_ms=100)
    requests = [{"id": f"br-{n:02d}", "state": f"broker restart {n}", "questions": {"noul": Q_NOUL, "level": Q_SCORE}}
                for n in range(60)]
    ids = {r["id"] for r in requests}
    bootstrap = stack.broker.bootstrap_servers
    marks: dict[str, Any] = {}

    async def scenario() -> Service:
        service = Service(settings, model)
        task = asyncio.create_task(service.run())
        try:
            async with Reader(bootstrap, stack.answers) as live:
                await live.wait(lambda: assigned_and_ready(service), 60, task, what="the service's assignment")
                await produce(bootstrap, stack.requests, [record(r) for r in requests])
                await live.wait(lambda: len(live.counts()) >= 12, 90, task, what="12 answers")
                marks["before"] = len(live.counts())
                started = time.monotonic()
                await asyncio.to_thread(stack.broker.restart)  # the service keeps running meanwhile
                marks["restart_s"] = round(time.monotonic() - started, 1)
                await live.wait(lambda: service.counts["answered"] >= len(ids), 120, task, what="every answer")
        finally:
            await stop(service, task)  # a clean stop commits what is left
        return service

    service = run(scenario())
    committed_answers = run(read_all(bootstrap, stack.answers, 4))
    counts = collections.Counter(json.loads(r.value)["id"] for r in committed_answers)
    with capsys.disabled():
        print(f"\n[broker restart] {marks}, aborted transactions {service.delivery.aborts}, "
              f"commits {service.delivery.commits}")
    assert marks["before"] < len(ids), "the restart did not land mid-stream"
    if set(counts) != ids or max(counts.values()) != 1:
        raise AssertionError(run(_where_answers_are(bootstrap, stack.answers, ids, counts)))
    assert service.counts["answered"] >= len(ids)


async def _where_answers_are(bootstrap: str, topic: str, ids: set[str], counts: collections.Counter) -> str:
    """Why a committed read of ``topic`` lacks or doubles answers: each one's offsets as written (uncommitted
    read), and each partition's log end against its last stable offset."""
    from aiokafka import TopicPartition

    async with Reader(bootstrap, topic, isolation_level="read_uncommitted") as everything:
        await everything.caught_up()
        written: dict[str, list[str]] = collections.defaultdict(list)
        for item in everything.records:
            written[json.loads(item.value)["id"]].append(f"p{item.partition}@{item.offset}")
        partitions = [TopicPartition(topic, p) for p in range(4)]
        log_ends = await everything.consumer.end_offsets(partitions)
    async with Reader(bootstrap, topic) as committed_reader:
        stable_ends = await committed_reader.consumer.end_offsets(partitions)
    missing = sorted(ids - set(counts))
    doubled = sorted(k for k, v in counts.items() if v > 1)
    return (f"missing from a committed read: {[(k, written.get(k, 'never written')) for k in missing]}; "
            f"doubled: {[(k, written.get(k)) for k in doubled]}; "
            f"log end / last stable offset per partition: "
            f"{ {tp.partition: (log_ends[tp], stable_ends[tp]) for tp in partitions} }")


# =========================================================================================== zombies


def test_a_fenced_zombie_commits_nothing_and_the_new_owner_does(stack):
    """The same partition's transactional id in two workers: the older one (paused, e.g. by a long GC
    pause, while its partition moved) tries to commit its buffered answers after the newer one
    initialised. Its transaction is fenced; a read_committed reader sees only the new owner's answers."""
    from aiokafka import AIOKafkaProducer, TopicPartition
    from structlog.testing import capture_logs

    bootstrap = stack.broker.bootstrap_servers
    tp = TopicPartition(stack.requests, 0)
    group = stack.group

    def factory(partition):  # as sinks.KafkaTopics.new_producer builds them
        options: dict[str, Any] = {}
        if partition is not None:
            options["transactional_id"] = f"d3stream-{group}-{partition.topic}-{partition.partition}"
        return AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=2,
                                **options)

    def answers(by: str) -> list[list[Outgoing]]:
        return [[Outgoing(stack.answers, f"z-{n}".encode(), json.dumps({"id": f"z-{n}", "by": by}).encode())]
                for n in range(5)]

    async def scenario():
        old = CommitInTransaction(producer_factory=factory, consumer=None, tracker=OffsetTracker(), group_id=group)
        new = CommitInTransaction(producer_factory=factory, consumer=None, tracker=OffsetTracker(), group_id=group)
        await old.start()
        await new.start()
        try:
            # The old worker owns the partition and answered offsets 0-4, not committed yet ...
            await old.assigned([tp])
            for offset, records in enumerate(answers("old")):
                old.tracker.add(tp, offset)
                await old.deliver([Answered(tp, offset, records)])
            # ... then freezes; the partition moves, and the new owner's producer initialises.
            await new.assigned([tp])
            for offset in range(5):
                new.tracker.add(tp, offset)
            # The zombie wakes up and commits.
            with capture_logs() as logs:
                await old.flush()
                zombie_second_try = old.tracker.owns(tp)
                await old.flush()  # and tries again at its next commit interval
            # The new owner answers the same requests and commits.
            for offset, records in enumerate(answers("new")):
                await new.deliver([Answered(tp, offset, records)])
            await new.flush()
        finally:
            await old.stop()
            await new.stop()
        return old, new, logs, zombie_second_try

    old, new, logs, zombie_kept_partition = run(scenario())
    assert old.commits == 0 and old.aborts >= 1
    assert any(entry["event"].startswith("fenced") for entry in logs), logs
    assert not zombie_kept_partition, "the fenced zombie still considers the partition its own"
    assert new.commits == 1, "the new owner's commit failed: the zombie fenced it back"

    visible = run(count_topic(bootstrap, stack.answers))
    assert sorted((a["id"], a["by"]) for a in visible) == [(f"z-{n}", "new") for n in range(5)]

    async def committed_offset():
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            return await admin.list_consumer_group_offsets(group)
        finally:
            await admin.close()

    assert run(committed_offset())[tp].offset == 5


def test_a_flush_during_partition_assignment_does_not_fence_the_worker_itself(stack):
    """The rebalance callback (``assigned``) creates each partition's transactional producer while the consume
    loop keeps going; a commit in that window must use the producer being created, not start a second one
    with the same transactional id (the two would fence each other: the worker would drop the partition and
    later commit past its unanswered requests)."""
    from aiokafka import AIOKafkaProducer, TopicPartition

    bootstrap = stack.broker.bootstrap_servers
    group = stack.group
    partitions = [TopicPartition(stack.requests, p) for p in range(4)]
    created: collections.Counter = collections.Counter()

    def factory(partition):  # as sinks.KafkaTopics.new_producer builds them
        options: dict[str, Any] = {}
        if partition is not None:
            options["transactional_id"] = f"d3stream-{group}-{partition.topic}-{partition.partition}"
            created[partition.partition] += 1
        return AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=2,
                                **options)

    def answer(partition: int, offset: int) -> list[Outgoing]:
        rid = f"a-{partition}-{offset}"
        return [Outgoing(stack.answers, rid.encode(), json.dumps({"id": rid}).encode())]

    async def scenario():
        delivery = CommitInTransaction(producer_factory=factory, consumer=None, tracker=OffsetTracker(), group_id=group)
        await delivery.start()
        try:
            # Records of every partition were fetched and answered while the assignment callback still runs.
            for tp in partitions:
                delivery.tracker.add(tp, 0)
                await delivery.deliver([Answered(tp, 0, answer(tp.partition, 0))])
            assigning = asyncio.create_task(delivery.assigned(partitions))
            await asyncio.sleep(0)
            await delivery.flush()  # the commit interval elapsed meanwhile
            await assigning
            # The stream goes on: one more record on every partition, answered and committed.
            for tp in partitions:
                delivery.tracker.add(tp, 1)
                await delivery.deliver([Answered(tp, 1, answer(tp.partition, 1))])
            await delivery.flush()
            await delivery.flush()
            owned = [tp.partition for tp in partitions if delivery.tracker.owns(tp)]
        finally:
            await delivery.stop()
        return owned

    owned = run(scenario())
    visible = sorted(a["id"] for a in run(count_topic(bootstrap, stack.answers)))
    offsets = run(_committed_records(bootstrap, group, stack.requests))
    assert visible == sorted(f"a-{p}-{o}" for p in range(4) for o in range(2)), (
        f"committed answers {visible}; {offsets} records committed"
    )
    assert owned == [0, 1, 2, 3], f"the worker gave up partitions nobody else owns: owns only {owned}"
    assert max(created.values()) == 1, f"transactional producers created per partition: {dict(created)}"


# ===================================================================================== rebalance


def test_a_worker_joining_and_leaving_mid_stream_answers_each_request_once(stack, qwen35_model, qwen35_checkpoint,
                                                                            capsys):
    from tests.support.model_fixtures import load_model

    second_model = load_model(qwen35_checkpoint)  # each worker its own model, as two processes would have
    settings = stack.settings(max_inflight_requests=8, max_batch_rows=2, linger_ms=5, commit_interval_ms=100)
    requests = [{"id": f"rb-{n:02d}", "state": f"rebalance {n}", "questions": {"noul": Q_NOUL, "route": Q_CHOICE}}
                for n in range(72)]
    ids = {r["id"] for r in requests}
    marks: dict[str, int] = {}

    async def scenario():
        # Three waves, so the second worker surely joins and leaves while requests are still arriving.
        bootstrap = stack.broker.bootstrap_servers
        first = Service(settings, SlowModel(qwen35_model, 0.04))
        second = Service(settings, SlowModel(second_model, 0.04))
        waves = [requests[:24], requests[24:48], requests[48:]]
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(first.run())
            try:
                await reader.wait(lambda: assigned_and_ready(first), 60, task, what="the first worker's assignment")
                await produce(bootstrap, stack.requests, [record(r) for r in waves[0]])
                await reader.wait(lambda: len(reader.counts()) >= 8, 60, task, what="the first answers")
                marks["joined_at"] = len(reader.counts())
                joining = asyncio.create_task(second.run())
                await reader.wait(lambda: assigned_and_ready(second) and not second.loop.settling, 60, task, joining,
                                  what="the second worker's assignment")
                await produce(bootstrap, stack.requests, [record(r) for r in waves[1]])
                await reader.wait(lambda: second.counts["answered"] >= 6, 60, task, joining,
                                  what="the second worker's answers")
                marks["left_at"] = len(reader.counts())
                await stop(second, joining)  # leaves the group: its partitions move back
                await produce(bootstrap, stack.requests, [record(r) for r in waves[2]])
                await reader.wait_ids(ids, 120, task)
            finally:
                first.stop()
                second.stop()
                await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 90)
            await reader.caught_up()
            return first, second, reader.counts(), reader.answers()

    first, second, counts, answers = run(scenario())
    duplicates = {k: v for k, v in counts.items() if v > 1}
    with capsys.disabled():
        print(f"\n[rebalance] {marks}, answered first {first.counts['answered']}, second "
              f"{second.counts['answered']}")
    assert set(counts) == ids, f"unanswered: {sorted(ids - set(counts))}"
    assert not duplicates, [  # (id, partition, offset, ms): which records were answered twice, how long each took
        (a["id"], a["source"]["partition"], a["source"]["offset"], a["provenance"]["timings"]["total"])
        for a in answers if a["id"] in duplicates
    ]
    assert second.counts["answered"] > 0 and first.counts["answered"] > 0




async def produce_to_partitions(bootstrap: str, topic: str, items: list[tuple[int, dict[str, Any]]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for partition, request in items:
            await producer.send_and_wait(topic, json.dumps(request).encode(), key=request["id"].encode(),
                                         partition=partition)
    finally:
        await producer.stop()


def test_work_that_outlives_the_rebalance_drain_is_not_committed_twice(stack, qwen35_model, capsys):
    """A worker stuck in a forward pass loses its partitions (the drain times out), another worker answers and
    commits them, then leaves; the first gets them back and comes unstuck. The stale answers must not be
    committed (exactly_once): neither for partitions another worker answered meanwhile, nor for records this
    worker re-read itself."""
    second_model = qwen35_model  # the second worker runs only while the first is stuck: no shared passes
    settings = stack.settings(max_inflight_requests=64, max_batch_rows=1, linger_ms=0, commit_interval_ms=100,
                              rebalance_drain_s=0.5)
    stuck = [(p, {"id": f"stale-{p}", "state": f"stuck {p}", "questions": {"noul": Q_NOUL}}) for p in range(4)]
    later = [(p, {"id": f"later-{p}", "state": f"later {p}", "questions": {"noul": Q_NOUL}}) for p in range(4)]
    ids = {r["id"] for _, r in stuck + later}
    gated = GatedModel(qwen35_model)

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        first = Service(settings, gated)
        second = Service(settings, second_model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(first.run())
            joining = None
            try:
                # The first worker takes one request of every partition and gets stuck in its forward pass.
                await produce_to_partitions(bootstrap, stack.requests, stuck)
                await reader.wait(lambda: first.in_flight.requests >= 4, 60, task, what="4 requests in flight")
                # A second worker joins: half the partitions move to it, it answers their requests and commits.
                joining = asyncio.create_task(second.run())
                await reader.wait(lambda: second.counts["answered"] >= 2 and len(reader.counts()) >= 2, 60,
                                  task, joining, what="the second worker's committed answers")
                moved = {a["source"]["partition"] for a in reader.answers()}
                # It leaves: the partitions come back to the first worker, which then gets unstuck.
                await stop(second, joining)
                await reader.wait(lambda: len(first.consumer.assignment()) == 4, 60, task,
                                  what="the partitions back at the first worker")
                # New requests arrive on every partition (the stream goes on), then the pass finishes.
                await produce_to_partitions(bootstrap, stack.requests, later)
                await reader.wait(lambda: all(first.tracker.owns(tp) for tp in first.consumer.assignment()), 60,
                                  task, what="new work in flight on every partition")
                gated.gate.set()
                await reader.wait_ids(ids, 60, task)
                await asyncio.sleep(1.0)  # a few more commit intervals: late duplicates would show now
            finally:
                gated.gate.set()
                first.stop()
                second.stop()
                await asyncio.wait_for(asyncio.gather(task, *([joining] if joining else []),
                                                      return_exceptions=True), 90)
            await reader.caught_up()
            return moved, reader.counts()

    moved, counts = run(scenario())
    duplicates = {k: v for k, v in counts.items() if v > 1}
    with capsys.disabled():
        print(f"\n[stale work] partitions that moved and came back {sorted(moved)}, duplicates {duplicates}")
    assert moved, "no partition moved to the second worker"
    assert set(counts) == ids
    assert not duplicates, f"committed twice in exactly_once mode: {duplicates}"
