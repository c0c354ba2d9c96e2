"""``d3stream bench ask N``: how long a caller of the client's ``ask`` waits, beside what the worker reports.

On an embedded broker, a worker (``Service``, in this process) serves the tiny checkpoint while a
``D3Client`` asks N small requests at a steady rate, each ask awaited concurrently as a caller would.
Two figures per delivery mode, from the same requests:

* **ask**: from the call to ``ask`` to the typed answer in hand: checks, publish and acknowledgement, the
  worker's read, batching and pass, the answer's publication and (``exactly_once``) its transaction's
  commit, and the read of the one answer partition;
* **worker**: the end-to-end time the worker puts in every answer (``provenance.timings.total``, read to
  answered), which is what ``serve``'s own ``end_to_end`` stage reports.

The difference is what the Kafka round trip and the delivery mode add for a caller who waits.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream_client import D3Client

from d3stream.runtime import D3
from d3stream.settings import DeliveryName, Settings

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker

QUESTION = {"type": "choice", "criteria": {"billing": "a payment or a refund", "tech": "the app or the site",
                                           "account": "logging in or the profile"}}
MODES: tuple[DeliveryName, ...] = ("exactly_once", "at_least_once")


class AskFigures(TypedDict):
    """One delivery mode: ``asks`` at ``rate``/s, ask()'s latency beside the worker's own end-to-end, in ms."""

    asks: int
    rate: float
    commit_interval_ms: int
    ask_p50_ms: float
    ask_p99_ms: float
    worker_p50_ms: float
    worker_p99_ms: float


async def _asks(settings: Settings, model: D3, count: int, rate: float, prefix: str) -> AskFigures:
    from d3stream.benchmarks.bench_service import until_joined
    from d3stream.service import Service

    service = Service(settings, model)
    task = asyncio.create_task(service.run())
    try:
        await until_joined(service, task)
        async with D3Client(settings.connection.bootstrap_servers, request_topic=settings.delivery.request_topics[0],
                            answer_topic=settings.delivery.answer_topic, worker_group=settings.delivery.group_id) as client:
            await client.ask({"id": f"{prefix}-warm", "state": "warm up", "questions": {"team": QUESTION}},
                             timeout=120)
            waits: list[float] = []
            totals: list[float] = []

            async def one(n: int) -> None:
                started = time.perf_counter()
                answer = await client.ask({"id": f"{prefix}-{n}", "state": f"ticket {n}: I was charged twice",
                                           "questions": {"team": QUESTION}}, timeout=120)
                waits.append(time.perf_counter() - started)
                totals.append(answer.provenance.timings.total / 1000)

            asks = []
            for n in range(count):
                asks.append(asyncio.create_task(one(n)))
                await asyncio.sleep(1 / rate)
            await asyncio.gather(*asks)
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
    return {"asks": count, "rate": rate, "commit_interval_ms": settings.delivery.commit_interval_ms,
            "ask_p50_ms": _ms(waits, 50), "ask_p99_ms": _ms(waits, 99),
            "worker_p50_ms": _ms(totals, 50), "worker_p99_ms": _ms(totals, 99)}


def _ms(seconds: list[float], percent: int) -> float:
    """The ``percent``-th percentile of ``seconds``, in milliseconds."""
    return round(statistics.quantiles(seconds, n=100, method="inclusive")[percent - 1] * 1000, 1)


def ask_latency(checkpoint: Path, count: int = 300, *, rate: float = 20.0, broker: KafkaBroker | None = None,
                threads: int | None = 1) -> dict[str, AskFigures]:
    """Both delivery modes, one after the other on one broker (default: a fresh embedded one); figures by mode."""
    if broker is None:
        from d3stream.dev.infra import KafkaBroker, ensure_jars

        ensure_jars()
        with KafkaBroker(partitions=4) as fresh:
            return ask_latency(checkpoint, count, rate=rate, broker=fresh, threads=threads)
    model = D3.from_pretrained(checkpoint, device="cpu")
    from d3stream.benchmarks.bench_service import worker_settings

    report: dict[str, AskFigures] = {}
    for mode in MODES:
        prefix = f"ask-{mode.replace('_', '-')}-{time.time_ns()}"
        settings = worker_settings(broker, prefix, 4, delivery=mode, torch_threads=threads)
        report[mode] = asyncio.run(_asks(settings, model, count, rate, prefix))
    return report


def ask_markdown(report: dict[str, AskFigures]) -> str:
    """The figures as the table of docs/CLIENT.md."""
    lines = ["| delivery | asks | rate | ask() p50 | ask() p99 | worker end-to-end p50 | p99 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, figures in report.items():
        lines.append(f"| `{mode}` (commit every {figures['commit_interval_ms']} ms) | {figures['asks']} | "
                     f"{figures['rate']:g}/s | {figures['ask_p50_ms']} ms | {figures['ask_p99_ms']} ms | "
                     f"{figures['worker_p50_ms']} ms | {figures['worker_p99_ms']} ms |")
    return "\n".join(lines)
