"""The reliability report: a stream of requests served while things break, then an exact count.

``d3stream chaos`` runs on the same embedded broker and object store as ``demo``. It publishes a mix of
valid requests (text and image) and fuzzed events (random bytes, invalid UTF-8, deep nesting, huge
strings, NaN, wrong types, unknown fields, 300 options, duplicate keys), then serves them with real
``d3stream serve`` processes while it

* SIGKILLs the worker at random moments and starts a new one (``--kills`` cycles),
* restarts the Kafka broker once,
* takes the object store down for a few seconds once,

and finally counts, from the answer topic read with ``read_committed``: requests sent, answered,
duplicated, lost, error answers by code, dead letters, restarts survived and wall time. In
``exactly_once`` mode the promise is 0 lost and 0 duplicated; in ``at_least_once`` mode 0 lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker, ObjectStore
    from d3stream.dev.progress import Progress
    from d3stream.runtime import D3
    from d3stream.settings import DeliveryName

CHAOS_BUCKET = "d3stream-chaos"


# ---------------------------------------------------------------------------------------- the stream


def valid_request(number: int, rng: random.Random, image_uri: str | None) -> dict[str, object]:
    """A small valid request; every seventh one sees an image."""
    questions: dict[str, object] = {"ok": {"type": "noul", "instructions": f"Is item {number} in stock?"}}
    if rng.random() < 0.5:
        questions["route"] = {"type": "choice", "criteria": {"a": "first", "b": "second", "c": None}}
    request: dict[str, object] = {"id": f"req-{number:06d}", "state": f"Order {number}: " + "item " * rng.randint(1, 40),
                               "questions": questions}
    if image_uri and number % 7 == 0:
        request["images"] = [image_uri]
    return request


def fuzzed_event(number: int, rng: random.Random) -> tuple[bytes, bytes]:
    """(key, value) of one hostile or malformed record; its key is always its id, so it can be counted."""
    key = f"fuzz-{number:06d}"
    kind = number % 10
    base: dict[str, object] = {"id": key, "state": "x", "questions": {"q": {"type": "noul"}}}
    if kind == 0:
        value = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    elif kind == 1:
        value = b'{"id": "' + key.encode() + b'", "state": "\xff\xfe"}'
    elif kind == 2:
        value = ("[" * 5000 + "]" * 5000).encode()
    elif kind == 3:
        value = json.dumps(dict(base, state="s" * rng.randint(10_000, 200_000))).encode()
    elif kind == 4:
        value = json.dumps(base).replace('"x"', "NaN").encode()
    elif kind == 5:
        value = json.dumps(dict(base, questions=["not", "a", "mapping"])).encode()
    elif kind == 6:
        value = json.dumps(dict(base, unknown_field={"nested": [1, 2, 3]}, images=[])).encode()
    elif kind == 7:
        options = {f"o{i}": i for i in range(300)}
        value = json.dumps(dict(base, questions={"q": {"type": "choice", "criteria": options}})).encode()
    elif kind == 8:
        # duplicate keys: refused as invalid_request naming the key (d3stream_client.validation.decode_request)
        value = (f'{{"id": "{key}", "state": 1, "state": [2], "questions": {{"q": {{"type": "noul"}}}}}}').encode()
    else:
        value = json.dumps(dict(base, images=["http://example.invalid/a.png", "/etc/passwd"])).encode()
    return key.encode(), value


def build_stream(requests: int, fuzzed: int, seed: int, image_uri: str | None) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    records = [
        (f"req-{n:06d}".encode(), json.dumps(valid_request(n, rng, image_uri)).encode()) for n in range(requests)
    ]
    records += [fuzzed_event(n, rng) for n in range(fuzzed)]
    rng.shuffle(records)
    return records


# ------------------------------------------------------------------------------------------- workers


# What a worker process runs after the interpreter: the production worker.
SERVE = ("-m", "d3stream", "serve")


@dataclass
class WorkerProcess:
    """One worker process, restartable: ``d3stream serve``, or another entry point (``arguments``, after the
    interpreter; bench fleet's runs a stand-in model)."""

    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    arguments: tuple[str, ...] = SERVE
    nice: int = 0  # started this much below the caller's CPU priority (``nice -n``)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        niced = ("nice", "-n", str(self.nice)) if self.nice else ()
        self.process = subprocess.Popen(
            [*niced, sys.executable, *self.arguments], env=self.env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.starts += 1

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def terminate(self, timeout: float = 120.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def worker_env(settings: Mapping[str, object]) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in settings.items():
        env[f"D3STREAM_{name.upper()}"] = ",".join(value) if isinstance(value, list) else str(value)
    return env


# ------------------------------------------------------------------------------------------- counting


@dataclass
class Tally:
    sent: int = 0
    answers: Counter[str | None] = field(default_factory=Counter)  # answers per request id (None: no id)
    errors_by_code: Counter[str] = field(default_factory=Counter)

    def add(self, answer: Mapping[str, object]) -> None:
        request_id = answer.get("id")
        self.answers[request_id if isinstance(request_id, str) else None] += 1
        error = answer.get("error")
        if error:
            assert isinstance(error, dict)  # the contract's error object: code and message
            self.errors_by_code[error["code"]] += 1


async def count_topic(bootstrap: str, topic: str, settle_s: float = 30.0) -> list[dict[str, object]]:
    """Every committed record of a topic, up to its end at the time of the call.

    A transaction whose commit has returned may not have its markers written yet, and until then its
    records lie beyond the partition's last stable offset. So reading goes on until the stable end has
    caught up with the high watermark (every transaction settled), for at most ``settle_s``.
    """
    from aiokafka import TopicPartition

    from d3stream.kafka.connection import raw_client

    consumer = raw_client("consumer", bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                          isolation_level="read_committed", auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        if not partitions:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - a fresh client knows no topics yet
            partitions = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        records: list[dict[str, object]] = []
        deadline = time.monotonic() + settle_s
        while True:
            ends = await consumer.end_offsets(partitions)  # read_committed: the last stable offsets
            while True:
                # Transaction markers occupy offsets too: positions move past them without records.
                batches = await consumer.getmany(timeout_ms=200)
                for batch in batches.values():
                    records += [json.loads(r.value) for r in batch]
                positions = {p: await consumer.position(p) for p in partitions}
                if all(positions[p] >= ends[p] for p in partitions):
                    break
            settled = all((consumer.highwater(p) or 0) <= ends[p] for p in partitions)
            if settled or time.monotonic() > deadline:
                return records
            await asyncio.sleep(0.1)
    finally:
        await consumer.stop()


# ---------------------------------------------------------------------------------------------- run


CHAOS_TOPICS: dict[str, object] = {"request_topics": ["chaos.requests"], "answer_topic": "chaos.answers",
                                   "dead_letter_topic": "chaos.dead-letters", "provenance_topic": "chaos.provenance"}


def _prepare_stack(broker: KafkaBroker, store: ObjectStore, image: bytes) -> None:
    """The bucket with the image the valid requests name, and the stream's topics."""
    store.create_bucket(CHAOS_BUCKET)
    store.client().put_object(Bucket=CHAOS_BUCKET, Key="img.png", Body=image)
    for topic in ("chaos.requests", "chaos.answers", "chaos.dead-letters"):
        broker.create_topic(topic, exist_ok=True)


def _worker_settings(broker: KafkaBroker, store: ObjectStore, checkpoint: Path,
                     mode: DeliveryName) -> dict[str, object]:
    """The ``d3stream serve`` settings of the chaos worker (its environment, ``worker_env``)."""
    return {
        **CHAOS_TOPICS,
        "bootstrap_servers": broker.bootstrap_servers,
        "group_id": "d3stream-chaos",
        "group_instance_id": "chaos-worker-0",  # static membership: a restarted worker rejoins at once
        "session_timeout_ms": 6000,
        "model": str(checkpoint),
        "delivery": mode,
        "s3_endpoint_url": store.endpoint_url,
        "s3_region": store.region,
        "s3_max_attempts": 2,
        "s3_connect_timeout": 1,
        "s3_read_timeout": 2,
        "media_allowlist": [CHAOS_BUCKET],
        "commit_interval_ms": 200,
        # A CPU worker: prompts past 4k tokens (the fuzzed huge states) are refused, not run for minutes.
        "max_prompt_tokens": 4096,
        "linger_ms": 10,
        "metrics_port": "",
        "log_format": "json",
        "log_level": "warning",
    }


@dataclass
class _Watch:
    """The ids of the stream answered so far, read off the answer topic between disruptions."""

    bootstrap: str
    topic: str
    ids: set[str]
    bar: Progress
    answered: set[str] = field(default_factory=set)

    async def until(self, seconds: float) -> None:
        """Read answers for ``seconds``, or until every id is answered."""
        from d3stream_client.subscriber import consume_answers

        def note(answer: Mapping[str, object]) -> None:
            request_id = answer.get("id")
            if isinstance(request_id, str) and request_id in self.ids and request_id not in self.answered:
                self.answered.add(request_id)
                self.bar.update()

        await consume_answers(self.bootstrap, self.topic, timeout_s=seconds, on_record=note,
                              stop=lambda: self.answered >= self.ids)


async def _disrupt(events: list[str], watch: _Watch, worker: WorkerProcess, broker: KafkaBroker,
                   store: ObjectStore, rng: random.Random) -> int:
    """Each event after a few seconds of serving: a worker SIGKILLed and restarted, the broker restarted,
    the object store down for 3 s. Returns the worker restarts."""
    restarts = 0
    for event in events:
        await watch.until(rng.uniform(2.0, 6.0))
        if event == "kill":
            worker.kill()
            worker.start()
            restarts += 1
        elif event == "broker":
            broker.restart()
        else:
            store.stop()
            await asyncio.sleep(3.0)
            store.start()
    return restarts


class Counts(TypedDict):
    """The stream's requests: sent, answered, duplicated and lost, and the error answers by code."""

    sent: int
    answered: int
    duplicated: int
    lost: int
    errors_by_code: dict[str, int]


class ChaosReport(Counts):
    """``d3stream chaos``: the counts, the dead letters, and what was broken on the way."""

    mode: DeliveryName
    dead_letters: int
    restarts: int
    broker_restarts: int
    store_outages: int
    seconds: float


def _count(ids: set[str], answers: list[dict[str, object]]) -> Counts:
    """Answered, duplicated and lost ids of the stream, and the error answers by code."""
    tally = Tally(sent=len(ids))
    for answer in answers:
        tally.add(answer)
    counts = tally.answers
    return {
        "sent": tally.sent,
        "answered": sum(1 for i in ids if counts[i] > 0),
        "duplicated": sum(max(0, counts[i] - 1) for i in ids),
        "lost": sum(1 for i in ids if counts[i] == 0),
        "errors_by_code": dict(sorted(tally.errors_by_code.items())),
    }


async def run_chaos(
    *,
    requests: int = 10_000,
    fuzzed: int = 10_000,
    kills: int = 20,
    mode: DeliveryName = "exactly_once",
    seed: int = 0,
    broker_restart: bool = True,
    store_outage: bool = True,
    timeout_s: float = 3600.0,
    progress: bool = True,
    workdir: Path | None = None,
) -> ChaosReport:
    """Run the chaos scenario on an embedded stack; returns the tally."""
    import tempfile

    from d3stream_client.publisher import produce
    from tqdm import tqdm

    from d3stream.dev.demo import demo_checkpoint, sample_png
    from d3stream.dev.infra import local_stack

    started = time.perf_counter()
    rng = random.Random(seed)
    folder = Path(workdir or tempfile.mkdtemp(prefix="d3stream-chaos-"))
    with local_stack(progress=progress) as (broker, store):
        checkpoint = demo_checkpoint()
        _prepare_stack(broker, store, sample_png())
        records = build_stream(requests, fuzzed, seed, f"s3://{CHAOS_BUCKET}/img.png")
        ids = {key.decode() for key, _ in records}
        await produce(broker.bootstrap_servers, "chaos.requests", records)
        env = worker_env(_worker_settings(broker, store, checkpoint, mode))
        env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = store.access_key, store.secret_key
        worker = WorkerProcess(env, folder / "worker.log")
        bar = tqdm(total=len(ids), desc=f"chaos ({mode})", unit="req", disable=not progress, file=sys.stderr)
        watch = _Watch(broker.bootstrap_servers, "chaos.answers", ids, bar)
        events = ["kill"] * kills + (["broker"] if broker_restart else []) + (["store"] if store_outage else [])
        rng.shuffle(events)
        worker.start()
        deadline = time.monotonic() + timeout_s
        restarts = await _disrupt(events, watch, worker, broker, store, rng)
        await watch.until(max(1.0, deadline - time.monotonic()))
        worker.terminate()
        bar.close()
        answers = await count_topic(broker.bootstrap_servers, "chaos.answers")
        letters = await count_topic(broker.bootstrap_servers, "chaos.dead-letters")
    return {
        "mode": mode,
        **_count(ids, answers),
        "dead_letters": len(letters),
        "restarts": restarts,
        "broker_restarts": int(broker_restart),
        "store_outages": int(store_outage),
        "seconds": round(time.perf_counter() - started, 1),
    }


# The report's figures in the table's order.
_TABLE: tuple[Literal["sent", "answered", "duplicated", "lost", "dead_letters", "restarts", "broker_restarts",
                      "store_outages", "seconds"], ...] = (
    "sent", "answered", "duplicated", "lost", "dead_letters", "restarts", "broker_restarts", "store_outages",
    "seconds")


def iter_table(report: ChaosReport) -> Iterator[str]:
    yield f"{'mode':<26}{report['mode']}"
    for key in _TABLE:
        yield f"{key:<26}{report[key]}"
    for code, count in report["errors_by_code"].items():
        yield f"{'error ' + code:<26}{count}"


# -------------------------------------------------------------------------------- what a mode costs


class ModeCost(TypedDict):
    """One delivery mode on one stream (``measure_mode``): a flood (``rate`` None) or paced."""

    mode: DeliveryName
    requests: int
    rate: float | None
    answers_per_s: float
    latency_ms_p50: float
    latency_ms_p99: float


async def measure_mode(broker: KafkaBroker, model: D3, mode: DeliveryName, *, requests: int,
                       rate: float | None) -> ModeCost:
    """Serve one stream in ``mode``; latency is request timestamp -> answer readable by read_committed."""
    from d3stream_client.publisher import produce
    from d3stream_client.subscriber import consume_answers

    from d3stream.service import Service
    from d3stream.settings import Settings

    tag = f"cost-{mode.replace('_', '-')}-{'flood' if rate is None else int(rate)}-{time.time_ns()}"
    requests_topic, answers_topic = f"{tag}.requests", f"{tag}.answers"
    for topic in (requests_topic, answers_topic):
        broker.create_topic(topic, exist_ok=True)
    settings = Settings.from_flat(bootstrap_servers=broker.bootstrap_servers, request_topics=[requests_topic],
                        answer_topic=answers_topic, dead_letter_topic=f"{tag}.dlq", provenance_topic=f"{tag}.prov",
                        group_id=tag, delivery=mode, commit_interval_ms=100, linger_ms=5, metrics_port=None)
    rng = random.Random(1)
    stream = [(f"req-{n:06d}".encode(), json.dumps(valid_request(n, rng, None)).encode()) for n in range(requests)]
    service = Service(settings, model)
    serving = asyncio.create_task(service.run())
    latencies: list[float] = []

    def note(answer: Mapping[str, object]) -> None:
        source = answer["source"]
        assert isinstance(source, dict)  # the contract's source: topic, partition, offset, timestamp
        latencies.append(time.time() * 1000 - source["timestamp"])

    started = time.perf_counter()
    reading = asyncio.create_task(consume_answers(broker.bootstrap_servers, answers_topic, expected=requests,
                                                  timeout_s=600, on_record=note))
    if rate is None:
        await produce(broker.bootstrap_servers, requests_topic, stream)
    else:
        await publish_paced(broker.bootstrap_servers, requests_topic, stream, rate)
    await reading
    seconds = time.perf_counter() - started
    service.stop()
    await serving
    latencies.sort()

    def quantile(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 1) if latencies else float("nan")

    return {"mode": mode, "requests": requests, "rate": rate, "answers_per_s": round(len(latencies) / seconds, 1),
            "latency_ms_p50": quantile(0.5), "latency_ms_p99": quantile(0.99)}


async def publish_paced(bootstrap: str, topic: str, stream: list[tuple[bytes, bytes]], rate: float) -> None:
    """Publish ``stream`` at ``rate`` records/s: one producer, a tenth of a second's records per tick, each
    tick scheduled from the start (so the time spent sending does not slow the rate down)."""
    from d3stream_client.contract import HEADERS

    from d3stream.kafka.connection import raw_client

    producer = raw_client("producer", bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        per_tick = max(1, round(rate / 10))
        started = time.monotonic()
        for tick, first in enumerate(range(0, len(stream), per_tick)):
            await asyncio.sleep(max(0.0, started + tick * 0.1 - time.monotonic()))
            sends = [await producer.send(topic, value=value, key=key, headers=HEADERS)
                     for key, value in stream[first : first + per_tick]]
            await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def delivery_costs(requests: int = 1000, rate: float = 100.0, progress: bool = False) -> list[ModeCost]:
    """Both delivery modes on the same stream and machine: flood throughput, and latency at ``rate``/s."""
    from d3stream.dev.demo import demo_checkpoint
    from d3stream.dev.infra import local_stack
    from d3stream.runtime import D3

    rows: list[ModeCost] = []
    with local_stack(progress=progress) as (broker, _store):
        model = D3.from_pretrained(demo_checkpoint())
        modes: tuple[DeliveryName, ...] = ("at_least_once", "exactly_once")
        for mode in modes:
            rows.append(await measure_mode(broker, model, mode, requests=requests, rate=None))
            rows.append(await measure_mode(broker, model, mode, requests=min(requests, int(rate * 10)), rate=rate))
    return rows
