"""Replay: run a range of an old request topic through a checkpoint, as a resumable, parallel job.

``d3stream replay`` reads a range of a request topic (by offsets or by timestamps, all or selected
partitions) and answers it with the same media path, batching and delivery as ``serve``; the answers go
to a target topic or a JSON-lines file and carry the replay id in their provenance, so a replayed
answer is never taken for a live one.

* **Resumable**: the replay id names a consumer group (``<group_id>-replay-<replay id>``) whose commits
  record progress. A killed replay started again with the same id continues where it stopped; into a
  topic with ``exactly_once`` delivery nothing is answered twice.
* **Parallel**: several replay workers with the same id split the partitions through that group.
A replay is the serving machinery with another read policy (``RangeRead``: a fixed range, finished at its
end) and, into a file, another sink; nothing of ``serve`` is overridden.

* **Deterministic** (``--deterministic``): passes are cut from each partition's rows in source order,
  ``rows_per_pass`` at a time, never from timing, so a replay of the same model over the same requests
  reproduces itself bit for bit (with either worker count, since passes never span partitions).
* **Drift** (``--compare-with``): the replayed answers are compared with recorded ones (the exact-replay
  check: replaying the live model over its own requests must reproduce its answers within bf16 tolerance).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import NotRequired, TypedDict

import structlog

from d3stream.core.ordered import OrderedPasses
from d3stream.core.passes import model_thread
from d3stream.core.seams import DecisionModel
from d3stream.kafka.connection import connecting, kafka_consumer
from d3stream.kafka.ranges import RangeRead, ReplayRange, resolve_bounds
from d3stream.ops.metrics import Metrics
from d3stream.service import Service
from d3stream.settings import Settings

log = structlog.get_logger(__name__)


# ------------------------------------------------------------------------------------------ the range


def parse_time(text: str | None) -> int | None:
    """ISO 8601 (``2026-11-29T10:00:00Z``) or epoch milliseconds -> epoch milliseconds."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(moment.timestamp() * 1000)


def _replay_settings(settings: Settings, plan: ReplayRange, replay_id: str, out_file: Path | None,
                     deterministic: bool = False) -> Settings:

    changes: dict[str, object] = {
        "request_topics": [plan.topic],
        "group_id": f"{settings.delivery.group_id}-replay-{replay_id}",
        "transactional_id_prefix": f"{settings.delivery.transactional_id_prefix}-replay-{replay_id}",
        "auto_offset_reset": "earliest",
        "honor_deadlines": False,  # a replay reads old requests on purpose: their deadlines have long passed
    }
    if deterministic:  # passes cut in source order only: no second scheduler for shared prefixes
        changes["prefix_reuse"] = "off"
        # Passes wait for every earlier offset: a request held by its tenant's quota could wait on a later one.
        changes["tenant_max_inflight_tokens"] = 0
    if out_file is not None:
        changes["create_topics"] = False  # answers go to the file: no topic of the replay's own to create
    return settings.replaced(**changes)


async def plan_total(settings: Settings, plan: ReplayRange) -> int:
    """How many records the range holds (for the progress bar)."""
    consumer = kafka_consumer(settings.connection, client_id=settings.connection.client_id, group_id=None)
    try:
        await connecting(settings.connection, consumer.start())
        return sum(end - start for start, end in (await resolve_bounds(consumer, plan)).values())
    finally:
        await consumer.stop()


class ReplaySummary(TypedDict):
    """What one replay worker did (``run_replay``); ``d3stream replay`` adds ``drift`` with --compare-with."""

    replay_id: str
    topic: str
    range_records: int
    replayed: int
    answered: int
    errors: int
    dead_letters: int
    passes: int
    seconds: float
    drift: NotRequired[dict[str, object]]


async def run_replay(
    settings: Settings,
    model: DecisionModel,
    plan: ReplayRange,
    *,
    replay_id: str,
    out_file: Path | None = None,
    deterministic: bool = False,
    rows_per_pass: int = 8,
    progress: bool = False,
) -> ReplaySummary:
    """Run (or resume) one replay worker to the end of its range; returns its summary.

    The replay is a ``Service`` with a ``RangeRead`` policy (and ``OrderedPasses`` when deterministic), writing
    to its target topic or, with ``out_file``, to a JSON-lines file."""
    from tqdm import tqdm

    started = time.perf_counter()
    total = await plan_total(settings, plan)
    settings = _replay_settings(settings, plan, replay_id, out_file, deterministic)
    metrics = Metrics()
    # Its own model thread, with the settings' intra-op threads (it is made before the Service applies them).
    ordered = (OrderedPasses(model.forward, rows_per_pass, executor=model_thread(settings.models.torch_threads),
                             on_pass=metrics.observe_pass_record)
               if deterministic else None)
    read = RangeRead(plan, out_file=out_file, on_partition_read=(
        (lambda read: ordered.close_partition(read.topic, read.partition)) if ordered else None))
    service = Service(settings, model, metrics=metrics, read=read, scheduler=ordered, answer_file=out_file,
                      replay_id=replay_id)
    bar = tqdm(total=total, desc=f"replay {replay_id}", unit="req", disable=not progress, dynamic_ncols=True)

    def replayed() -> int:
        return service.counts["answered"] + service.counts["errors"]

    async def show_progress() -> None:
        while True:
            bar.update(replayed() - bar.n)
            await asyncio.sleep(0.2)

    showing = asyncio.create_task(show_progress())
    try:
        await service.run()
    finally:
        showing.cancel()
        bar.update(replayed() - bar.n)
        bar.close()
    return {
        "replay_id": replay_id,
        "topic": plan.topic,
        "range_records": total,
        "replayed": replayed(),
        "answered": service.counts["answered"],
        "errors": service.counts["errors"],
        "dead_letters": service.counts["dead_letters"],
        "passes": service.default.passes.rows.passes_run,
        "seconds": round(time.perf_counter() - started, 2),
    }


# ------------------------------------------------------------------------------------------ the command


def live_topic_refusal(
    to_topic: str | None, answer_topic: str, *, allowed: bool, request_topics: Sequence[str] = ()
) -> str | None:
    """Why a replay may not write to ``to_topic`` (None: it may).

    The live answer topic (``answer_topic``) is what downstream consumers read as the live model's answers;
    replayed answers there (another checkpoint, old requests) would be taken for live ones. A request topic
    (the replayed one, or ``request_topics``) is never a target: workers would read the answers as requests."""
    if to_topic is not None and to_topic in request_topics:
        return (
            f"--to-topic {to_topic!r} is a request topic (--from-topic or the request_topics setting): workers "
            "would read the replayed answers as requests. Name an answer topic of its own, or write to a file "
            "with --out"
        )
    if to_topic is None or to_topic != answer_topic or allowed:
        return None
    return (
        f"--to-topic {to_topic!r} is the live answer topic (the answer_topic setting): replayed answers would "
        "mix with the live ones downstream reads. Name another topic, write to a file with --out, or pass "
        "--allow-live-answer-topic if this is what you mean"
    )


def replay_drift(recorded: str, replayed: str, settings: Settings) -> dict[str, object]:
    """How far the replayed answers are from the recorded ones (joined by request and question id); a
    ``kafka:`` source is read through the same connection settings as the replay."""
    from d3stream.jobs import compare

    report = compare.compare(
        compare.load_answers(recorded, settings=settings),
        compare.load_answers(replayed, settings=settings),
    )
    headline = report.headline()
    return {key: headline.get(key) for key in ("joined", "only_a", "only_b", "agreement", "mean_abs_dp", "max_abs_dp")}
