"""``d3stream bench head-of-line``: text requests behind slow media requests on the same partitions.

An operator's mixed stream, on the embedded broker and object store, through the consume loop and the
delivery of ``d3stream serve`` with the tiny checkpoint: image requests (2/s) and text requests (4/s),
keyed by one of 300 customers, so both kinds share the 3 partitions. Three runs of the same stream:

* **fast store**, ``ordering = key``: the baseline;
* **slow store**, ``ordering = key`` (the default): every object-store read of the images takes
  ``delay_s`` longer (as a throttled or cross-region bucket does; the store still keeps up);
* **slow store**, ``ordering = partition``: answers in offset order per partition, as before out-of-order
  completion existed, for contrast.

A text request's latency is from just before it is published to when its answer is read by a
``read_committed`` reader (``exactly_once``: when its transaction commits). The figure to read is the text p95
of the slow store with ``ordering = key`` against the fast store's. What ``key`` still makes wait is a text
request whose customer has an image request pending before it: about 1 in 70 here (2 images/s each pending
about 2 s, among 300 customers); with 30 customers it is 1 in 7 and shows in the p95.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

from d3stream_client.publisher import Publisher
from d3stream_client.subscriber import AnswerSubscription

from d3stream.core.storage import FetchedMedia, MediaFetcher, S3Location
from d3stream.dev.demo import sample_png
from d3stream.runtime import D3
from d3stream.settings import Ordering, Settings

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker, ObjectStore

QUESTION: dict[str, object] = {
    "type": "choice", "criteria": {"billing": "a payment or a refund", "tech": "the app or the site",
                                   "account": "logging in or the profile"}}
RunName = Literal["fast store, ordering key", "slow store, ordering key", "slow store, ordering partition"]
RUNS: tuple[tuple[RunName, float | None, Ordering], ...] = (
    ("fast store, ordering key", 0.0, "key"), ("slow store, ordering key", None, "key"),
    ("slow store, ordering partition", None, "partition"))


class SlowStore(MediaFetcher):
    """The worker's media fetcher, each object-store read ``delay_s`` slower (on the fetch threads, where a slow
    store's time is spent)."""

    delay_s = 0.0

    def _read(self, location: S3Location, kind: str) -> FetchedMedia:
        time.sleep(self.delay_s)
        return super()._read(location, kind)


CUSTOMERS = 300  # record keys; a text request whose customer has an image request pending waits for it (key order)


class _Request(TypedDict):
    """A request of the stream: a text ticket, or one with an image."""

    id: str
    state: str
    questions: dict[str, dict[str, object]]
    images: NotRequired[list[str]]


def _stream(seconds: float, image_uri: str, seed: int) -> list[tuple[float, str, _Request]]:
    """(send at, key, request): text at 4/s and images at 2/s, keyed by one of ``CUSTOMERS`` customers."""
    rng = random.Random(seed)
    stream = []
    for n in range(int(seconds * 6)):
        at = n / 6
        image = n % 3 == 0
        request: _Request = {"id": f"{'img' if image else 'txt'}-{n}", "state": f"ticket {n}: help",
                                   "questions": {"team": QUESTION}}
        if image:
            request["images"] = [image_uri]
        stream.append((at, f"customer-{rng.randrange(CUSTOMERS)}", request))
    return stream


async def _one_run(settings: Settings, model: D3, fetcher: MediaFetcher, stream: list[tuple[float, str, _Request]],
                   drain_s: float) -> dict[str, list[float]]:
    from d3stream.benchmarks.bench_service import until_joined
    from d3stream.service import Service

    service = Service(settings, model, fetcher=fetcher)
    task = asyncio.create_task(service.run())
    sent: dict[str, float] = {}
    waits: dict[str, list[float]] = {"text": [], "image": []}
    try:
        await until_joined(service, task)
        async with Publisher(settings.connection.bootstrap_servers, settings.delivery.request_topics[0]) as publisher, \
                AnswerSubscription(settings.connection.bootstrap_servers, settings.delivery.answer_topic,
                                   f"{settings.delivery.group_id}-reader") as answers:

            async def read() -> None:
                async for answer in answers:
                    waits["image" if answer.id.startswith("img") else "text"].append(time.time() - sent[answer.id])
                    if len(waits["text"]) + len(waits["image"]) == len(stream):
                        return

            reading = asyncio.create_task(read())
            started = time.monotonic()
            for at, key, request in stream:
                await asyncio.sleep(max(0.0, started + at - time.monotonic()))
                sent[request["id"]] = time.time()
                await publisher.publish_raw([(key.encode(), json.dumps(request).encode())])
            await asyncio.wait_for(reading, drain_s)
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
    return waits


