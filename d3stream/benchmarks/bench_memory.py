"""``d3stream bench soak-images N``: a worker's resident memory over N large-image requests, and at idle.

One worker with the default settings (the demo checkpoint, the embedded broker and object store) answers N
requests of six distinct 16-megapixel PNGs each (about 60 KB encoded, 288 MB of pixels once decoded), sent one
at a time as a client waiting for each answer would, then three such requests at once, then nothing for a
while. The resident set size of the worker (this process: the broker and store are processes of their own) is
sampled every 10 ms: its peak while each request is served, and what it holds 3 s after each answer.

What it should show (docs/MEMORY.md): a worker gives back what a request held once it is answered, so the RSS
after each answer stays within ``max_inflight_media_bytes`` of the idle worker however many requests came
before. Issue 36 measured the opposite: +600 MB more after every request, never given back.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.core.seams import DecisionModel
    from d3stream.dev.infra import KafkaBroker, ObjectStore
    from d3stream.service import Service

BUCKET = "bench-memory"
SIDE = 4000  # 16 megapixels, the strict per-image limit
IMAGES_PER_REQUEST = 6
AT_ONCE = 3
SETTLE_S = 3.0  # the RSS "after" an answer is read this long after it
IDLE_S = 10.0


def large_png(number: int, side: int = SIDE) -> bytes:
    """A distinct ``side`` x ``side`` PNG (two gradients that depend on ``number``): tens of kilobytes encoded,
    ``3 * side**2`` bytes decoded, and pixels no other number gives (the feature cache cannot hit)."""
    import numpy as np
    from PIL import Image

    pixels = np.empty((side, side, 3), np.uint8)
    pixels[...] = ((np.arange(side, dtype=np.uint32) * (number % 61 + 1) * 7 // 16) % 256).astype(np.uint8)[None, :, None]
    pixels[:, :, 2] = ((np.arange(side, dtype=np.uint32)[:, None] * (number // 61 + 3) // 16) % 256).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


class RssSampler:
    """This process's RSS every 10 ms on a thread of its own; ``peak()`` since the last ``reset()``."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def now(self) -> int:
        return int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.now())
            time.sleep(0.01)

    def reset(self) -> None:
        self._peak = self.now()

    def peak(self) -> int:
        return max(self._peak, self.now())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _request(rid: str, uris: list[str]) -> tuple[bytes, bytes]:
    import json

    body = {"id": rid, "state": {"ticket": rid}, "images": uris,
            "questions": {"visible": {"type": "noul", "instructions": "Is anything unusual visible?"}}}
    return rid.encode(), json.dumps(body).encode()


class Peaks(TypedDict):
    """RSS over the idle worker while requests were served and a few seconds after their answers, MB."""

    peak_over_idle_mb: float
    after_over_idle_mb: float


class SoakFigures(TypedDict):
    """What ``_soak`` measured: the idle worker, each request alone, ``AT_ONCE`` together, idle again."""

    requests: list[Peaks]
    idle_mb: float
    at_once: Peaks
    idle_after_mb: float
    errors: int


class ImageSoakReport(SoakFigures):
    """``d3stream bench soak-images``: the figures, the requests' shape, and whether RSS kept to the budget."""

    checkpoint: str
    images_per_request: int
    megapixels_per_image: float
    budget_mb: float
    steady_after_over_idle_mb: float
    within_budget: bool


async def _soak(settings: Settings, model: DecisionModel, bootstrap: str, requests: list[list[str]],
                sampler: RssSampler, tick: Callable[[str], None] | None) -> SoakFigures:
    from d3stream_client.publisher import produce

    from d3stream.benchmarks.bench_service import until_joined
    from d3stream.service import Service

    service = Service(settings, model)
    task = asyncio.create_task(service.run())
    topic = settings.delivery.request_topics[0]
    each: list[Peaks] = []
    try:
        await until_joined(service, task)
        await produce(bootstrap, topic, [_request("warm", requests[0][:1])])  # first batch shapes, then idle
        await _answered(service, task, 1)
        await asyncio.sleep(SETTLE_S)
        idle = _mb(sampler.now())
        single = len(requests) - AT_ONCE
        for number, uris in enumerate(requests[:single]):
            if tick is not None:
                tick(f"request {number + 1}/{single}")
            sampler.reset()
            await produce(bootstrap, topic, [_request(f"big-{number}", uris)])
            await _answered(service, task, number + 2)
            peak = sampler.peak()
            await asyncio.sleep(SETTLE_S)
            each.append({"peak_over_idle_mb": round(_mb(peak) - idle, 1),
                         "after_over_idle_mb": round(_mb(sampler.now()) - idle, 1)})
        if tick is not None:
            tick(f"{AT_ONCE} at once")
        sampler.reset()
        await produce(bootstrap, topic, [_request(f"together-{n}", uris)
                                         for n, uris in enumerate(requests[single:])])
        await _answered(service, task, len(requests) + 1)
        peak = sampler.peak()
        await asyncio.sleep(SETTLE_S)
        at_once: Peaks = {"peak_over_idle_mb": round(_mb(peak) - idle, 1),
                          "after_over_idle_mb": round(_mb(sampler.now()) - idle, 1)}
        if tick is not None:
            tick("idle")
        await asyncio.sleep(IDLE_S)
        figures: SoakFigures = {"requests": each, "idle_mb": idle, "at_once": at_once,
                                "idle_after_mb": round(_mb(sampler.now()) - idle, 1),
                                "errors": service.counts["errors"]}
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
    return figures


