"""What a shadow model costs the live stream: the same requests served without a shadow and with one, in one
run on one embedded broker (bench/README.md, "Shadow cost", says how to read it).

For each configuration (no shadow; a shadow checkpoint of its own answering every request; the same at
shadow_share 0.25) a fresh worker serves, in exactly_once delivery:

* **throughput**: N requests published before it starts; seconds from its assignment until every request is
  answered and committed (as ``d3stream bench kafka`` counts it); live requests per second;
* **latency**: N requests published at a steady rate (a quarter of the no-shadow burst throughput: well
  below saturation, where a worker spends most of its life), each request's latency
  from its send until a read_committed reader sees its live answer; p50 and p99.

    python bench/shadow_cost.py [--requests 300] [--live DIR --shadow DIR] [--json OUT]

Without ``--live`` / ``--shadow`` two tiny random-weight checkpoints (seeds 0 and 1) are built in a temporary
folder; ``--device`` and ``--torch-threads`` pass to the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from d3stream_client.publisher import produce

from d3stream.benchmarks.bench_service import serve_until_answered, small_requests
from d3stream.runtime import D3
from d3stream.service import Service
from d3stream.settings import Settings

CONFIGS: tuple[tuple[str, float | None], ...] = (("no shadow", None), ("shadow, share 1.0", 1.0),
                                                  ("shadow, share 0.25", 0.25))


def _settings(bootstrap: str, prefix: str, share: float | None, shadow_name: str, threads: int | None,
              device: str | None) -> Settings:
    return Settings.from_flat(
        bootstrap_servers=bootstrap, request_topics=[f"{prefix}.requests"], answer_topic=f"{prefix}.answers",
        dead_letter_topic=f"{prefix}.dlq", provenance_topic=f"{prefix}.prov", group_id=prefix, client_id=prefix,
        metrics_port=None, log_level="warning", commit_interval_ms=100, linger_ms=5, torch_threads=threads,
        device=device, shadow=None if share is None else f"{shadow_name}=given", shadow_share=share or 1.0,
    )


async def _latencies(settings: Settings, live: Any, shadow: Any, records: list[tuple[bytes, bytes]],
                     rate: float) -> list[float]:
    """Serve ``records`` sent at ``rate`` per second; each one's seconds from send to its committed answer."""
    from aiokafka import TopicPartition

    from d3stream.kafka.connection import raw_client

    reader = raw_client("consumer", bootstrap_servers=settings.connection.bootstrap_servers,
                        isolation_level="read_committed", enable_auto_commit=False, auto_offset_reset="earliest",
                        group_id=None)
    await reader.start()
    reader.assign([TopicPartition(settings.delivery.answer_topic, p) for p in range(settings.delivery.topic_partitions)])
    service = Service(settings, live, shadow=shadow)
    task = asyncio.create_task(service.run())
    sent: dict[str, float] = {}
    seen: dict[str, float] = {}
    try:
        while not service.joined:
            await asyncio.sleep(0.01)

        async def send() -> None:
            producer = raw_client("producer", bootstrap_servers=settings.connection.bootstrap_servers, linger_ms=0)
            await producer.start()
            try:
                start = time.perf_counter()
                for n, (key, value) in enumerate(records):
                    await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
                    sent[key.decode()] = time.perf_counter()
                    await producer.send(settings.delivery.request_topics[0], value=value, key=key)
                await producer.flush()
            finally:
                await producer.stop()

        sender = asyncio.create_task(send())
        while len(seen) < len(records):
            for batch in (await reader.getmany(timeout_ms=50)).values():
                now = time.perf_counter()
                for item in batch:
                    seen.setdefault(json.loads(item.value)["id"], now)
        await sender
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
        await reader.stop()
    return [seen[rid] - sent[rid] for rid in sent]


def measure(live_dir: Path, shadow_dir: Path, requests: int, threads: int | None, device: str | None) -> dict[str, Any]:
    from d3stream.dev.infra import KafkaBroker, ensure_jars

    live = D3.from_pretrained(live_dir, device=device, model_name="live")
    shadow = D3.from_pretrained(shadow_dir, device=device, model_name="candidate")
    ensure_jars()
    report: dict[str, Any] = {"requests": requests, "delivery": "exactly_once", "configs": {}}
    with KafkaBroker(partitions=4) as broker:
        bootstrap = broker.bootstrap_servers
        rate: float | None = None
        # A warm-up round first (first passes, allocator, broker), so the first configuration pays nothing extra.
        warm = _settings(bootstrap, "shadow-cost-warm", 1.0, "candidate", threads, device)
        asyncio.run(produce(bootstrap, warm.delivery.request_topics[0], small_requests(max(20, requests // 5), seed=99)))
        asyncio.run(serve_until_answered(warm, live, max(20, requests // 5), shadow=shadow))
        for number, (name, share) in enumerate(CONFIGS):
            prefix = f"shadow-cost-{number}"
            settings = _settings(bootstrap, prefix, share, "candidate", threads, device)
            asyncio.run(produce(bootstrap, settings.delivery.request_topics[0], small_requests(requests, seed=number)))
            seconds, _ = asyncio.run(serve_until_answered(settings, live, requests, shadow=shadow if share else None))
            throughput = requests / seconds
            rate = rate or throughput / 4  # every configuration is paced at a quarter of the no-shadow throughput
            paced = _settings(bootstrap, f"{prefix}-paced", share, "candidate", threads, device)
            for topic in (paced.delivery.request_topics[0], paced.delivery.answer_topic):  # the reader starts before the worker
                broker.create_topic(topic, paced.delivery.topic_partitions, exist_ok=True)
            latencies = sorted(asyncio.run(_latencies(paced, live, shadow if share else None,
                                                      small_requests(requests, seed=100 + number), rate)))
            report["configs"][name] = {
                "requests_per_s": round(throughput, 1),
                "paced_rate_per_s": round(rate, 1),
                "p50_ms": round(1000 * statistics.median(latencies), 1),
                "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
            }
            print(name, report["configs"][name], flush=True)
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = ["| live worker | live requests/s (burst) | p50 ms | p99 ms (paced) |", "|---|---:|---:|---:|"]
    for name, figures in report["configs"].items():
        lines.append(f"| {name} | {figures['requests_per_s']} | {figures['p50_ms']} | {figures['p99_ms']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--live", type=Path)
    parser.add_argument("--shadow", type=Path)
    parser.add_argument("--device")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from d3stream.ops.logs import configure_logging

    configure_logging("console", "warning")
    with tempfile.TemporaryDirectory() as folder:
        live_dir, shadow_dir = args.live, args.shadow
        if live_dir is None or shadow_dir is None:
            from d3stream.dev.build_checkpoint import build_checkpoint

            live_dir = live_dir or Path(build_checkpoint(Path(folder) / "live", size="tiny", seed=0, vision=False))
            shadow_dir = shadow_dir or Path(build_checkpoint(Path(folder) / "shadow", size="tiny", seed=1, vision=False))
        report = measure(live_dir, shadow_dir, args.requests, args.torch_threads, args.device)
    print(markdown(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
