"""``d3stream bench evaluate N``: how fast ``d3stream evaluate`` joins, and what its waiting state costs;
``d3stream bench evaluate-volume N``: the same at production volume, N answers waiting (``volume_bench``).

Two figures the live evaluator is sized by:

* **Throughput**: N answer events (a choice, a noul and a score each) and N label events for them are
  published to a fresh embedded broker first; one evaluate worker is then started and timed until all N
  evaluations are committed: joined pairs (request and model) per second, through the broker, the
  transactions and the changelog, on this machine.
* **State per 100,000 waiting answers**: 100,000 such answers are taken into one ``JoinState`` with no label;
  the figures are the state's own byte count (what ``evaluate_max_state_bytes`` bounds), the pages of its
  SQLite file in use, and the Python heap it grew by (``tracemalloc``): the entries live on disk.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream_client.contract import Source, decode_answer
from d3stream_client.publisher import produce

from d3stream.jobs.evaluate.join_state import JoinState, answer_entry
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker

TEAMS = ("billing", "tech", "sales")
MAX_BATCH = 2_000  # answers per state commit, as the evaluator's largest fetch


def answer_event(request_id: str, rng: random.Random) -> dict[str, object]:
    """An answer event as a worker publishes it, with a choice, a noul and a score."""
    team = [rng.random() + 0.05 for _ in TEAMS]
    levels = [rng.random() + 0.05 for _ in range(3)]
    refund = rng.random()
    return {
        "id": request_id, "answer_id": f"{request_id}-a", "model": "bench-model",
        "source": {"topic": "bench.requests", "partition": 0, "offset": 0},
        "answers": {
            "team": {"type": "choice", "choice": TEAMS[team.index(max(team))],
                     "probabilities": {k: v / sum(team) for k, v in zip(TEAMS, team, strict=True)}},
            "refund": {"type": "noul", "noul": refund, "probabilities": {"false": 1 - refund, "true": refund}},
            "urgency": {"type": "score", "probabilities": {str(i): v / sum(levels) for i, v in enumerate(levels)},
                        "legend": {"0": "low", "1": "medium", "2": "high"}},
        },
    }


def label_event(request_id: str, rng: random.Random) -> dict[str, object]:
    return {"id": request_id, "labels": {"team": rng.choice(TEAMS), "refund": rng.random() < 0.5,
                                         "urgency": rng.randrange(3)}}


class StateMemory(TypedDict):
    """What ``waiting`` answers with no label cost the state: its byte count, its file, the heap."""

    waiting_answers: int
    state_bytes: int
    disk_bytes: int
    heap_bytes: int
    state_mb_per_100k: float
    disk_mb_per_100k: float
    heap_mb_per_100k: float


class Throughput(TypedDict):
    """One evaluate worker joining ``pairs`` answers and labels, timed from its start and from its join."""

    pairs: int
    evaluations: int
    seconds: float
    pairs_per_s: float
    seconds_after_join: float
    pairs_per_s_after_join: float
    partitions: int


class EvaluateReport(TypedDict):
    """``d3stream bench evaluate``."""

    throughput: Throughput
    memory: StateMemory


def state_memory(waiting: int = 100_000) -> StateMemory:
    """The state's byte count, its file on disk and the heap growth for ``waiting`` answers with no label."""
    from d3stream.jobs.evaluate.state_store import WaitingStore

    rng = random.Random(0)
    events = [json.dumps(answer_event(f"ticket-{n:08d}", rng)).encode() for n in range(waiting)]
    with tempfile.TemporaryDirectory(prefix="d3-state-memory-") as folder:
        store = WaitingStore(Path(folder) / "state.sqlite3")
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        state = JoinState(window_ms=10**12, max_bytes=10**12, store=store)
        for n, value in enumerate(events):
            answer = decode_answer(value)
            entry = answer_entry(answer, Source(topic="bench.answers", partition=0, offset=n, timestamp=n), "live")
            assert entry is not None
            state.take_answer(answer.id, entry)
            if n % MAX_BATCH == MAX_BATCH - 1:  # what the evaluator does after each batch
                state.drain_changes()
                state.commit()
        state.drain_changes()
        state.commit()
        heap = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        disk = store.disk_bytes()
        store.close(None)
    return {"waiting_answers": waiting, "state_bytes": state.bytes, "disk_bytes": disk, "heap_bytes": heap,
            "state_mb_per_100k": round(state.bytes / waiting * 100_000 / 2**20, 1),
            "disk_mb_per_100k": round(disk / waiting * 100_000 / 2**20, 1),
            "heap_mb_per_100k": round(heap / waiting * 100_000 / 2**20, 1)}