async def _answered(service: Service, task: asyncio.Task[None], count: int) -> None:
    while service.counts["answered"] + service.counts["errors"] < count:
        if task.done():
            task.result()
            raise RuntimeError("the service stopped before answering every request")
        await asyncio.sleep(0.01)


def _mb(value: int) -> float:
    return value / 2**20


def progress_steps(count: int) -> int:
    """How often ``image_soak`` calls its ``tick``: each request's upload and answer, then three at once and idle."""
    return (count + AT_ONCE) + count + 2


def image_soak(checkpoint: Path, count: int = 20, *, stack: tuple[KafkaBroker, ObjectStore] | None = None,
               tick: Callable[[str], None] | None = None) -> ImageSoakReport:
    """Serve ``count`` large-image requests one at a time, then ``AT_ONCE`` together, on one worker with the
    default settings; the RSS figures (MB over the idle worker)."""
    if stack is None:
        from d3stream.dev.infra import local_stack

        with local_stack(partitions=1) as fresh:
            return image_soak(checkpoint, count, stack=fresh, tick=tick)
    from d3stream.benchmarks.bench_service import worker_settings
    from d3stream.runtime import D3

    broker, store = stack
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = store.access_key, store.secret_key
    model = D3.from_pretrained(checkpoint, device="cpu")
    client = store.client()
    store.create_bucket(BUCKET)
    requests: list[list[str]] = []
    for number in range(count + AT_ONCE):
        if tick is not None:
            tick(f"images for request {number + 1}/{count + AT_ONCE}")
        uris = []
        for image in range(IMAGES_PER_REQUEST):
            key = f"r{number}-{image}.png"
            client.put_object(Bucket=BUCKET, Key=key, Body=large_png(number * IMAGES_PER_REQUEST + image))
            uris.append(f"s3://{BUCKET}/{key}")
        requests.append(uris)
    settings = worker_settings(broker, f"soak-images-{time.time_ns()}", 1, s3_endpoint_url=store.endpoint_url,
                               s3_region=store.region, media_allowlist=[BUCKET])
    with RssSampler() as sampler:
        figures = asyncio.run(_soak(settings, model, broker.bootstrap_servers, requests, sampler, tick))
    budget_mb = _mb(settings.media.max_inflight_media_bytes)
    after = [peaks["after_over_idle_mb"] for peaks in figures["requests"]]
    steady = max(after[len(after) // 2:]) if after else 0.0
    return {
        **figures,
        "checkpoint": str(checkpoint),
        "images_per_request": IMAGES_PER_REQUEST,
        "megapixels_per_image": SIDE * SIDE / 1e6,
        "budget_mb": round(budget_mb, 1),
        "steady_after_over_idle_mb": steady,
        "within_budget": steady <= budget_mb and figures["idle_after_mb"] <= budget_mb,
    }


def image_soak_markdown(report: ImageSoakReport) -> str:
    lines = [
        f"One worker, default settings, requests of {report['images_per_request']} distinct "
        f"{report['megapixels_per_image']:.0f}-megapixel PNGs, one at a time; RSS over the idle worker "
        f"({report['idle_mb']:,.0f} MB):",
        "",
        "| request | peak | 3 s after its answer |",
        "|---:|---:|---:|",
    ]
    for number, each in enumerate(report["requests"], 1):
        lines.append(f"| {number} | {each['peak_over_idle_mb']:+,.0f} MB | {each['after_over_idle_mb']:+,.0f} MB |")
    at_once = report["at_once"]
    lines.append(f"| {AT_ONCE} at once | {at_once['peak_over_idle_mb']:+,.0f} MB | "
                 f"{at_once['after_over_idle_mb']:+,.0f} MB |")
    lines += [
        "",
        f"After {IDLE_S:.0f} idle seconds: {report['idle_after_mb']:+,.0f} MB. Steady state (the second half's "
        f"highest after an answer): {report['steady_after_over_idle_mb']:+,.0f} MB, "
        f"{'within' if report['within_budget'] else 'OVER'} max_inflight_media_bytes "
        f"({report['budget_mb']:,.0f} MB). Requests answered with an error: {report['errors']}.",
    ]
    return "\n".join(lines)
