"""``d3stream bench fleet``: what a rolling restart and a scale 2 -> 4 -> 2 cost a fleet of workers in throughput.

A fleet of worker processes in one consumer group (``fleet_worker``: the real ``Service`` -- consume loop,
pipeline, batching, commit policy, rebalance listener, metrics endpoint -- with a model stand-in whose every
forward pass sleeps ``device_ms`` on the model thread, as a GPU pass holds it while the CPU does other work)
answers a stream that is always ahead of it, through this timeline:

1. the first ``scale_from`` workers (2) start; once the group has settled the stream starts;
2. **steady** with ``scale_from`` workers for ``steady_s`` seconds;
3. **scale up**: the other workers (to ``workers``, 4) start at once, as a Deployment scaled from 2 to 4 replicas;
4. **steady** with all the workers for ``steady_s``;
5. **rolling restart**: each worker in turn is replaced, as the shipped Deployment rolls (``--rollout surge``,
   maxSurge 1 and maxUnavailable 0 in deploy/k8s): a new process starts (its interpreter, imports and ``load_s``
   included) and joins, and once the group has settled with it the old one gets SIGTERM -- Kubernetes' graceful
   stop: it stops reading, finishes what is in flight, publishes, commits and leaves the group; the next one goes
   once the group has settled again. ``--rollout stop_first`` (maxSurge 0, maxUnavailable 1: a fleet with no
   spare GPU, or a StatefulSet) stops the worker first and starts it again once it has exited;
6. **scale down**: the workers beyond the first ``scale_from`` get SIGTERM at once (4 -> 2);
7. the stream stops, every request published is waited for, the workers stop, and every committed answer is
   counted (``read_committed``).

An event runs from its first stop or start until the group has *settled*: every running worker up and joined,
all partitions owned, every worker on one generation, and so for ``stable_s`` (2 s: a rebalance under way may
not show in the workers' gauges at once; the settling is dated from the start of that run, like scaleout.py's).
A scale-down does not wait for the stopped processes to exit: its workers are gone for the group once they
have left it.

Throughput is committed answers per second, read off the answer topic by a ``read_committed`` consumer as they
become visible (in ``exactly_once`` at each commit, every ``commit_interval_ms``). So an event that settles
sooner than ``min_event_s`` (5 s, ten commits) is measured over that long, the fleet serving as it is after the
event for the rest: a window of a second held a commit more or less than its share (a ratio of 2.2 over 0.9 s).
Each event's ratio is its throughput over a steady one's: the rolling restart's over the steady throughput of
all the workers, a scale event's over that of ``scale_from`` workers -- the capacity the fleet has before a
scale-up and after a scale-down, so below 1 means the event cost more than it added. ``shortfall_s`` says the
same in seconds of that steady throughput, ``seconds * (1 - ratio)``, comparable between events of different
lengths. A worker's restart takes it away for its stop and start, so even a rebalance that cost nothing would
leave a ``stop_first`` rolling restart of N workers at ``(N - 1) / N`` of steady while one is down (0.75 for 4):
its ratio needs the fleet at full strength between restarts, or starts short beside the settling after them. A
``surge`` restart has every worker's capacity throughout (and one more process while a replacement joins): what
it costs is its two rebalances per worker.

**Why the stream keeps a backlog**: steady throughput must be the fleet's capacity, not the producer's rate.
The producer keeps ``backlog`` requests published and not yet answered (default: three seconds of the whole
fleet's capacity), each partition its share, so every worker always has work and what an event costs shows as
answers not given.

**Why the sleeps bound it**: the machine this runs on has 2 cores shared with other work. A pass carries at
most ``batch_rows`` rows (one per request here: each asks one question) per ``device_ms``, so the fleet's
capacity is ``workers * batch_rows / device_ms`` (800 answers/s at the defaults: 4 x 8 rows per 40 ms). Measured
at steady on 4 workers: every pass full, passes back to back, 46 ms each (the model thread waits for the GIL
after its sleep, as a real pass's thread does after its device), about 700 answers/s for 0.22 of a core in the
workers (320 us per answer), 0.48 in the broker and 0.05 in the bench: the sleeps, not the CPUs, are the
limit. ``max_inflight`` (64 requests, eight passes) keeps the same few passes of work in flight per worker as
the service's default of 256 keeps on a GPU with 64-row passes: what a revocation has to drain.

**Why workers start below the bench's CPU priority**: on a fleet each worker has a machine of its own; here a
starting process (interpreter, imports, torch: seconds of CPU) or an exiting one (the interpreter's teardown)
would take its CPU from the workers serving beside it, and a restart would cost them throughput no fleet pays.
So each worker starts at ``START_NICE`` below the bench's priority, takes the bench's back once its service is
built, and drops it again once its service has stopped (fleet_worker.py). That needs the privilege to raise a
priority (root or CAP_SYS_NICE); ``priority_taken_back`` in the report says whether the workers had it.

**Per worker and event**: the seconds it was paused (``d3stream_rebalance_paused_seconds_total``: from a
revocation's start until every partition of its next assignment is read again; a worker's first assignment after
its own start is not a pause, its restart is reported as its stop and start seconds instead), the rebalances it
went through (``d3stream_rebalances_total``) and the requests its revocations abandoned. Counters are scraped
from each worker's metrics endpoint and summed over its processes, as a restart starts them from zero. The
group's rebalances are the generations the event moved through.

**Lost and repeated**: after draining, a request with no committed answer is lost, one with more than one is
repeated: both must be 0 in ``exactly_once``; ``at_least_once`` (``--delivery at_least_once``) may repeat.

**Membership**: dynamic by default: a worker that stops leaves the group (a rebalance) and one that starts joins
it (another), so a rolling restart of N workers costs about 2N rebalances, each pausing every worker -- the case
that pays for every rebalance. With ``--static`` each worker keeps a ``group_instance_id`` across its restarts:
one restarted within ``session_timeout_ms`` takes its partitions back with no rebalance at all (the others are
not disturbed; its own partitions wait for it), and aiokafka sends no LeaveGroup for static members, so a scale
down leaves the stopped workers' partitions unserved until their sessions time out.

``tests/system/test_fleet.py`` runs a tiny fleet (2 workers, 1 -> 2 -> 1) and checks what it must do, never how
fast; docs/MEASUREMENTS.md has the figures.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream.benchmarks.chaos import WorkerProcess, count_topic
from d3stream.benchmarks.scaleout import free_port

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker
    from d3stream.settings import DeliveryName

# How the rolling restart replaces each worker (FleetShape.rollout).
ROLLOUTS = ("surge", "stop_first")
# How often the workers' endpoints are read while an event runs.
POLL_S = 0.25
# Most requests the producer sends before it looks at the backlog again.
PUBLISH_CHUNK = 500
# How far below the bench's CPU priority a worker starts and exits (fleet_worker.py says why).
START_NICE = 10

# Unlabelled series read from each worker: counters (summed over the worker's processes) and gauges.
COUNTERS = ("d3stream_rebalance_paused_seconds_total", "d3stream_rebalances_total",
            "d3stream_revoked_requests_abandoned_total")
GAUGES = ("d3stream_group_generation", "d3stream_partitions_owned")


# ------------------------------------------------------------------------------------------ workers


def read_series(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The unlabelled samples named ``names`` in a metrics endpoint's text (a line ``name value`` each).
    Read by hand rather than with prometheus_client's parser: the fleet's endpoints are read four times a
    second each, on a 2-core machine that the workers need."""
    wanted = set(names)
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name] = float(value)
    return found


