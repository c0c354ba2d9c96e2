"""Scale-out under churn: what a worker's death and restart costs a consumer group.

A group of real ``d3stream serve`` processes (each with its metrics endpoint) serves a paced stream of
small requests while one worker at a time is SIGKILLed and started again at once, as Kubernetes restarts
a container. For each such membership change it records

* how many group generations (rebalances) it cost, from the workers' ``d3stream_group_generation``,
* how long the group took to settle (every worker up, all partitions owned, one generation, steady),
* how long answers paused: the longest a request published around the kill waited for its committed
  answer, next to the median wait before any kill,

and at the end counts every committed answer (``read_committed``): each request must be answered once.

``python -m d3stream.benchmarks.scaleout`` runs it on the embedded broker with and without static membership and
prints the figures docs/MEASUREMENTS.md quotes; ``tests/system/test_scaleout.py`` runs it small, with assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from d3stream.benchmarks.chaos import WorkerProcess, count_topic, worker_env

# Series read from each worker; all unlabelled.
WATCHED = ("d3stream_group_generation", "d3stream_partitions_owned", "d3stream_rebalances_total",
           "d3stream_revoked_requests_abandoned_total", "d3stream_ready")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Member:
    """One worker of the group: its process, metrics port and (static membership) instance id."""

    name: str
    process: WorkerProcess
    port: int

    def scrape(self) -> dict[str, float] | None:
        """The watched series, or None while the worker is down or its endpoint not up yet."""
        from prometheus_client.parser import text_string_to_metric_families

        if self.process.process is None or self.process.process.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return None
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name in WATCHED and not sample.labels}

    def joined(self, sample: dict[str, float] | None) -> bool:
        return sample is not None and sample.get("d3stream_rebalances_total", 0) > 0


@dataclass
class Group:
    """The workers of one consumer group."""

    members: list[Member]
    partitions: int

    def snapshot(self) -> list[dict[str, float] | None]:
        return [member.scrape() for member in self.members]

    def generation(self) -> int:
        return int(max((s or {}).get("d3stream_group_generation", 0) for s in self.snapshot()))

    def is_settled(self, snapshot: list[dict[str, float] | None]) -> bool:
        """Every worker up and joined, all partitions owned, every worker on the same generation."""
        if not all(m.joined(s) for m, s in zip(self.members, snapshot, strict=True)):
            return False
        samples = [s for s in snapshot if s is not None]  # all of them: every worker joined
        owned = sum(s["d3stream_partitions_owned"] for s in samples)
        generations = {s["d3stream_group_generation"] for s in samples}
        return owned == self.partitions and len(generations) == 1

    async def settle(self, timeout_s: float, steady_s: float = 2.0) -> float:
        """Seconds until the group is settled and stays so for ``steady_s`` (not counted)."""
        started = time.monotonic()
        steady_since: float | None = None
        last: tuple[float | None, ...] | None = None
        while time.monotonic() - started < timeout_s:
            snapshot = await asyncio.to_thread(self.snapshot)
            state = tuple((s or {}).get("d3stream_group_generation") for s in snapshot)
            if self.is_settled(snapshot) and (steady_since is None or state == last):
                steady_since = steady_since or time.monotonic()
                last = state
                if time.monotonic() - steady_since >= steady_s:
                    return steady_since - started
            else:
                steady_since, last = None, None
            for member in self.members:
                process = member.process.process
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"{member.name} exited ({process.returncode}); see {member.process.log_path}")
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the group did not settle within {timeout_s:g} s: {self.snapshot()}")


class AnswerWatch:
    """Reads the answer topic (committed records only) in the background: when each id was first seen."""

    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap, self.topic = bootstrap, topic
        self.seen_at: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AnswerWatch:
        from aiokafka import TopicPartition

        from d3stream.kafka.connection import raw_client

        self.consumer = raw_client("consumer", bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                   auto_offset_reset="earliest", isolation_level="read_committed")
        await self.consumer.start()
        await self.consumer._client.force_metadata_update()  # noqa: SLF001 - a fresh client knows no topics yet
        partitions = self.consumer.partitions_for_topic(self.topic) or set()
        self.consumer.assign([TopicPartition(self.topic, p) for p in partitions])
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    async def _loop(self) -> None:
        while True:
            try:
                batches = await self.consumer.getmany(timeout_ms=100)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep reading through a hiccup
                await asyncio.sleep(0.2)
                continue
            now = time.monotonic()
            for records in batches.values():
                for record in records:
                    self.seen_at.setdefault(json.loads(record.value)["id"], now)


@dataclass
class Stream:
    """Publishes small requests at ``rate`` per second until stopped; remembers when each was sent."""

    bootstrap: str
    topic: str
    rate: float
    published_at: dict[str, float] = field(default_factory=dict)

    async def run(self, stop: asyncio.Event) -> None:
        from d3stream.kafka.connection import raw_client

        producer = raw_client("producer", bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True)
        await producer.start()
        try:
            started, number = time.monotonic(), 0
            while not stop.is_set():
                request_id = f"so-{number:05d}"
                request = {"id": request_id, "state": f"Order {number}: item {number % 17}",
                           "questions": {"ok": {"type": "noul", "instructions": "Is the item in stock?"}}}
                await producer.send_and_wait(self.topic, json.dumps(request).encode(), key=request_id.encode())
                self.published_at[request_id] = time.monotonic()
                number += 1
                await asyncio.sleep(max(0.0, started + number / self.rate - time.monotonic()))
        finally:
            await producer.stop()


def _waits(stream: Stream, watch: AnswerWatch, since: float, until: float) -> list[float]:
    """How long each request published in [since, until] waited for its committed answer."""
    return [watch.seen_at[i] - t for i, t in stream.published_at.items() if since <= t <= until and i in watch.seen_at]


class Change(TypedDict):
    """One membership change: a worker killed and started again, and what it cost the group."""

    victim: str
    rebalances: int  # group generations it took
    others_rebalanced: float  # the most rebalances any surviving worker went through
    settle_s: float
    max_wait_s: float  # the longest a request published around the kill waited for its answer


def _members(env: dict[str, str], folder: Path, workers: int, static: bool,
             session_timeout_ms: int) -> list[Member]:
    """The workers' processes (not started): each its own metrics port, and with static membership its own
    ``group_instance_id``."""
    group_name = env["D3STREAM_GROUP_ID"]
    members = []
    for n in range(workers):
        port = free_port()
        member_env = dict(env, D3STREAM_METRICS_PORT=str(port), D3STREAM_METRICS_HOST="127.0.0.1",
                          D3STREAM_SESSION_TIMEOUT_MS=str(session_timeout_ms))
        if static:
            member_env["D3STREAM_GROUP_INSTANCE_ID"] = f"{group_name}-worker-{n}"
        else:
            member_env.pop("D3STREAM_GROUP_INSTANCE_ID", None)
        members.append(Member(f"worker-{n}", WorkerProcess(member_env, folder / f"worker-{n}.log"), port))
    return members


def _rebalanced(sample: dict[str, float] | None) -> float:
    return (sample or {}).get("d3stream_rebalances_total", 0)


async def _kill_and_restart(group: Group, victim: Member, stream: Stream, watch: AnswerWatch, between_s: float,
                            settle_timeout_s: float) -> Change:
    """SIGKILL ``victim``, start it again at once, wait for the group to settle and ``between_s`` more."""
    before = group.snapshot()
    generation = group.generation()
    killed_at = time.monotonic()
    victim.process.kill()
    victim.process.start()
    settle_s = await group.settle(settle_timeout_s)
    settled_at = killed_at + settle_s
    after = group.snapshot()
    others = [_rebalanced(b) - _rebalanced(a)
              for m, b, a in zip(group.members, after, before, strict=True) if m is not victim]
    await asyncio.sleep(between_s)
    waits = _waits(stream, watch, killed_at - 2.0, settled_at)  # answers that came since the group settled count
    return {
        "victim": victim.name,
        "rebalances": group.generation() - generation,
        "others_rebalanced": max(others, default=0),
        "settle_s": round(settle_s, 2),
        "max_wait_s": round(max(waits, default=0.0), 2),
    }


async def _answered(stream: Stream, watch: AnswerWatch, timeout_s: float) -> set[str]:
    """The ids published, once each has its committed answer (or after ``timeout_s``)."""
    ids = set(stream.published_at)
    deadline = time.monotonic() + timeout_s
    while not ids <= set(watch.seen_at) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return ids


class AnswerCounts(TypedDict):
    """Every id answered once? The ids answered, lost and duplicated, and the error answers."""

    sent: int
    answered: int
    lost: list[str]
    duplicated: list[str]
    errors: int


class ChurnReport(AnswerCounts):
    """One scenario (``churn``): the group, the answers, each membership change, and what the logs show."""

    workers: int
    static: bool
    session_timeout_ms: int
    changes: list[Change]
    baseline_wait_p50_s: float | None
    abandoned_on_revocation: int
    exit_codes: list[int | None]
    tracebacks: int
    never_retrieved: int
    seconds: float


def _answer_counts(ids: set[str], answers: list[dict[str, object]]) -> AnswerCounts:
    """Every id answered once? The ids answered, lost and duplicated, and the error answers."""
    counts = Counter(a["id"] for a in answers)
    return {
        "sent": len(ids),
        "answered": sum(1 for i in ids if counts[i] > 0),
        "lost": sorted(i for i in ids if counts[i] == 0),
        "duplicated": sorted(i for i in ids if counts[i] > 1),
        "errors": sum(1 for a in answers if a.get("error")),
    }


async def churn(
    *,
    bootstrap: str,
    env: dict[str, str],
    request_topic: str,
    answer_topic: str,
    folder: Path,
    workers: int,
    partitions: int,
    kills: int,
    static: bool,
    session_timeout_ms: int,
    rate: float = 8.0,
    between_s: float = 3.0,
    settle_timeout_s: float = 90.0,
) -> ChurnReport:
    """Run the scenario with ``workers`` processes (``env``: their common settings) and return the figures."""
    members = _members(env, folder, workers, static, session_timeout_ms)
    group = Group(members, partitions)
    changes: list[Change] = []
    stop = asyncio.Event()
    stream = Stream(bootstrap, request_topic, rate)
    started = time.monotonic()
    async with AnswerWatch(bootstrap, answer_topic) as watch:
        for member in members:
            member.process.start()
        try:
            await group.settle(settle_timeout_s * 2)  # the first start loads every worker's model at once
            publishing = asyncio.create_task(stream.run(stop))
            await asyncio.sleep(between_s)
            first_kill = time.monotonic()
            for k in range(kills):
                changes.append(await _kill_and_restart(group, members[k % workers], stream, watch, between_s,
                                                       settle_timeout_s))
            stop.set()
            await publishing
            ids = await _answered(stream, watch, settle_timeout_s)
            baseline = _waits(stream, watch, started, first_kill)
            abandoned = sum((s or {}).get("d3stream_revoked_requests_abandoned_total", 0) for s in group.snapshot())
        finally:
            stop.set()
            codes = [member.process.terminate(60) for member in members]
    answers = await count_topic(bootstrap, answer_topic)
    logs = "".join(m.process.log_path.read_text(errors="replace") for m in members)
    return {
        "workers": workers,
        "static": static,
        "session_timeout_ms": session_timeout_ms,
        **_answer_counts(ids, answers),
        "changes": changes,
        "baseline_wait_p50_s": round(statistics.median(baseline), 3) if baseline else None,
        "abandoned_on_revocation": int(abandoned),
        "exit_codes": codes,
        "tracebacks": logs.count("Traceback"),
        "never_retrieved": logs.count("never retrieved"),
        "seconds": round(time.monotonic() - started, 1),
    }


def worker_settings(bootstrap: str, topics: Mapping[str, object], group: str, checkpoint: Path) -> dict[str, str]:
    """The workers' common environment (a CPU worker with the tiny checkpoint)."""
    env = worker_env({
        **topics,
        "bootstrap_servers": bootstrap,
        "group_id": group,
        "model": str(checkpoint),
        "delivery": "exactly_once",
        "commit_interval_ms": 200,
        "linger_ms": 5,
        "torch_threads": 1,
        "log_format": "json",
        "log_level": "info",
    })
    env.pop("D3STREAM_CONFIG", None)
    return env


