"""``d3stream bench --evaluate N``: how fast ``d3stream evaluate`` joins, and what its waiting state costs.

Two figures the live evaluator is sized by:

* **Throughput**: N answer events (a choice, a noul and a score each) and N label events for them are
  published to a fresh embedded broker first; one evaluate worker is then started and timed until all N
  evaluations are committed: joined pairs (request and model) per second, through the broker, the
  transactions and the changelog, on this machine.
* **Memory per 100,000 waiting answers**: 100,000 such answers are taken into one ``JoinState`` with no label;
  the figures are the state's own byte count (what ``evaluate_max_state_bytes`` bounds) and the Python heap it
  grew by (``tracemalloc``), so the bound can be set from a memory limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import tracemalloc
from typing import Any

from d3stream_client.contract import Source, decode_answer
from d3stream_client.publisher import produce

from d3stream.config import Settings
from d3stream.core.evaluation import JoinState, answer_entry

TEAMS = ("billing", "tech", "sales")


def answer_event(request_id: str, rng: random.Random) -> dict[str, Any]:
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


def label_event(request_id: str, rng: random.Random) -> dict[str, Any]:
    return {"id": request_id, "labels": {"team": rng.choice(TEAMS), "refund": rng.random() < 0.5,
                                         "urgency": rng.randrange(3)}}


def state_memory(waiting: int = 100_000) -> dict[str, Any]:
    """The state's byte count and the heap growth for ``waiting`` answers with no label."""
    rng = random.Random(0)
    events = [json.dumps(answer_event(f"ticket-{n:08d}", rng)).encode() for n in range(waiting)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    state = JoinState(window_ms=10**12, max_bytes=10**12)
    for n, value in enumerate(events):
        answer = decode_answer(value)
        entry = answer_entry(answer, Source(topic="bench.answers", partition=0, offset=n, timestamp=n), "live")
        assert entry is not None
        state.take_answer(answer.id, entry)
        state.drain_changes()  # what the evaluator does after each batch: the changelog has them
    heap = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"waiting_answers": waiting, "state_bytes": state.bytes, "heap_bytes": heap,
            "state_mb_per_100k": round(state.bytes / waiting * 100_000 / 2**20, 1),
            "heap_mb_per_100k": round(heap / waiting * 100_000 / 2**20, 1)}


async def _throughput(settings: Settings, count: int) -> dict[str, Any]:
    from d3stream.tools.compare import TopicRange, read_topic
    from d3stream.tools.evaluate import make_evaluator

    rng = random.Random(1)
    ids = [f"ticket-{n:08d}" for n in range(count)]
    await produce(settings.bootstrap_servers, settings.answer_topic,
                  [(i.encode(), json.dumps(answer_event(i, rng)).encode()) for i in ids])
    await produce(settings.bootstrap_servers, settings.label_topic,
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
    committed = await read_topic(settings.bootstrap_servers, TopicRange(settings.evaluation_topic), timeout_s=120)
    return {"pairs": count, "evaluations": len(committed), "seconds": round(seconds, 2),
            "pairs_per_s": round(count / seconds, 1), "seconds_after_join": round(steady, 2),
            "pairs_per_s_after_join": round(count / steady, 1), "partitions": settings.topic_partitions}


def evaluate_bench(count: int = 20_000, *, partitions: int = 4) -> dict[str, Any]:
    """Throughput on a fresh embedded broker, and memory per 100,000 waiting answers."""
    from d3stream.tools.infra import KafkaBroker, ensure_jars

    ensure_jars()
    prefix = f"bench-evaluate-{time.time_ns()}"
    with KafkaBroker(partitions=partitions) as broker:
        settings = Settings(
            bootstrap_servers=broker.bootstrap_servers, answer_topic=f"{prefix}.answers",
            label_topic=f"{prefix}.labels", evaluation_topic=f"{prefix}.evaluations",
            label_dead_letter_topic=f"{prefix}.labels-dlq", evaluate_state_topic=f"{prefix}.state",
            evaluate_group_id=prefix, client_id=prefix, transactional_id_prefix=prefix, metrics_port=None,
            topic_partitions=partitions, log_level="warning")
        for topic in (settings.answer_topic, settings.label_topic):
            broker.create_topic(topic, partitions, exist_ok=True)
        throughput = asyncio.run(_throughput(settings, count))
    return {"throughput": throughput, "memory": state_memory()}


def evaluate_markdown(report: dict[str, Any]) -> str:
    throughput, memory = report["throughput"], report["memory"]
    return (f"d3stream evaluate: {throughput['pairs']:,} answers and their labels joined in "
            f"{throughput['seconds']:g} s by one worker ({throughput['partitions']} partitions): "
            f"{throughput['pairs_per_s']:,.0f} joined pairs/s with its start, "
            f"{throughput['pairs_per_s_after_join']:,.0f}/s once it had joined its group "
            f"({throughput['evaluations']:,} evaluations committed). "
            f"{memory['waiting_answers']:,} answers waiting for labels (3 questions each): "
            f"{memory['state_mb_per_100k']:g} MB of state as evaluate_max_state_bytes counts it, "
            f"{memory['heap_mb_per_100k']:g} MB of Python heap.")