async def _throughput(settings: Settings, count: int) -> Throughput:
    from d3stream.jobs.compare import TopicRange, read_topic
    from d3stream.jobs.evaluate import make_evaluator

    rng = random.Random(1)
    ids = [f"ticket-{n:08d}" for n in range(count)]
    await produce(settings.connection.bootstrap_servers, settings.delivery.answer_topic,
                  [(i.encode(), json.dumps(answer_event(i, rng)).encode()) for i in ids])
    await produce(settings.connection.bootstrap_servers, settings.evaluation.label_topic,
                  [(i.encode(), json.dumps(label_event(i, rng)).encode()) for i in ids])
    evaluator = await make_evaluator(settings)
    stopping = asyncio.Event()
    started = time.perf_counter()
    await evaluator.start()
    running = asyncio.ensure_future(evaluator.run(stopping))
    ready_at = None
    try:
        while evaluator.joined_total < count and not running.done():
            if ready_at is None and evaluator.ready:
                ready_at = time.perf_counter()
            await asyncio.sleep(0.05)
        finished = time.perf_counter()
        seconds = finished - started
        steady = finished - (ready_at or started)
    finally:
        stopping.set()
        await running
        await evaluator.stop()
    committed = await read_topic(settings.connection.bootstrap_servers, TopicRange(settings.evaluation.evaluation_topic), timeout_s=120)
    return {"pairs": count, "evaluations": len(committed), "seconds": round(seconds, 2),
            "pairs_per_s": round(count / seconds, 1), "seconds_after_join": round(steady, 2),
            "pairs_per_s_after_join": round(count / steady, 1), "partitions": settings.delivery.topic_partitions}


def evaluate_bench(count: int = 20_000, *, partitions: int = 4) -> EvaluateReport:
    """Throughput on a fresh embedded broker, and memory per 100,000 waiting answers."""
    from d3stream.dev.infra import KafkaBroker, ensure_jars

    ensure_jars()
    prefix = f"bench-evaluate-{time.time_ns()}"
    with KafkaBroker(partitions=partitions) as broker:
        settings = Settings.from_flat(
            bootstrap_servers=broker.bootstrap_servers, answer_topic=f"{prefix}.answers",
            label_topic=f"{prefix}.labels", evaluation_topic=f"{prefix}.evaluations",
            label_dead_letter_topic=f"{prefix}.labels-dlq", evaluate_state_topic=f"{prefix}.state",
            evaluate_group_id=prefix, client_id=prefix, transactional_id_prefix=prefix, metrics_port=None,
            topic_partitions=partitions, log_level="warning")
        for topic in (settings.delivery.answer_topic, settings.evaluation.label_topic):
            broker.create_topic(topic, partitions, exist_ok=True)
        throughput = asyncio.run(_throughput(settings, count))
    return {"throughput": throughput, "memory": state_memory()}


def evaluate_markdown(report: EvaluateReport) -> str:
    throughput, memory = report["throughput"], report["memory"]
    return (f"d3stream evaluate: {throughput['pairs']:,} answers and their labels joined in "
            f"{throughput['seconds']:g} s by one worker ({throughput['partitions']} partitions): "
            f"{throughput['pairs_per_s']:,.0f} joined pairs/s with its start, "
            f"{throughput['pairs_per_s_after_join']:,.0f}/s once it had joined its group "
            f"({throughput['evaluations']:,} evaluations committed). "
            f"{memory['waiting_answers']:,} answers waiting for labels (3 questions each): "
            f"{memory['state_mb_per_100k']:g} MB of state as evaluate_max_state_bytes counts it, "
            f"{memory['disk_mb_per_100k']:g} MB of the state file in use, "
            f"{memory['heap_mb_per_100k']:g} MB of Python heap (the entries are on disk).")


# ------------------------------------------------------------------------------------------- at volume

VOLUME_PARTITIONS = 4
VOLUME_DAYS = 3.0  # the answers' timestamps span this much stream time, ending now
VOLUME_LABELS = 20_000
PRODUCE_CHUNK = 20_000
MIN_TIMED_S = 10.0  # the worker's metrics are read once a second: a shorter ingest is not timed