async def _report(workers: int, kills: int, cases: list[tuple[bool, int]]) -> list[ChurnReport]:
    import tempfile

    from d3stream.dev.demo import demo_checkpoint
    from d3stream.dev.infra import local_stack

    results = []
    folder = Path(tempfile.mkdtemp(prefix="d3stream-scaleout-"))
    with local_stack() as (broker, _store):
        checkpoint = demo_checkpoint()
        for static, timeout_ms in cases:
            name = f"so-{'static' if static else 'dynamic'}-{timeout_ms}"
            topics = {"request_topics": [f"{name}.requests"], "answer_topic": f"{name}.answers",
                      "dead_letter_topic": f"{name}.dead-letters", "provenance_topic": f"{name}.provenance"}
            broker.create_topic(f"{name}.requests", 3, exist_ok=True)
            broker.create_topic(f"{name}.answers", 3, exist_ok=True)
            env = worker_settings(broker.bootstrap_servers, topics, name, checkpoint)
            (folder / name).mkdir(parents=True, exist_ok=True)
            result = await churn(bootstrap=broker.bootstrap_servers, env=env, request_topic=f"{name}.requests",
                                 answer_topic=f"{name}.answers", folder=folder / name, workers=workers,
                                 partitions=3, kills=kills, static=static, session_timeout_ms=timeout_ms)
            print(_line(result), file=sys.stderr, flush=True)
            results.append(result)
    return results


def _line(result: ChurnReport) -> str:
    changes = result["changes"]
    return (
        f"{'static' if result['static'] else 'dynamic':8} session {result['session_timeout_ms'] / 1000:>4g} s  "
        f"rebalances/kill {[c['rebalances'] for c in changes]}  survivors rebalanced "
        f"{[c['others_rebalanced'] for c in changes]}  settle s {[c['settle_s'] for c in changes]}  "
        f"longest wait s {[c['max_wait_s'] for c in changes]} (median before kills "
        f"{result['baseline_wait_p50_s']})  sent {result['sent']} answered {result['answered']} "
        f"lost {len(result['lost'])} duplicated {len(result['duplicated'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d3stream.benchmarks.scaleout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--cases", default="dynamic:6000,dynamic:10000,static:10000,static:45000",
                        help="comma-separated membership:session_timeout_ms pairs (membership: dynamic or static)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cases = [(kind == "static", int(ms)) for kind, ms in (case.split(":") for case in args.cases.split(","))]
    results = asyncio.run(_report(args.workers, args.kills, cases))
    for result in results:
        print(json.dumps(result) if args.json else _line(result))
    return 0 if all(not r["lost"] and not r["duplicated"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