@dataclass
class FleetMember:
    """One worker of the fleet: its process (restarted in place), its metrics port, and its counters summed over
    its processes (each restart begins them at zero again)."""

    name: str
    process: WorkerProcess
    port: int
    totals: dict[str, float] = field(default_factory=dict)
    latest: dict[str, float] | None = None  # the last scrape of the running process (None: down)
    _process_seen: int = 0  # which start of the process ``_last`` was read from
    _last: dict[str, float] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.process.process is not None and self.process.process.poll() is None

    def scrape(self) -> dict[str, float] | None:
        """The watched series, or None while the worker is down or its endpoint not up yet."""
        if not self.running:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return None
        return read_series(text, COUNTERS + GAUGES)

    def observe(self) -> dict[str, float] | None:
        """Scrape, and add what each counter gained since the last scrape of the same process."""
        self.latest = self.scrape()
        if self.latest is not None:
            self.account(self.process.starts, self.latest)
        return self.latest

    def account(self, process_start: int, sample: dict[str, float]) -> None:
        """Add the counters' gains in ``sample``, read from the ``process_start``-th start of the process."""
        if process_start != self._process_seen:  # a new process: its counters begin at zero
            self._process_seen, self._last = process_start, {}
        for name in COUNTERS:
            value = sample.get(name, 0.0)
            self.totals[name] = self.totals.get(name, 0.0) + max(0.0, value - self._last.get(name, 0.0))
            self._last[name] = value

    @property
    def joined(self) -> bool:
        """Its running process holds an assignment of the group."""
        return self.latest is not None and self.latest.get("d3stream_rebalances_total", 0) > 0


def fleet_members(env: dict[str, str], folder: Path, workers: int, *, device_ms: float, load_s: float,
                  static: bool) -> list[FleetMember]:
    """The fleet's workers (not started): each its own metrics port and log, with static membership its own
    ``group_instance_id``."""
    return [fleet_member(env, folder, f"worker-{number}", device_ms=device_ms, load_s=load_s, static=static)
            for number in range(workers)]


def fleet_member(env: dict[str, str], folder: Path, name: str, *, device_ms: float, load_s: float,
                 static: bool) -> FleetMember:
    """One worker (not started) named ``name``: its metrics port, its log ``<name>.log``."""
    port = free_port()
    member_env = dict(env, D3STREAM_METRICS_PORT=str(port), D3STREAM_METRICS_HOST="127.0.0.1")
    if static:
        member_env["D3STREAM_GROUP_INSTANCE_ID"] = f"{env['D3STREAM_GROUP_ID']}-{name}"
    arguments = ("-P", "-m", "d3stream.benchmarks.fleet_worker", "--device-ms", f"{device_ms:g}",
                 "--load-s", f"{load_s:g}", "--serve-nice", str(os.getpriority(os.PRIO_PROCESS, 0)))
    process = WorkerProcess(member_env, folder / f"{name}.log", arguments=arguments, nice=START_NICE)
    return FleetMember(name, process, port)