def _stamped_answers(count: int, days: float, start_ms: int) -> Iterator[list[tuple[bytes, bytes, int]]]:
    """``count`` answer records (key, value, timestamp) spread evenly over ``days`` from ``start_ms``, a chunk at
    a time (millions of them are never all in memory)."""
    rng = random.Random(3)
    step = days * 86_400_000 / max(1, count)
    for first in range(0, count, PRODUCE_CHUNK):
        yield [(f"ticket-{n:09d}".encode(), json.dumps(answer_event(f"ticket-{n:09d}", rng)).encode(),
                start_ms + int(n * step)) for n in range(first, min(count, first + PRODUCE_CHUNK))]


async def _produce_stamped(servers: str, topic: str, chunks: Iterable[list[tuple[bytes, bytes, int]]],
                           tick: Callable[[int], None] | None = None) -> int:
    """Publish records with their own timestamps (the stream time the evaluator's window runs on)."""
    from d3stream.kafka.connection import raw_client

    producer = raw_client("producer", bootstrap_servers=servers, acks=1, linger_ms=20, max_batch_size=1 << 20,
                          compression_type=None)
    await producer.start()
    sent = 0
    try:
        for chunk in chunks:
            futures = [await producer.send(topic, value, key=key, timestamp_ms=stamp) for key, value, stamp in chunk]
            await asyncio.gather(*futures)
            sent += len(chunk)
            if tick is not None:
                tick(sent)
    finally:
        await producer.stop()
    return sent


class Adopted(TypedDict):
    """A worker's "evaluating partition" log line, the fields the report reads (jobs/evaluate/changelog.py logs them)."""

    partition: int
    mode: str  # tail (the changelog after the state on disk) or restore (all of it)
    records: int
    waiting: int
    seconds: float


class _Worker:
    """One ``d3stream evaluate`` process on the bench's topics, its metrics read over HTTP."""

    def __init__(self, env: dict[str, str], port: int, log: Path) -> None:
        self.env, self.port, self.log = env, port, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "d3stream", "evaluate"], env=self.env,
                                            stdout=out, stderr=subprocess.STDOUT)
        return time.perf_counter()

    def series(self) -> dict[str, float]:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return {}
        figures: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("d3stream_eval_") and " " in line:
                name, value = line.rsplit(" ", 1)
                base = name.split("{")[0]
                figures[base] = figures.get(base, 0.0) + float(value)
        return figures

    def ready(self) -> bool:
        return self.series().get("d3stream_eval_ready", 0.0) == 1.0

    async def until(self, predicate: Callable[[dict[str, float]], bool], what: str, timeout_s: float) -> float:
        deadline = time.perf_counter() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"the evaluate worker ended ({self.process.returncode}) while waiting for {what}: "
                                   f"see {self.log}")
            if predicate(self.series()):
                return time.perf_counter()
            if time.perf_counter() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:g} s: see {self.log}")
            await asyncio.sleep(1.0)  # each look renders the worker's metrics: not too often

    def rss_mb(self) -> float:
        import psutil

        assert self.process is not None
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=300)

    def adopted(self) -> list[Adopted]:
        """The worker's "evaluating partition" log lines since the log was last read (JSON)."""
        lines = self.log.read_text(encoding="utf-8").splitlines()
        found: list[Adopted] = [json.loads(line) for line in lines if '"evaluating partition"' in line]
        self.log.write_text("", encoding="utf-8")
        return found


class Ingest(TypedDict):
    """Taking the answers in: rate (None: too quick to time), memory and disk with all of them waiting."""

    seconds: float
    answers_per_s: int | None
    rss_mb: int
    state_bytes: int
    disk_bytes: int
    evicted: int
    coverage_days: float


class Join(TypedDict):
    """Joining labels spread from the oldest answer to the newest."""

    labels: int
    seconds: float
    pairs_per_s: int
    rss_mb: int
    oldest_joined: bool
    newest_joined: bool
    oldest_age_days: float


class Restart(TypedDict):
    """A clean restart: the changelog's tail read."""

    seconds: float
    modes: list[str]
    changelog_records: int
    waiting: int


class Restore(Restart):
    """A crash onto an empty state directory: the whole changelog read."""

    records_per_s: int
    rss_mb: int


class VolumeReport(TypedDict):
    """``d3stream bench evaluate-volume``."""

    waiting: int
    days: float
    partitions: int
    window_days: float
    budget_gib: float
    ingest: Ingest
    join: Join
    restart: Restart
    restore: Restore


