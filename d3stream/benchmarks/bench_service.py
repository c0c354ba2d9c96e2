"""Service-level benchmarks on the embedded broker: the Kafka path's overhead, and memory over a long soak.

``d3stream bench kafka``: how much of a broker's consume -> produce rate the d3stream service keeps when
the model costs nothing. The same requests are read from one topic and answered into another by

* **raw**: a plain aiokafka loop (``getmany``, parse the JSON, send an answer-sized record per request,
  wait for the acknowledgements, commit) -- the fastest a Python consumer-producer goes on this broker;
* **d3stream**: ``Service`` with ``NullModel``, a stand-in that validates the questions and returns uniform
  probabilities without running anything, so what remains is d3stream's own path: decoding, validation,
  the batch scheduler, answer building with provenance, delivery and commits.

Both run in the two delivery modes side by side (raw at-least-once against d3stream ``at_least_once``; raw
transactional, one transaction per fetched batch, against d3stream ``exactly_once``), in one run, on the
same broker. The clock starts when the first records are read and stops when every answer is published and
its offset committed. Unmeasured passes of both loops in both modes warm the broker (and the process) first,
and the four paths take turns for a few rounds, each keeping its best: on a 2-core machine single runs vary by
a third or more.

``d3stream bench soak N``: the service with the tiny random checkpoint answers N small requests (fed in
chunks, so backpressure holds the in-flight work bounded); the resident set size is sampled after every
chunk. "Flat" means the last tenth of the samples averages within 5 % of the samples around the middle
of the soak: a leak grows with every request, warm-up (allocator arenas, first batch shapes) levels off.
The growth since the first tenth is reported too.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

import structlog

from d3stream.kafka.commits import DELIVERY_MODES
from d3stream.runtime import D3, Prepared, Row
from d3stream.runtime.questions import QuestionCache, question_error, require_json
from d3stream.settings import DeliveryName, Settings

if TYPE_CHECKING:
    from d3stream.core.seams import DecisionModel
    from d3stream.dev.infra import KafkaBroker, SchemaRegistry
    from d3stream.service import Service

log = structlog.get_logger(__name__)

QUESTIONS = (
    {"type": "noul", "instructions": "Is the request urgent?"},
    {"type": "choice", "criteria": {"approve": "approve it", "reject": "reject it", "escalate": "ask a person"}},
    {"type": "score", "criteria": ["none", "low", "medium", "high"]},
)
NULL_ROW_TOKENS = 64  # what each question counts for the token budgets (nothing is run)
_NULL_IDS = [0] * NULL_ROW_TOKENS  # every row's prompt (never read: shared, as nothing runs it)
# The raw loop's records are as large as d3stream's answers to these requests (about 1,050 bytes measured),
# and neither side compresses: the ratio then measures per-request work, not bytes or a codec.
RAW_PADDING = 970


class NullModel:
    """A model stand-in for the Kafka benchmark: validates questions, answers uniform probabilities."""

    model_name = "null-model"
    device = "cpu"
    attention_mode = "noncausal"  # no shared-prefix reuse: there is nothing to reuse
    image_unavailable = video_unavailable = "the null model takes no media"
    media_cache = None

    def __init__(self) -> None:
        self.questions = QuestionCache()  # as the runtime's prompt preparer keeps them

    def limit_prompt_tokens(self, limit: int | None) -> None:
        return None

    def kernel_record(self) -> dict[str, str]:
        return {}

    def limit_request_tokens(self, limit: int | None) -> None:
        return None

    def request_may_exceed_tokens(self, record_bytes: int, questions: int) -> bool:
        return False

    def check_request_tokens(self, state: object, questions: Mapping[str, object], *,
                             permutation_average: bool | None = None) -> None:
        return None

    def provenance(self) -> dict[str, str]:
        return {"kind": "null", "runtime": "d3stream-bench-null", "policy": "uniform probabilities, no model"}

    def load_images(self, items: Sequence[object], strict: bool = True) -> list[object]:
        if items:
            raise ValueError("the null model takes no media")
        return []

    load_videos = load_images

    def prepare(self, state: object, questions: Mapping[str, object], *, decoded_images: list[object] | None = None,
                decoded_videos: list[object] | None = None, permutation_average: bool | None = None) -> Prepared:
        require_json(state, "state")
        if not isinstance(questions, dict) or not questions:
            raise ValueError("questions must be a nonempty mapping of question IDs to questions")
        prepared = Prepared(keys=list(questions), model_name=self.model_name)
        normalize = self.questions.normalize
        for key, question in questions.items():
            try:
                normalized = normalize(question)
            except ValueError as exc:
                prepared.errors[key] = question_error(question, "invalid_question", str(exc))
                continue
            prepared.questions[key] = normalized
            prepared.rows.append(Row(key, _NULL_IDS, normalized.option_count))
        return prepared

    def forward(self, rows: Sequence[Row]) -> list[list[float]]:
        return [[1.0 / row.options] * row.options for row in rows]


def small_requests(count: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """``count`` small text requests (1-3 questions, a sentence or two of state) as (key, value) records."""
    rng = random.Random(seed)
    records = []
    for n in range(count):
        chosen = rng.sample(range(len(QUESTIONS)), rng.randint(1, 3))
        rid = f"bench-{seed}-{n:07d}"
        request = {
            "id": rid,
            "state": f"Ticket {n}: customer reports item {rng.randint(1, 10**6)} arrived {rng.choice(['late', 'damaged', 'early'])}.",
            "questions": {f"q{i}": QUESTIONS[i] for i in chosen},
        }
        records.append((rid.encode(), json.dumps(request).encode()))
    return records


# ----------------------------------------------------------------------------------- kafka overhead


def _null_answer(value: bytes) -> bytes:
    """The raw loop's answer: as large as d3stream's, no work behind it."""
    request = json.loads(value)
    return json.dumps({"id": request["id"], "answers": {k: {"p": 0.5} for k in request["questions"]},
                       "padding": "x" * RAW_PADDING}).encode()


async def consume_answer_loop(bootstrap: str, source: str, sink: str, group: str, count: int, *,
                              answer: Callable[[bytes], bytes] = _null_answer, transactional: bool = False,
                              max_records: int = 2000) -> float:
    """A plain aiokafka consumer-producer: ``answer`` each of ``count`` requests in turn and publish what it
    returns; after each fetched batch, wait for the acknowledgements and commit (in the batch's transaction when
    ``transactional``). Seconds from the first fetched record to the last commit."""
    from d3stream.kafka.connection import raw_client

    consumer = raw_client("consumer", source, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                          auto_offset_reset="earliest", isolation_level="read_committed")
    options: dict[str, str] = {"transactional_id": f"{group}-raw"} if transactional else {}
    producer = raw_client("producer", bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=2,
                          **options)
    await producer.start()
    await consumer.start()
    try:
        done = 0
        started: float | None = None
        while done < count:
            batches = await consumer.getmany(timeout_ms=200, max_records=max_records)
            if not batches:
                continue
            if started is None:
                started = time.perf_counter()
            offsets = {}
            if transactional:
                await producer.begin_transaction()
            sends = []
            for partition, records in batches.items():
                for record in records:
                    sends.append(await producer.send(sink, answer(record.value), key=record.key))
                offsets[partition] = records[-1].offset + 1
                done += len(records)
            await asyncio.gather(*sends)
            if transactional:
                await producer.send_offsets_to_transaction(offsets, group)
                await producer.commit_transaction()
            else:
                await consumer.commit(offsets)
        return time.perf_counter() - (started or time.perf_counter())
    finally:
        await consumer.stop()
        await producer.stop()


def _finished(service: Service) -> int:
    """Requests the service has answered (an error answer counts)."""
    return service.counts["answered"] + service.counts["errors"]


async def _until_finished(service: Service, task: asyncio.Task[None], count: int, poll_s: float) -> None:
    """Until the service has answered ``count`` requests; what it raised if it stopped first."""
    while _finished(service) < count:
        if task.done():
            task.result()
            raise RuntimeError("the service stopped before answering every request")
        await asyncio.sleep(poll_s)


async def until_joined(service: Service, task: asyncio.Task[None]) -> None:
    """Until the service holds its partitions; what it raised if it stopped first."""
    while not service.joined:
        if task.done():
            task.result()
        await asyncio.sleep(0.002)


async def until_reading(service: Service, task: asyncio.Task[None]) -> float:
    """Until the service has read its first records; when it did (perf_counter), or what it raised if it
    stopped first."""
    while service.loop is None or service.loop.first_read_at is None:
        if task.done():
            task.result()
            raise RuntimeError("the service stopped before reading a request")
        await asyncio.sleep(0.002)
    return service.loop.first_read_at


async def serve_until_answered(settings: Settings, model: DecisionModel, count: int, *,
                               shadow: DecisionModel | None = None) -> tuple[float, Service]:
    """Serve until ``count`` requests are answered and committed; seconds from the first records read to done,
    as ``consume_answer_loop`` times itself (the group's join and the first fetch are not per-request work).
    ``shadow`` goes to ``Service`` (bench/shadow_cost.py)."""
    from d3stream.service import Service

    service = Service(settings, model, shadow=shadow)
    task = asyncio.create_task(service.run())
    try:
        await until_joined(service, task)
        started = await until_reading(service, task)
        await _until_finished(service, task, count, 0.002)
        assert service.delivery is not None  # the service is running
        await service.delivery.flush()
        while service.tracker.committable():  # a flush already under way may still be finishing
            await asyncio.sleep(0.002)
            await service.delivery.flush()
        seconds = time.perf_counter() - started
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
    return seconds, service


# The four paths of ``d3stream bench kafka``, in the order they take turns.
KafkaRun = Literal["raw_at_least_once", "d3stream_at_least_once", "raw_transactional", "d3stream_exactly_once",
                   "d3stream_exactly_once_avro"]
KAFKA_RUNS: tuple[KafkaRun, ...] = (
    "raw_at_least_once", "d3stream_at_least_once", "raw_transactional", "d3stream_exactly_once",
)
# With a Schema Registry: the same requests framed as Avro, answered as Avro (answer_format avro).
FRAMED_RUN: KafkaRun = "d3stream_exactly_once_avro"


class RunFigures(TypedDict):
    """One path's best round."""

    seconds: float
    events_per_s: float


class KafkaReport(TypedDict):
    """``d3stream bench kafka``: each path's best round, every round's rate, and d3stream over raw."""

    requests: int
    partitions: int
    rounds: int
    topics: dict[str, str]
    by_round: dict[str, list[float]]
    raw_at_least_once: RunFigures
    d3stream_at_least_once: RunFigures
    raw_transactional: RunFigures
    d3stream_exactly_once: RunFigures
    at_least_once_ratio: float
    exactly_once_ratio: float
    # The same ratios from each path's median round: the raw loop's best round moves most between runs (its rate
    # follows the broker's latency, d3stream's its own CPU), so these say whether a best round decided the ratio.
    at_least_once_median_ratio: float
    exactly_once_median_ratio: float
    # With a registry: the framed path, and its rate over the plain JSON exactly_once path's (target >= 0.9:
    # schema handling costs at most a tenth of the Kafka path).
    d3stream_exactly_once_avro: NotRequired[RunFigures]
    registry_ratio: NotRequired[float]


def kafka_overhead(count: int = 20_000, *, rounds: int = 3, broker: KafkaBroker | None = None,
                   prefix: str = "bench", progress: Callable[[str], None] | None = None,
                   registry: SchemaRegistry | None = None) -> KafkaReport:
    """The raw-versus-d3stream comparison on ``broker`` (an ``infra.KafkaBroker``; default: a fresh one,
    started and stopped here), on topics named ``<prefix>.*``; figures as one dict.

    Unmeasured passes warm the broker first, the raw loop's (plain, then transactional) and then d3stream's
    (at_least_once, then exactly_once): the first pass of each kind on a fresh broker runs at half to two thirds
    of the later ones, which flattered whichever path came second, and d3stream's own first pass in a process
    still fills its caches (the questions', the allocator's). Then the four paths run ``rounds`` times in turn,
    and each path's figure is its best round.

    With ``registry`` (an ``infra.SchemaRegistry``), a fifth path answers the same requests framed as Avro
    through it, answering in Avro, beside the plain exactly_once path: ``registry_ratio`` is its rate over
    theirs."""
    if broker is None:
        from d3stream.dev.infra import embedded_stack

        with embedded_stack(partitions=4) as stack:
            return kafka_overhead(count, rounds=rounds, broker=stack.broker, prefix=prefix, progress=progress,
                                  registry=stack.registry)
    from d3stream_client.publisher import produce

    bootstrap = broker.bootstrap_servers
    topics = {name: f"{prefix}.{name}" for name in ("requests", "warm-up", "raw-out", "answers", "dlq", "prov",
                                                    "requests-avro", "answers-avro")}
    for topic in topics.values():
        broker.create_topic(topic, 4, exist_ok=True)
    requests = small_requests(count)
    asyncio.run(produce(bootstrap, topics["requests"], requests))
    if registry is not None:
        asyncio.run(produce(bootstrap, topics["requests-avro"], framed_requests(registry.url, topics, requests)))
    if progress is not None:
        progress("warm-up")
    for transactional in (False, True):  # the broker's code paths of both modes
        asyncio.run(consume_answer_loop(bootstrap, topics["requests"], topics["warm-up"],
                                        f"{prefix}-warm-up-{transactional}", count, transactional=transactional))
    warm_up = {**topics, "answers": topics["warm-up"]}  # like the raw passes', its answers go where none are counted
    for mode in ("at_least_once", "exactly_once"):  # the broker's paths for d3stream's batches and transactions
        _one_kafka_run(False, mode, bootstrap, warm_up, f"{prefix}-warm-up-d3stream-{mode}", count)
    runs: tuple[tuple[KafkaRun, bool, DeliveryName], ...] = (  # (name, the raw loop?, delivery mode)
        ("raw_at_least_once", True, "at_least_once"),
        ("d3stream_at_least_once", False, "at_least_once"),
        ("raw_transactional", True, "exactly_once"),
        ("d3stream_exactly_once", False, "exactly_once"),
        *(((FRAMED_RUN, False, "exactly_once"),) if registry is not None else ()),
    )
    by_round: dict[str, list[float]] = {}
    best: dict[KafkaRun, RunFigures] = {}  # each path's best round
    for round_number in range(rounds):
        for name, raw, mode in runs:
            if progress is not None:
                progress(f"{name} ({round_number + 1}/{rounds})")
            seconds = _one_kafka_run(raw, mode, bootstrap, topics, f"{prefix}-{name}-{round_number}", count,
                                     registry.url if name == FRAMED_RUN and registry is not None else None)
            figures: RunFigures = {"seconds": round(seconds, 3), "events_per_s": round(count / seconds, 1)}
            by_round.setdefault(name, []).append(figures["events_per_s"])
            if name not in best or figures["events_per_s"] > best[name]["events_per_s"]:
                best[name] = figures
    report: KafkaReport = {
        "requests": count, "partitions": 4, "rounds": rounds, "topics": topics, "by_round": by_round,
        "raw_at_least_once": best["raw_at_least_once"],
        "d3stream_at_least_once": best["d3stream_at_least_once"],
        "raw_transactional": best["raw_transactional"],
        "d3stream_exactly_once": best["d3stream_exactly_once"],
        "at_least_once_ratio": round(
            best["d3stream_at_least_once"]["events_per_s"] / best["raw_at_least_once"]["events_per_s"], 3),
        "exactly_once_ratio": round(
            best["d3stream_exactly_once"]["events_per_s"] / best["raw_transactional"]["events_per_s"], 3),
        "at_least_once_median_ratio": round(
            statistics.median(by_round["d3stream_at_least_once"]) / statistics.median(by_round["raw_at_least_once"]), 3),
        "exactly_once_median_ratio": round(
            statistics.median(by_round["d3stream_exactly_once"]) / statistics.median(by_round["raw_transactional"]), 3),
    }
    if FRAMED_RUN in best:
        report["d3stream_exactly_once_avro"] = best[FRAMED_RUN]
        report["registry_ratio"] = round(
            best[FRAMED_RUN]["events_per_s"] / best["d3stream_exactly_once"]["events_per_s"], 3)
    return report


def framed_requests(registry_url: str, topics: Mapping[str, str],
                    requests: Sequence[tuple[bytes | None, bytes]]) -> list[tuple[bytes | None, bytes]]:
    """The requests in the registry's wire format as an Avro producer writes them (the contract's Request
    schema, registered under the framed request topic's subject)."""
    from d3stream_client.contract import Request

    from d3stream.kafka.registry import Registry
    from d3stream.settings import RegistrySettings

    registry = Registry(RegistrySettings(schema_registry_url=registry_url, answer_format="avro",
                                         schema_auto_register=True))
    framing = asyncio.run(registry.writers_for({topics["requests-avro"]: Request}))
    return [(key, framing.encode(topics["requests-avro"], value)) for key, value in requests]


def _one_kafka_run(raw: bool, mode: DeliveryName, bootstrap: str, topics: dict[str, str], group: str,
                   count: int, registry_url: str | None = None) -> float:
    """Seconds one path (the raw loop, transactional for ``exactly_once``; or d3stream in ``mode``, through the
    registry at ``registry_url`` when given) takes to answer ``count`` requests from the start, as consumer
    group ``group``."""
    if raw:
        return asyncio.run(consume_answer_loop(bootstrap, topics["requests"], topics["raw-out"], group, count,
                                               transactional=DELIVERY_MODES[mode].transactional))
    settings = Settings.from_flat(
        bootstrap_servers=bootstrap, request_topics=[topics["requests"]], answer_topic=topics["answers"],
        dead_letter_topic=topics["dlq"], provenance_topic=topics["prov"], group_id=group, client_id=group,
        delivery=mode, metrics_port=None, create_topics=False, log_level="warning",
        max_inflight_requests=4096, commit_interval_ms=100, linger_ms=2, compression="none",
    )
    if registry_url is not None:
        settings = settings.replaced(request_topics=[topics["requests-avro"]], answer_topic=topics["answers-avro"],
                                     schema_registry_url=registry_url, answer_format="avro",
                                     schema_auto_register=True)
    seconds, _ = asyncio.run(serve_until_answered(settings, NullModel(), count))
    return seconds


def kafka_markdown(report: KafkaReport) -> str:
    lines = [
        f"Kafka path with a null model, {report['requests']:,} small requests, {report['partitions']} partitions, "
        f"best of {report['rounds']} rounds after warm-up passes:",
        "",
        "| path | seconds | events/s |",
        "|---|---:|---:|",
    ]
    for name in KAFKA_RUNS:
        figures = report[name]
        lines.append(f"| {name.replace('_', ' ')} | {figures['seconds']:.2f} | {figures['events_per_s']:,.0f} |")
    framed = report.get("d3stream_exactly_once_avro")
    if framed is not None:
        lines.append(f"| d3stream exactly once, Avro through the registry | {framed['seconds']:.2f} | "
                     f"{framed['events_per_s']:,.0f} |")
    lines += [
        "",
        f"d3stream ÷ raw: at_least_once {report['at_least_once_ratio']:.2f}, "
        f"exactly_once ÷ raw transactional {report['exactly_once_ratio']:.2f} (target ≥ 0.7 in both).",
        f"The same from each path's median round: at_least_once {report['at_least_once_median_ratio']:.2f}, "
        f"exactly_once {report['exactly_once_median_ratio']:.2f}.",
    ]
    if "registry_ratio" in report:
        lines.append(f"Avro through the registry ÷ plain JSON, exactly_once: {report['registry_ratio']:.2f} "
                     "(target ≥ 0.9: schema handling at most a tenth of the Kafka path).")
    return "\n".join(lines)


def worker_settings(broker: KafkaBroker, prefix: str, partitions: int, **overrides: object) -> Settings:
    """A benchmark worker's settings on topics ``<prefix>.requests|answers|dlq|prov`` of ``broker`` (created
    here, ``partitions`` each), its group and client named ``prefix``; ``overrides`` on top."""
    topics = {name: f"{prefix}.{name}" for name in ("requests", "answers", "dlq", "prov")}
    for topic in topics.values():
        broker.create_topic(topic, partitions, exist_ok=True)
    values: dict[str, object] = dict(
        bootstrap_servers=broker.bootstrap_servers, request_topics=[topics["requests"]],
        answer_topic=topics["answers"], dead_letter_topic=topics["dlq"], provenance_topic=topics["prov"],
        group_id=prefix, client_id=prefix, metrics_port=None, create_topics=False, log_level="warning",
    )
    return Settings.from_flat(**{**values, **overrides})


# ---------------------------------------------------------------------------------------- RSS soak


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


async def _soak(settings: Settings, model: DecisionModel, bootstrap: str, total: int, chunk: int,
                tick: Callable[[int], None] | None) -> list[tuple[int, int]]:
    from d3stream_client.publisher import produce

    from d3stream.service import Service

    service = Service(settings, model)
    task = asyncio.create_task(service.run())
    samples: list[tuple[int, int]] = []
    try:
        sent = 0
        while sent < total:
            size = min(chunk, total - sent)
            await produce(bootstrap, settings.delivery.request_topics[0], small_requests(size, seed=sent))
            sent += size
            # Keep at most two chunks ahead of the service, so the topic is never drained dry for long.
            await _until_finished(service, task, sent - chunk, 0.05)
            answered = _finished(service)
            samples.append((answered, _rss_bytes()))
            if tick is not None:
                tick(answered)
        await _until_finished(service, task, total, 0.05)
        samples.append((total, _rss_bytes()))
    finally:
        service.stop()
        await asyncio.wait_for(task, 300)
    return samples


def rss_soak(model: DecisionModel | str | os.PathLike[str], total: int = 100_000, *, chunk: int = 2_000,
             threads: int | None = 1, broker: KafkaBroker | None = None, prefix: str = "soak",
             tick: Callable[[int], None] | None = None) -> SoakVerdict:
    """Answer ``total`` small requests with ``model`` (a loaded D3, or a checkpoint path) on ``broker`` (an
    ``infra.KafkaBroker``; default: a fresh one); RSS samples and the verdict."""
    if isinstance(model, (str, os.PathLike)):
        model = D3.from_pretrained(Path(model), device="cpu")
    if broker is None:
        from d3stream.dev.infra import KafkaBroker, ensure_jars

        ensure_jars()
        with KafkaBroker(partitions=4) as broker:
            return rss_soak(model, total, chunk=chunk, threads=threads, broker=broker, prefix=prefix, tick=tick)
    bootstrap = broker.bootstrap_servers
    settings = worker_settings(broker, prefix, 4, group_id=f"{prefix}-soak", client_id=f"{prefix}-soak",
                               torch_threads=threads)
    started = time.perf_counter()
    samples = asyncio.run(_soak(settings, model, bootstrap, total, chunk, tick))
    return soak_verdict(samples, total, time.perf_counter() - started)


class SoakVerdict(TypedDict):
    """``d3stream bench soak``: RSS over the soak (MB) and whether its second half stayed flat."""

    requests: int
    seconds: float
    events_per_s: float
    rss_mb_first_tenth: float
    rss_mb_halfway: float
    rss_mb_at_end: float
    rss_mb_max: float
    growth_since_first_tenth: float
    growth_second_half: float
    flat_within_5pct: bool
    samples: list[tuple[int, float]]  # (requests answered, RSS in MB) after each chunk


def soak_verdict(samples: list[tuple[int, int]], total: int, seconds: float) -> SoakVerdict:
    """Whether RSS stayed flat. A leak grows with every request; warm-up (allocator arenas, new batch
    shapes) levels off. So the verdict compares the second half of the soak: the last tenth of the samples
    against the samples around the middle. The growth since the first tenth is reported beside it."""
    values = [rss for _, rss in samples]
    tenth = max(1, len(values) // 10)
    middle = len(values) // 2
    early = statistics.mean(values[tenth: 2 * tenth] or values[-tenth:])
    halfway = statistics.mean(values[max(0, middle - tenth // 2): middle + max(1, tenth // 2)])
    final = statistics.mean(values[-tenth:])
    second_half = final / halfway - 1.0
    return {
        "requests": total,
        "seconds": round(seconds, 1),
        "events_per_s": round(total / seconds, 1),
        "rss_mb_first_tenth": round(early / 2**20, 1),
        "rss_mb_halfway": round(halfway / 2**20, 1),
        "rss_mb_at_end": round(final / 2**20, 1),
        "rss_mb_max": round(max(values) / 2**20, 1),
        "growth_since_first_tenth": round(final / early - 1.0, 4),
        "growth_second_half": round(second_half, 4),
        "flat_within_5pct": abs(second_half) <= 0.05,
        "samples": [(answered, round(rss / 2**20, 1)) for answered, rss in samples],
    }