class Figures(TypedDict):
    """Median and 95th percentile of the waits from publish to answer, in ms."""

    p50_ms: float
    p95_ms: float


class RunFigures(TypedDict):
    """One run: the text and the image requests' waits; beside the fast store, text's p95 over its p95 there."""

    text: Figures
    image: Figures
    text_p95_vs_fast_store: NotRequired[float]


class StreamShape(TypedDict):
    """The stream: its length, rates and partitions, and the slow store's delay per image read."""

    seconds: float
    text_per_s: int
    images_per_s: int
    partitions: int
    delay_s: float


# ``d3stream bench head-of-line``: the stream, and each run by its name (``RUNS``).
HeadOfLineReport = TypedDict("HeadOfLineReport", {
    "stream": StreamShape,
    "fast store, ordering key": RunFigures,
    "slow store, ordering key": RunFigures,
    "slow store, ordering partition": RunFigures,
})


def _figures(waits: list[float]) -> Figures:
    cuts = statistics.quantiles(waits, n=100, method="inclusive")
    return {"p50_ms": round(cuts[49] * 1000, 1), "p95_ms": round(cuts[94] * 1000, 1)}


def head_of_line(checkpoint: Path, *, seconds: float = 20.0, delay_s: float = 1.5, seed: int = 0,
                 stack: tuple[KafkaBroker, ObjectStore] | None = None, threads: int | None = 1) -> HeadOfLineReport:
    """The three runs side by side on one broker and store (default: a fresh embedded pair)."""
    if stack is None:
        from d3stream.dev.infra import local_stack

        with local_stack(partitions=3) as fresh:
            return head_of_line(checkpoint, seconds=seconds, delay_s=delay_s, seed=seed, stack=fresh, threads=threads)
    import os

    broker, store = stack
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = store.access_key, store.secret_key
    store.create_bucket("hol")
    store.client().put_object(Bucket="hol", Key="ticket.png", Body=sample_png(64, 48))
    stream = _stream(seconds, "s3://hol/ticket.png", seed)
    model = D3.from_pretrained(checkpoint, device="cpu")
    runs: dict[RunName, RunFigures] = {}
    for name, delay, ordering in RUNS:
        prefix = f"hol-{ordering}-{'fast' if delay == 0.0 else 'slow'}-{time.time_ns()}"
        for topic in ("requests", "answers", "dlq", "prov"):
            broker.create_topic(f"{prefix}.{topic}", 3, exist_ok=True)
        settings = Settings.from_flat(
            bootstrap_servers=broker.bootstrap_servers, request_topics=[f"{prefix}.requests"],
            answer_topic=f"{prefix}.answers", dead_letter_topic=f"{prefix}.dlq", provenance_topic=f"{prefix}.prov",
            group_id=prefix, client_id=prefix, ordering=ordering, metrics_port=None, create_topics=False,
            log_level="warning", torch_threads=threads, s3_endpoint_url=store.endpoint_url, s3_region=store.region,
            media_allowlist=["hol"],
        )
        fetcher = SlowStore.from_settings(settings.storage)
        assert isinstance(fetcher, SlowStore)
        fetcher.delay_s = delay_s if delay is None else delay
        waits = asyncio.run(_one_run(settings, model, fetcher, stream, drain_s=120 + 10 * delay_s))
        runs[name] = {"text": _figures(waits["text"]), "image": _figures(waits["image"])}
    base_p95 = runs[RUNS[0][0]]["text"]["p95_ms"]
    for name, _, _ in RUNS[1:]:
        runs[name]["text_p95_vs_fast_store"] = round(runs[name]["text"]["p95_ms"] / base_p95, 2)
    return {"stream": {"seconds": seconds, "text_per_s": 4, "images_per_s": 2, "partitions": 3, "delay_s": delay_s},
            "fast store, ordering key": runs["fast store, ordering key"],
            "slow store, ordering key": runs["slow store, ordering key"],
            "slow store, ordering partition": runs["slow store, ordering partition"]}


def head_of_line_markdown(report: HeadOfLineReport) -> str:
    stream = report["stream"]
    lines = [f"Text 4/s and images 2/s keyed by one of {CUSTOMERS} customers on {stream['partitions']} partitions, "
             f"{stream['seconds']:g} s; the slow store adds {stream['delay_s']:g} s to every image read.", "",
             "| run | text p50 | text p95 | text p95 ÷ fast store | image p50 | image p95 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, _, _ in RUNS:
        run = report[name]
        ratio = run.get("text_p95_vs_fast_store", 1.0)
        lines.append(f"| {name} | {run['text']['p50_ms']} ms | {run['text']['p95_ms']} ms | {ratio:.2f} | "
                     f"{run['image']['p50_ms']} ms | {run['image']['p95_ms']} ms |")
    return "\n".join(lines)