def volume_bench(waiting: int = 2_000_000, *, labels: int = VOLUME_LABELS, days: float = VOLUME_DAYS,
                 tick: Callable[[str], None] | None = None) -> VolumeReport:
    """One evaluate worker with the default settings (window and state budget) on a fresh embedded broker:
    it takes in ``waiting`` answers stamped over ``days`` of stream time (ingest rate, resident memory with
    all of them waiting, disk bytes), joins ``labels`` labels spread from the oldest answer to the newest (join
    rate, the oldest and newest joined), is stopped cleanly and started again (the changelog's tail only),
    then killed and started on a fresh state directory (a whole restore: its rate)."""
    from d3stream.dev.infra import KafkaBroker, ensure_jars

    ensure_jars()
    prefix = f"bench-volume-{time.time_ns()}"
    with KafkaBroker(partitions=VOLUME_PARTITIONS) as broker, tempfile.TemporaryDirectory(prefix="d3-volume-") as tmp:
        return asyncio.run(_volume(broker.bootstrap_servers, broker, prefix, Path(tmp), waiting, labels, days, tick))


async def _volume(servers: str, broker: KafkaBroker, prefix: str, tmp: Path, waiting: int, label_count: int,
                  days: float, tick: Callable[[str], None] | None) -> VolumeReport:
    from d3stream.benchmarks.scaleout import free_port

    settings = Settings.from_flat(bootstrap_servers=servers, answer_topic=f"{prefix}.answers", label_topic=f"{prefix}.labels",
                        evaluation_topic=f"{prefix}.evaluations", label_dead_letter_topic=f"{prefix}.labels-dlq",
                        evaluate_state_topic=f"{prefix}.state", evaluate_group_id=prefix, client_id=prefix,
                        transactional_id_prefix=prefix, topic_partitions=VOLUME_PARTITIONS)
    for topic in (settings.delivery.answer_topic, settings.evaluation.label_topic):
        broker.create_topic(topic, VOLUME_PARTITIONS, exist_ok=True)
    port = free_port()
    state_dir = tmp / "state"
    written = settings.flat()  # by the names an operator writes, as the worker's environment takes them
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "D3STREAM_BOOTSTRAP_SERVERS": servers,
           "D3STREAM_LOG_FORMAT": "json",
           "D3STREAM_METRICS_PORT": str(port), "D3STREAM_EVALUATE_STATE_DIR": str(state_dir),
           **{f"D3STREAM_{name.upper()}": str(written[name]) for name in (
               "answer_topic", "label_topic", "evaluation_topic", "label_dead_letter_topic", "evaluate_state_topic",
               "evaluate_group_id", "client_id", "transactional_id_prefix", "topic_partitions")}}
    worker = _Worker(env, port, tmp / "evaluate.log")
    start_ms = int(time.time() * 1000 - days * 86_400_000)

    def step(name: str) -> None:
        if tick is not None:
            tick(name)

    step("publishing answers")
    await _produce_stamped(servers, settings.delivery.answer_topic, _stamped_answers(waiting, days, start_ms))
    step("taking answers in")
    started = worker.start()
    joined_at = await worker.until(lambda s: s.get("d3stream_eval_ready") == 1.0, "readiness", 300)
    done = await worker.until(lambda s: s.get("d3stream_eval_answers_total", 0) >= waiting, "every answer", 3_600)
    series = worker.series()
    seconds = done - joined_at  # read once a second: under MIN_TIMED_S that is no measurement
    ingest: Ingest = {
        "seconds": round(seconds, 1), "answers_per_s": round(waiting / seconds) if seconds >= MIN_TIMED_S else None,
        "rss_mb": round(worker.rss_mb()), "state_bytes": int(series["d3stream_eval_state_bytes"]),
        "disk_bytes": sum(f.stat().st_size for f in state_dir.rglob("*") if f.is_file()),
        "evicted": int(series.get("d3stream_eval_evicted_total", 0)),
        "coverage_days": round(series.get("d3stream_eval_state_coverage_seconds", 0) / 86_400, 2)}
    del started
    step("joining labels")
    rng = random.Random(4)
    chosen = sorted({0, waiting - 1, *(rng.randrange(waiting) for _ in range(label_count - 2))})
    label_records = [(f"ticket-{n:09d}".encode(),
                      json.dumps(label_event(f"ticket-{n:09d}", rng)).encode()) for n in chosen]
    before = worker.series().get("d3stream_eval_pairs_total", 0)
    sent_at = time.perf_counter()
    await produce(servers, settings.evaluation.label_topic, label_records)
    done = await worker.until(lambda s: s.get("d3stream_eval_pairs_total", 0) - before >= 3 * len(chosen),
                              "every label joined", 1_800)
    join_rss_mb = round(worker.rss_mb())
    evaluations = await _evaluated(servers, settings.evaluation.evaluation_topic, {f"ticket-{n:09d}" for n in (0, waiting - 1)})
    join: Join = {"labels": len(chosen), "seconds": round(done - sent_at, 1),
                  "pairs_per_s": round(len(chosen) / (done - sent_at)), "rss_mb": join_rss_mb,
                  "oldest_joined": f"ticket-{0:09d}" in evaluations,
                  "newest_joined": f"ticket-{waiting - 1:09d}" in evaluations,
                  "oldest_age_days": round((time.time() * 1000 - start_ms) / 86_400_000, 2)}
    step("clean restart")
    worker.adopted()
    worker.stop()
    started = worker.start()
    ready = await worker.until(lambda s: s.get("d3stream_eval_ready") == 1.0, "readiness after a restart", 600)
    adopted = worker.adopted()
    restart: Restart = {"seconds": round(ready - started, 1), "modes": sorted({a["mode"] for a in adopted}),
                        "changelog_records": sum(a["records"] for a in adopted),
                        "waiting": sum(a["waiting"] for a in adopted)}
    step("crash and restore")
    worker.stop(signal.SIGKILL)
    shutil.rmtree(state_dir)  # a new machine: nothing on disk
    started = worker.start()
    ready = await worker.until(lambda s: s.get("d3stream_eval_ready") == 1.0, "readiness after a restore", 3_600)
    adopted = worker.adopted()
    records = sum(a["records"] for a in adopted)
    restore_seconds = sum(a["seconds"] for a in adopted)
    restore: Restore = {"seconds": round(ready - started, 1), "modes": sorted({a["mode"] for a in adopted}),
                        "changelog_records": records, "records_per_s": round(records / max(restore_seconds, 1e-9)),
                        "waiting": sum(a["waiting"] for a in adopted), "rss_mb": round(worker.rss_mb())}
    worker.stop()
    return {"waiting": waiting, "days": days, "partitions": VOLUME_PARTITIONS,
            "window_days": settings.evaluation.evaluate_window_s / 86_400,
            "budget_gib": settings.evaluation.evaluate_max_state_bytes / 2**30,
            "ingest": ingest, "join": join, "restart": restart, "restore": restore}