def serving_priority(member: FleetMember) -> int | None:
    """The CPU priority (nice value) the member's main thread runs at; None when it is down."""
    if member.process.process is None or not member.running:
        return None
    try:
        return os.getpriority(os.PRIO_PROCESS, member.process.process.pid)
    except OSError:
        return None


def observe_all(members: list[FleetMember]) -> list[dict[str, float] | None]:
    return [member.observe() for member in members]


def is_settled(members: list[FleetMember], partitions: int) -> bool:
    """Every member up and joined, all partitions owned between them, every member on one generation."""
    if not members or not all(member.joined for member in members):
        return False
    samples = [member.latest or {} for member in members]
    owned = sum(sample.get("d3stream_partitions_owned", 0) for sample in samples)
    return owned == partitions and len({sample.get("d3stream_group_generation") for sample in samples}) == 1


def generation(members: list[FleetMember]) -> int:
    """The group's generation as the running members last saw it."""
    return int(max(((m.latest or {}).get("d3stream_group_generation", 0) for m in members), default=0))


async def settle(members: list[FleetMember], partitions: int, timeout_s: float, stable_s: float,
                 joined_at: dict[str, float] | None = None) -> float:
    """When (monotonic) the group began to be settled with ``members`` running, once it has stayed so for
    ``stable_s``. ``joined_at`` gets, for a member not in it yet, when it was first seen joined."""
    started = time.monotonic()
    settled_since: float | None = None
    last: tuple[float | None, ...] | None = None
    while time.monotonic() - started < timeout_s:
        await asyncio.to_thread(observe_all, members)
        now = time.monotonic()
        for member in members:
            process = member.process.process
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{member.name} exited ({process.returncode}); see {member.process.log_path}")
            if joined_at is not None and member.joined and member.name not in joined_at:
                joined_at[member.name] = now
        if is_settled(members, partitions):
            state = tuple((m.latest or {}).get("d3stream_group_generation") for m in members)
            if state != last:
                settled_since, last = now, state
            assert settled_since is not None
            if now - settled_since >= stable_s:
                return settled_since
        else:
            settled_since, last = None, None
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"the group did not settle within {timeout_s:g} s: "
                       f"{[(m.name, m.latest) for m in members]}")


# ---------------------------------------------------------------------------------- stream and answers


def request_record(number: int) -> tuple[bytes, bytes]:
    """(key, value) of the stream's ``number``-th request: one question, so one row of a pass."""
    request_id = f"fleet-{number:07d}"
    request = {"id": request_id, "state": f"Ticket {number}: item {number % 97} arrived late.",
               "questions": {"urgent": {"type": "noul", "instructions": "Is the ticket urgent?"}}}
    return request_id.encode(), json.dumps(request).encode()


