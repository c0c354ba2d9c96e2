"""Answer and label events as the worker and a labeller publish them, and the broker helpers the evaluator's tests
share (their settings, keyed records, reading a topic back): the unit tests of the join, the in-process tests on
the broker and the worker-process tests use the same events."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from typing import Any

from d3stream.jobs import compare
from d3stream.settings import load_settings

TEAMS = ("billing", "tech", "sales")
LEVELS = ("low", "medium", "high")


def normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def answer_event(request_id: str, rng: random.Random, model: str = "m1", offset: int = 0) -> dict[str, Any]:
    """An answer event as the worker publishes it: a choice, a noul and a score with drawn probabilities."""
    team = dict(zip(TEAMS, normalised([rng.random() + 0.05 for _ in TEAMS]), strict=True))
    levels = normalised([rng.random() + 0.05 for _ in LEVELS])
    refund = rng.random()
    return {
        "id": request_id, "answer_id": f"{request_id}-{model}", "model": model,
        "source": {"topic": "d3.requests", "partition": 0, "offset": offset},
        "answers": {
            "team": {"type": "choice", "choice": max(team, key=team.__getitem__), "probabilities": team,
                     "confidence": max(team.values())},
            "refund": {"type": "noul", "noul": refund, "probabilities": {"false": 1 - refund, "true": refund}},
            "urgency": {"type": "score", "score": sum(i * p for i, p in enumerate(levels)),
                        "probabilities": {str(i): p for i, p in enumerate(levels)}, "confidence": max(levels),
                        "legend": {str(i): text for i, text in enumerate(LEVELS)}},
        },
    }


def label_event(request_id: str, rng: random.Random, questions: tuple[str, ...] = ("team", "refund", "urgency")
                ) -> dict[str, Any]:
    """A label event; urgency named by its level index or its level text."""
    values: dict[str, Any] = {"team": rng.choice(TEAMS), "refund": rng.random() < 0.5,
                              "urgency": rng.choice([0, 1, 2, *LEVELS])}
    return {"id": request_id, "labels": {q: values[q] for q in questions}, "source": "agent"}


def evaluate_settings(broker: Any, topic_names: Any, **overrides: Any) -> Any:
    """A test's own topics, group and state directory (its files outlive the test's workers, as a volume does)."""
    return load_settings({
        "evaluate_state_dir": tempfile.mkdtemp(prefix="d3-evaluate-state-"),
        "bootstrap_servers": broker.bootstrap_servers,
        "answer_topic": topic_names("answers"), "label_topic": topic_names("labels"),
        "evaluation_topic": topic_names("evaluations"), "label_dead_letter_topic": topic_names("label-dlq"),
        "evaluate_state_topic": topic_names("state"), "evaluate_group_id": topic_names("group"),
        "transactional_id_prefix": topic_names("txn"), "topic_partitions": 3, "metrics_port": None,
        **{k: str(v) for k, v in overrides.items()},
    }, environ={})


def keyed(events: list[dict[str, Any]]) -> list[tuple[bytes | None, bytes]]:
    """Each event as a record keyed by its request id, as the worker and the labeller publish them."""
    return [(e["id"].encode(), json.dumps(e).encode()) for e in events]


async def read_events(servers: str, topic: str) -> list[dict[str, Any]]:
    """Every JSON object on a topic (read committed)."""
    records = await compare.read_topic(servers, compare.TopicRange(topic), timeout_s=60)
    return [r for r in records if isinstance(r, dict)]


async def events_until(servers: str, topic: str, count: int, timeout_s: float = 90.0) -> list[dict[str, Any]]:
    """The topic's events once there are ``count`` of them, or what there is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await read_events(servers, topic)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)