async def _evaluated(servers: str, topic: str, wanted: set[str]) -> set[str]:
    from d3stream.jobs.compare import TopicRange, read_topic

    records = await read_topic(servers, TopicRange(topic), timeout_s=300)
    return {r["id"] for r in records if isinstance(r, dict) and r.get("id") in wanted}


def volume_markdown(report: VolumeReport) -> str:
    ingest, join, restart, restore = report["ingest"], report["join"], report["restart"], report["restore"]
    return "\n".join([
        f"d3stream evaluate at volume: one worker, default settings (window {report['window_days']:g} days, state "
        f"budget {report['budget_gib']:g} GiB on disk), {report['partitions']} partitions, "
        f"{report['waiting']:,} answers of three questions stamped over {report['days']:g} days:",
        "",
        "| step | figure |",
        "|---|---:|",
        "| taking the answers in | " + (f"{ingest['answers_per_s']:,} answers/s ({ingest['seconds']:,} s) |"
                                         if ingest["answers_per_s"] else "too few answers to time (ask for more) |"),
        f"| resident memory with all of them waiting | {ingest['rss_mb']:,} MB |",
        f"| state on disk | {ingest['state_bytes'] / 2**20:,.0f} MB counted, {ingest['disk_bytes'] / 2**20:,.0f} MB "
        f"of files; evicted {ingest['evicted']:,}; covers {ingest['coverage_days']:g} days |",
        f"| joining {join['labels']:,} labels spread over the window | {join['pairs_per_s']:,} pairs/s "
        f"({join['seconds']:,} s); oldest ({join['oldest_age_days']:g} days) joined: {join['oldest_joined']}, "
        f"newest: {join['newest_joined']} |",
        f"| clean restart ({', '.join(restart['modes'])}) | ready in {restart['seconds']:,} s, "
        f"{restart['changelog_records']:,} changelog records read, {restart['waiting']:,} entries |",
        f"| crash on a new machine ({', '.join(restore['modes'])}) | ready in {restore['seconds']:,} s: "
        f"{restore['changelog_records']:,} changelog records at {restore['records_per_s']:,}/s; "
        f"{restore['rss_mb']:,} MB resident after |",
    ])