class AnswerCount:
    """Reads the answer topic in the background (committed answers only, as a client sees them): how many became
    visible when, and which request ids they answer."""

    def __init__(self, bootstrap: str, topic: str, on_answered: Callable[[bytes], None] | None = None):
        self.bootstrap, self.topic = bootstrap, topic
        self.on_answered = on_answered  # called with each request id as its first answer is seen
        self.times: list[float] = []  # monotonic, one entry per fetch that brought answers
        self.cumulative: list[int] = []  # answers seen up to and including that fetch
        self.ids: set[bytes] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def total(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0

    def between(self, since: float, until: float) -> int:
        """Answers that became visible in [since, until)."""
        def seen_by(moment: float) -> int:
            index = bisect.bisect_left(self.times, moment)
            return self.cumulative[index - 1] if index else 0

        return seen_by(until) - seen_by(since)

    def per_second(self, since: float, until: float) -> list[int]:
        """Answers that became visible in each whole second from ``since`` on."""
        return [self.between(since + s, since + s + 1) for s in range(int(until - since))]

    async def __aenter__(self) -> AnswerCount:
        from aiokafka import TopicPartition

        from d3stream.kafka.connection import raw_client

        self.consumer = raw_client("consumer", bootstrap_servers=self.bootstrap, group_id=None,
                                   enable_auto_commit=False, auto_offset_reset="earliest",
                                   isolation_level="read_committed")
        await self.consumer.start()
        await self.consumer._client.force_metadata_update()  # noqa: SLF001 - a fresh client knows no topics yet
        partitions = self.consumer.partitions_for_topic(self.topic) or set()
        self.consumer.assign([TopicPartition(self.topic, p) for p in partitions])
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    async def _read(self) -> None:
        while True:
            try:
                batches = await self.consumer.getmany(timeout_ms=100)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep reading through a hiccup
                await asyncio.sleep(0.2)
                continue
            count = 0
            for records in batches.values():
                count += len(records)
                for record in records:
                    if record.key not in self.ids:
                        self.ids.add(record.key)
                        if self.on_answered is not None:
                            self.on_answered(record.key)
            if count:
                self.times.append(time.monotonic())
                self.cumulative.append(self.total + count)


@dataclass
class BacklogStream:
    """Publishes requests so that every partition always has its share of ``backlog`` published and not yet
    answered: the workers never wait for work, so what they answer is what they can. Kept per partition, not in
    all: a partition no one serves for a while (a static member's, until its session times out) holds its share
    and no more, where a backlog counted in all would pile up there and starve the partitions still served."""

    bootstrap: str
    topic: str
    partitions: int
    backlog: int
    published: int = 0
    partition_of: dict[bytes, int] = field(default_factory=dict)  # each request id's partition
    waiting: list[int] = field(default_factory=list)  # per partition: published, no answer seen yet

    def answered(self, request_id: bytes) -> None:
        """The first committed answer to ``request_id`` was seen."""
        partition = self.partition_of.get(request_id)
        if partition is not None:
            self.waiting[partition] -= 1

    async def run(self, stop: asyncio.Event) -> None:
        from d3stream.kafka.connection import raw_client

        share = -(-self.backlog // self.partitions)
        self.waiting = self.waiting or [0] * self.partitions
        producer = raw_client("producer", bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                              linger_ms=5)
        await producer.start()
        try:
            while not stop.is_set():
                sends: list[Awaitable[object]] = []
                for partition in range(self.partitions):
                    for _ in range(min(share - self.waiting[partition], PUBLISH_CHUNK - len(sends))):
                        key, value = request_record(self.published)
                        self.partition_of[key] = partition
                        self.waiting[partition] += 1
                        self.published += 1
                        sends.append(await producer.send(self.topic, value, key=key, partition=partition))
                if not sends:
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.gather(*sends)
        finally:
            await producer.stop()


# ------------------------------------------------------------------------------------------- the report


class WorkerFigures(TypedDict):
    """One worker through one event: seconds paused by rebalances, rebalances it went through, requests its
    revocations abandoned to the next owner."""

    worker: str
    paused_s: float
    rebalances: int
    abandoned: int


class Restart(TypedDict):
    """One worker's restart in the rolling restart: SIGTERM until it exited, its start until it held an
    assignment, and its start until the group had settled."""

    worker: str
    stop_s: float
    start_s: float
    settled_s: float


class Steady(TypedDict):
    """A steady window: the fleet of ``workers`` answering its backlog (and the rebalances in it: none expected)."""

    workers: int
    seconds: float
    answers: int
    answers_per_s: float
    rebalances: int


class Event(TypedDict):
    """One membership event, from its first stop or start until the group had settled."""

    name: str  # scale_up, rolling_restart, scale_down
    workers_before: int
    workers_after: int
    started_at_s: float  # since the stream started
    seconds: float
    answers: int
    answers_per_s: float
    steady_answers_per_s: float  # what the ratio divides by
    ratio: float
    shortfall_s: float  # seconds of the steady throughput the event cost: seconds * (1 - ratio)
    rebalances: int  # group generations
    workers: list[WorkerFigures]
    restarts: list[Restart]


class FleetReport(TypedDict):
    """``d3stream bench fleet``: the set-up, the steady windows, each event, and the final count."""

    delivery: DeliveryName
    static: bool
    rollout: str  # surge (the new process before the old stops) or stop_first
    keep_partitions: bool  # rebalance_keep_partitions: a rebalance keeps what it hands back (else drains all)
    heartbeat_ms: int | None  # the workers' heartbeat_interval_ms, when the run set it
    workers: int
    scale_from: int
    partitions: int
    device_ms: float
    batch_rows: int
    max_inflight: int
    backlog: int
    commit_interval_ms: int
    session_timeout_ms: int
    load_s: float
    capacity_per_worker: float  # answers/s the sleeps allow one worker: batch_rows per device_ms
    steady: list[Steady]
    events: list[Event]
    sent: int
    answered: int
    lost: int
    repeated: int  # answers beyond the first, over all requests
    lost_ids: list[str]  # the first few
    repeated_ids: list[str]
    errors: int
    exit_codes: list[int | None]
    tracebacks: int
    timeline: list[int]  # answers visible in each second since the stream started
    load_average: tuple[float, float]  # the machine's 1-minute load average as the run began and as it ended
    priority_taken_back: bool  # the first workers serve at the bench's CPU priority, not the start's
    logs: str
    seconds: float


def event_figures(members: list[FleetMember], before: dict[str, dict[str, float]]) -> list[WorkerFigures]:
    """Each member's counters' gains since ``before`` (its totals when the event began; none: it began since)."""
    figures: list[WorkerFigures] = []
    for member in members:
        earlier = before.get(member.name, {})

        def gained(name: str, earlier: dict[str, float] = earlier, member: FleetMember = member) -> float:
            return member.totals.get(name, 0.0) - earlier.get(name, 0.0)

        figures.append({"worker": member.name,
                        "paused_s": round(gained("d3stream_rebalance_paused_seconds_total"), 2),
                        "rebalances": round(gained("d3stream_rebalances_total")),
                        "abandoned": round(gained("d3stream_revoked_requests_abandoned_total"))})
    return figures


@dataclass
class Timeline:
    """The run's clock, answers and events, and the figures of each."""

    answers: AnswerCount
    min_event_s: float  # the shortest window an event is measured over
    started: float = 0.0  # when the stream started
    steady: list[Steady] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def rate(self, since: float, until: float) -> tuple[int, float]:
        answers = self.answers.between(since, until)
        return answers, round(answers / max(until - since, 1e-9), 1)

    async def hold_steady(self, members: list[FleetMember], seconds: float) -> Steady:
        await asyncio.to_thread(observe_all, members)
        generation_before, since = generation(members), time.monotonic()
        await asyncio.sleep(seconds)
        answers, rate = self.rate(since, time.monotonic())
        await asyncio.to_thread(observe_all, members)
        steady: Steady = {"workers": len(members), "seconds": round(seconds, 1), "answers": answers,
                          "answers_per_s": rate, "rebalances": generation(members) - generation_before}
        self.steady.append(steady)
        return steady

    async def event(self, name: str, members: list[FleetMember], *, before: int, after: int, since: float,
                    until: float, totals: dict[str, dict[str, float]], generation_before: int, steady: Steady,
                    restarts: list[Restart] | None = None) -> Event:
        """The figures of an event from ``since`` until the group settled (``until``), or ``min_event_s`` if
        that is later (waited out here); the workers' counters read once more at its end."""
        until = max(until, since + self.min_event_s)
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        await asyncio.to_thread(observe_all, members)
        answers, rate = self.rate(since, until)
        ratio = rate / steady["answers_per_s"] if steady["answers_per_s"] else 0.0
        figures: Event = {
            "name": name, "workers_before": before, "workers_after": after,
            "started_at_s": round(since - self.started, 1), "seconds": round(until - since, 1),
            "answers": answers, "answers_per_s": rate, "steady_answers_per_s": steady["answers_per_s"],
            "ratio": round(ratio, 2), "shortfall_s": round((until - since) * (1 - ratio), 1),
            "rebalances": generation(members) - generation_before,
            "workers": event_figures(members, totals), "restarts": restarts or [],
        }
        self.events.append(figures)
        return figures


def _totals(members: list[FleetMember]) -> dict[str, dict[str, float]]:
    return {member.name: dict(member.totals) for member in members}


async def _terminate(members: list[FleetMember], timeout_s: float) -> list[int | None]:
    """SIGTERM each at once, as Kubernetes stops the pods of a scale-down; their exit codes."""
    return list(await asyncio.gather(*(asyncio.to_thread(m.process.terminate, timeout_s) for m in members)))


async def _rolling_restart(members: list[FleetMember], shape: FleetShape) -> tuple[list[Restart], float]:
    """Each member in turn: SIGTERM, wait for its exit, start it again, wait for the group to settle. The
    restarts, and when the group had settled after the last."""
    restarts: list[Restart] = []
    settled = time.monotonic()
    for member in members:
        await asyncio.to_thread(observe_all, members)  # its counters, before its process goes
        stopping = time.monotonic()
        code = await asyncio.to_thread(member.process.terminate, shape.settle_timeout_s)
        if code != 0:
            raise RuntimeError(f"{member.name} exited {code} on SIGTERM; see {member.process.log_path}")
        starting = time.monotonic()
        member.process.start()
        joined_at: dict[str, float] = {}
        settled = await settle(members, shape.partitions, shape.settle_timeout_s, shape.stable_s, joined_at)
        restarts.append({"worker": member.name, "stop_s": round(starting - stopping, 2),
                         "start_s": round(joined_at.get(member.name, settled) - starting, 2),
                         "settled_s": round(settled - starting, 2)})
    return restarts, settled


async def _surge_restart(members: list[FleetMember], shape: FleetShape,
                         replacement: Callable[[FleetMember], FleetMember]) -> tuple[list[Restart], float,
                                                                                  list[FleetMember]]:
    """Each member in turn, as the shipped Deployment rolls (maxSurge 1, maxUnavailable 0): its replacement
    starts and joins, the group settles with both, then the member gets SIGTERM and the group settles without
    it. The restarts (``start_s``: the replacement's start until it joined; ``stop_s``: SIGTERM until the old
    process exited; ``settled_s``: the replacement's start until the group had settled without the old one),
    when the group had settled after the last, and the members now running, replacements in their places."""
    restarts: list[Restart] = []
    running = list(members)
    settled = time.monotonic()
    for index, member in enumerate(members):
        new = replacement(member)
        starting = time.monotonic()
        new.process.start()
        joined_at: dict[str, float] = {}
        await settle([*running, new], shape.partitions, shape.settle_timeout_s, shape.stable_s, joined_at)
        await asyncio.to_thread(observe_all, running)  # the old process's counters, before it goes
        stopping = time.monotonic()
        code = await asyncio.to_thread(member.process.terminate, shape.settle_timeout_s)
        if code != 0:
            raise RuntimeError(f"{member.name} exited {code} on SIGTERM; see {member.process.log_path}")
        exited = time.monotonic()
        running[index] = new
        settled = await settle(running, shape.partitions, shape.settle_timeout_s, shape.stable_s)
        restarts.append({"worker": member.name, "stop_s": round(exited - stopping, 2),
                         "start_s": round(joined_at.get(new.name, settled) - starting, 2),
                         "settled_s": round(settled - starting, 2)})
    return restarts, settled, running


async def _answered_all(answers: AnswerCount, stream: BacklogStream, timeout_s: float) -> None:
    """Until every published request has a committed answer (or ``timeout_s``: the count then says which not)."""
    wanted = {request_record(number)[0] for number in range(stream.published)}
    deadline = time.monotonic() + timeout_s
    while not wanted <= answers.ids and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


@dataclass(frozen=True)
class FleetShape:
    """What a run is made of (``d3stream bench fleet``'s flags)."""

    workers: int = 4
    scale_from: int = 2
    partitions: int = 12
    device_ms: float = 40.0
    batch_rows: int = 8
    max_inflight: int = 64
    steady_s: float = 20.0
    backlog: int | None = None  # default: three seconds of the whole fleet's capacity
    delivery: DeliveryName = "exactly_once"
    static: bool = False
    # How the rolling restart replaces a worker: "surge" starts the new process before the old one stops (the
    # shipped Deployment: maxSurge 1, maxUnavailable 0); "stop_first" stops it first (maxSurge 0,
    # maxUnavailable 1: a fleet with no spare GPU, or a StatefulSet).
    rollout: str = "surge"
    keep_partitions: bool = True  # the workers' rebalance_keep_partitions (False: they drain at every rebalance)
    heartbeat_ms: int | None = None  # the workers' heartbeat_interval_ms (None: theirs by default)
    session_timeout_ms: int = 10_000
    commit_interval_ms: int = 500
    load_s: float = 0.0
    log_level: str = "info"  # the workers' (debug: aiokafka's requests too, as chasing a fault needs)
    stable_s: float = 2.0  # how long the group must look settled to be settled
    min_event_s: float = 5.0  # an event settled sooner is measured over this long (ten commits at the default)
    settle_timeout_s: float = 120.0

    @property
    def capacity_per_worker(self) -> float:
        return self.batch_rows / (self.device_ms / 1000)

    @property
    def backlog_requests(self) -> int:
        default = max(int(3 * self.workers * self.capacity_per_worker), 4 * self.workers * self.max_inflight)
        return self.backlog or default

    def check(self) -> None:
        if not 1 <= self.scale_from <= self.workers:
            raise ValueError(f"--scale-from must be between 1 and --workers ({self.workers}), got {self.scale_from}")
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"--rollout must be one of {', '.join(ROLLOUTS)}, got {self.rollout!r}")
        if self.rollout == "surge" and self.static:
            raise ValueError("--static needs --rollout stop_first: a replacement started beside the worker would "
                             "take its group_instance_id and fence it")
        if self.partitions < self.workers:
            raise ValueError(f"--partitions ({self.partitions}) below --workers ({self.workers}) leaves a worker idle")


def worker_settings(bootstrap: str, topics: dict[str, str], group: str, shape: FleetShape) -> dict[str, str]:
    """The workers' common environment. Inherited ``D3STREAM_*`` variables are left out: a setting of the
    shell's must not change what is measured."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("D3STREAM_")}
    settings: dict[str, object] = {
        "bootstrap_servers": bootstrap, "request_topics": topics["requests"], "answer_topic": topics["answers"],
        "dead_letter_topic": topics["dlq"], "provenance_topic": topics["prov"], "group_id": group,
        "client_id": group, "create_topics": "false", "delivery": shape.delivery,
        "session_timeout_ms": shape.session_timeout_ms, "commit_interval_ms": shape.commit_interval_ms,
        "max_batch_rows": shape.batch_rows, "max_inflight_requests": shape.max_inflight,
        "rebalance_keep_partitions": str(shape.keep_partitions).lower(),
        **({"heartbeat_interval_ms": shape.heartbeat_ms} if shape.heartbeat_ms else {}),
        "log_format": "json", "log_level": shape.log_level,  # the logs say what each rebalance did, and how long
    }
    env.update({f"D3STREAM_{name.upper()}": str(value) for name, value in settings.items()})
    return env


async def run_fleet(broker: KafkaBroker, shape: FleetShape, folder: Path, prefix: str = "fleet",
                    progress: Callable[[str], None] | None = None) -> FleetReport:
    """The timeline of the module's docstring on ``broker``, topics ``<prefix>.*``; logs in ``folder``."""
    shape.check()
    step = progress or (lambda name: None)
    topics = {name: f"{prefix}.{name}" for name in ("requests", "answers", "dlq", "prov")}
    for name, topic in topics.items():
        broker.create_topic(topic, shape.partitions if name in ("requests", "answers") else 1, exist_ok=True)
    bootstrap = broker.bootstrap_servers
    env = worker_settings(bootstrap, topics, prefix, shape)
    members = fleet_members(env, folder, shape.workers, device_ms=shape.device_ms, load_s=shape.load_s,
                            static=shape.static)
    low, everyone = members[:shape.scale_from], members
    began, load_before = time.monotonic(), os.getloadavg()[0]
    stop = asyncio.Event()
    codes: list[int | None] = []
    retired: list[FleetMember] = []  # surge: the processes replaced in the rolling restart
    replacements: list[FleetMember] = []  # surge: their replacements, stopped at the end even if the roll failed
    stream = BacklogStream(bootstrap, topics["requests"], shape.partitions, shape.backlog_requests)
    async with AnswerCount(bootstrap, topics["answers"], on_answered=stream.answered) as answers:
        timeline = Timeline(answers, shape.min_event_s)
        publishing: asyncio.Task[None] | None = None
        try:
            step(f"starting {len(low)} workers")
            for member in low:
                member.process.start()
            await settle(low, shape.partitions, shape.settle_timeout_s, shape.stable_s)
            priority_taken_back = all(serving_priority(member) == os.getpriority(os.PRIO_PROCESS, 0) for member in low)
            publishing = asyncio.create_task(stream.run(stop))
            timeline.started = time.monotonic()
            await asyncio.sleep(shape.stable_s)  # the backlog builds up and the passes fill
            step(f"steady, {len(low)} workers")
            steady_low = await timeline.hold_steady(low, shape.steady_s)
            if len(low) < len(everyone):
                step(f"scale up {len(low)} -> {len(everyone)}")
                await asyncio.to_thread(observe_all, low)
                totals, generation_before, since = _totals(everyone), generation(low), time.monotonic()
                for member in everyone[len(low):]:
                    member.process.start()
                until = await settle(everyone, shape.partitions, shape.settle_timeout_s, shape.stable_s)
                await timeline.event("scale_up", everyone, before=len(low), after=len(everyone), since=since,
                                     until=until, totals=totals, generation_before=generation_before,
                                     steady=steady_low)
                step(f"steady, {len(everyone)} workers")
                steady_all = await timeline.hold_steady(everyone, shape.steady_s)
            else:
                steady_all = steady_low
            step("rolling restart")
            await asyncio.to_thread(observe_all, everyone)
            totals, generation_before, since = _totals(everyone), generation(everyone), time.monotonic()
            if shape.rollout == "surge":
                def replacement(member: FleetMember) -> FleetMember:
                    new = fleet_member(env, folder, f"{member.name}'", device_ms=shape.device_ms,
                                       load_s=shape.load_s, static=shape.static)
                    retired.append(member)
                    replacements.append(new)
                    return new

                restarts, until, rolled = await _surge_restart(everyone, shape, replacement)
            else:
                restarts, until = await _rolling_restart(everyone, shape)
                rolled = everyone
            await timeline.event("rolling_restart", [*retired, *rolled],
                                 before=len(everyone), after=len(everyone), since=since, until=until, totals=totals,
                                 generation_before=generation_before, steady=steady_all, restarts=restarts)
            everyone = rolled
            low = everyone[:shape.scale_from]
            if len(low) < len(everyone):
                step(f"scale down {len(everyone)} -> {len(low)}")
                await asyncio.to_thread(observe_all, everyone)
                totals, generation_before, since = _totals(everyone), generation(everyone), time.monotonic()
                # The group has settled once the others own every partition, whether or not the stopped
                # processes have exited yet.
                stopping = asyncio.create_task(_terminate(everyone[len(low):], shape.settle_timeout_s))
                until = await settle(low, shape.partitions, shape.settle_timeout_s, shape.stable_s)
                codes += await stopping
                await timeline.event("scale_down", low, before=len(everyone), after=len(low), since=since,
                                     until=until, totals=totals, generation_before=generation_before,
                                     steady=steady_low)
            step("draining")
            stop.set()
            await publishing
            await _answered_all(answers, stream, shape.settle_timeout_s)
            ended = time.monotonic()
        finally:
            stop.set()
            if publishing is not None and not publishing.done():
                await asyncio.gather(publishing, return_exceptions=True)
            running = {id(m): m for m in [*everyone, *replacements] if m.running}  # once each
            codes = await _terminate(list(running.values()), shape.settle_timeout_s) + codes
    step("counting")
    counted = await count_topic(bootstrap, topics["answers"])
    report = _report(shape, stream, counted, timeline, codes, folder, since=timeline.started, until=ended,
                     seconds=time.monotonic() - began, members=[*retired, *everyone])
    report["load_average"] = (round(load_before, 1), round(os.getloadavg()[0], 1))
    report["priority_taken_back"] = priority_taken_back
    return report


def _report(shape: FleetShape, stream: BacklogStream, counted: list[dict[str, object]], timeline: Timeline,
            codes: list[int | None], folder: Path, *, since: float, until: float, seconds: float,
            members: list[FleetMember]) -> FleetReport:
    counts = Counter(answer.get("id") for answer in counted)
    ids = [request_record(number)[0].decode() for number in range(stream.published)]
    lost = [i for i in ids if counts[i] == 0]
    repeated = [i for i in ids if counts[i] > 1]
    logs = "".join(m.process.log_path.read_text(errors="replace") for m in members if m.process.log_path.exists())
    return {
        "delivery": shape.delivery, "static": shape.static, "rollout": shape.rollout,
        "keep_partitions": shape.keep_partitions,
        "heartbeat_ms": shape.heartbeat_ms,
        "workers": shape.workers, "scale_from": shape.scale_from,
        "partitions": shape.partitions, "device_ms": shape.device_ms, "batch_rows": shape.batch_rows,
        "max_inflight": shape.max_inflight, "backlog": shape.backlog_requests,
        "commit_interval_ms": shape.commit_interval_ms, "session_timeout_ms": shape.session_timeout_ms,
        "load_s": shape.load_s, "capacity_per_worker": round(shape.capacity_per_worker, 1),
        "steady": timeline.steady, "events": timeline.events,
        "sent": len(ids), "answered": sum(1 for i in ids if counts[i] > 0), "lost": len(lost),
        "repeated": sum(counts[i] - 1 for i in repeated), "lost_ids": lost[:10], "repeated_ids": repeated[:10],
        "errors": sum(1 for answer in counted if answer.get("error")),
        "exit_codes": codes, "tracebacks": logs.count("Traceback"),
        "timeline": timeline.answers.per_second(since, until), "load_average": (0.0, 0.0),
        "priority_taken_back": False, "logs": str(folder),
        "seconds": round(seconds, 1),
    }


# -------------------------------------------------------------------------------------------- the table


ROLLOUT_TITLES = {"surge": "new before old (maxSurge 1)", "stop_first": "old stopped first (maxUnavailable 1)"}
EVENT_TITLES = {"scale_up": "scale up", "rolling_restart": "rolling restart", "scale_down": "scale down"}


def fleet_markdown(report: FleetReport) -> str:
    """The report as a Markdown table and its notes."""
    lines = [
        f"Fleet of {report['workers']} workers ({'static' if report['static'] else 'dynamic'} membership, "
        f"rolling restart {ROLLOUT_TITLES[report['rollout']]}, "
        f"{report['delivery']}, rebalances "
        f"{'keep what they hand back' if report['keep_partitions'] and report['delivery'] == 'exactly_once' else 'drain'}"
        + (f", heartbeat {report['heartbeat_ms']} ms" if report.get("heartbeat_ms") else "")
        + f"), {report['partitions']} partitions; each pass sleeps {report['device_ms']:g} ms "
        f"for up to {report['batch_rows']} rows ({report['capacity_per_worker']:,.0f} answers/s per worker); "
        f"backlog {report['backlog']:,} requests:",
        "",
        "| phase | workers | seconds | answers/s | ÷ steady | shortfall s | rebalances | paused s per worker |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for steady in report["steady"]:
        lines.append(f"| steady | {steady['workers']} | {steady['seconds']:g} | {steady['answers_per_s']:,.0f} | "
                     f"1.00 | | {steady['rebalances']} | |")
    events = report["events"]
    for event in events:
        paused = ", ".join(f"{w['paused_s']:.1f}" for w in event["workers"])
        workers = (f"{event['workers_before']}" if event["workers_before"] == event["workers_after"]
                   else f"{event['workers_before']} → {event['workers_after']}")
        lines.append(f"| {EVENT_TITLES.get(event['name'], event['name'])} | {workers} | {event['seconds']:g} | "
                     f"{event['answers_per_s']:,.0f} | **{event['ratio']:.2f}** | {event['shortfall_s']:g} | "
                     f"{event['rebalances']} | {paused} |")
    lines.append("")
    for event in events:
        if event["restarts"]:
            lines.append("Rolling restart, per worker: stop (SIGTERM to exit) / start (to joined) / start to settled, s: "
                         + "; ".join(f"{r['worker']} {r['stop_s']:.1f} / {r['start_s']:.1f} / {r['settled_s']:.1f}"
                                     for r in event["restarts"]) + ".")
    lines.append(f"Requests sent {report['sent']:,}, answered {report['answered']:,}, lost {report['lost']}, "
                 f"repeated {report['repeated']}, error answers {report['errors']}; worker exit codes "
                 f"{report['exit_codes']}, tracebacks in the logs {report['tracebacks']}; {report['seconds']:g} s in all; "
                 f"load average {report['load_average'][0]:g} before, {report['load_average'][1]:g} after"
                 + ("" if report["priority_taken_back"] else "; the workers could not take their CPU priority back "
                    "after starting (fleet_worker.py)") + ".")
    return "\n".join(lines)


async def fleet_bench_async(shape: FleetShape, *, broker: KafkaBroker | None = None, folder: Path | None = None,
                            progress: Callable[[str], None] | None = None) -> FleetReport:
    """``run_fleet`` on ``broker`` (default: a fresh embedded one, started and stopped here)."""
    import tempfile
    import uuid

    folder = folder or Path(tempfile.mkdtemp(prefix="d3stream-fleet-"))
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    if broker is not None:
        return await run_fleet(broker, shape, folder, prefix, progress)
    from d3stream.dev.infra import KafkaBroker, ensure_jars

    ensure_jars()
    with KafkaBroker(partitions=shape.partitions) as own:
        return await run_fleet(own, shape, folder, prefix, progress)


def fleet_bench(shape: FleetShape, *, broker: KafkaBroker | None = None, folder: Path | None = None,
                progress: Callable[[str], None] | None = None) -> FleetReport:
    return asyncio.run(fleet_bench_async(shape, broker=broker, folder=folder, progress=progress))
