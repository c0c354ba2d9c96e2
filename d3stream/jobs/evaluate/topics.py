"""The topics ``d3stream evaluate`` reads and writes, made or checked before it starts.

Answers, shadow answers and labels are joined by partition number (``worker.py``), so every input topic and the
changelog must have as many partitions as the answer topic: ``prepare_topics`` creates the missing ones with
that count (``create_topics``) and refuses counts that differ, naming the fix. ``tombstone_retention_ms``
reads how long the changelog keeps a deletion, which bounds how old a cleanly closed state file may be and
still be brought up to date from the changelog's tail (changelog.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from d3stream_client.contract import Role

from d3stream.kafka.connection import kafka_admin
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaAdminClient

# A changelog whose tombstone retention cannot be read is taken to have Kafka's default (a day).
DEFAULT_DELETE_RETENTION_MS = 86_400_000


class EvaluateSetupError(Exception):
    """Topics the evaluator cannot work with (missing, or partition counts that do not match); says the fix."""


@dataclass(frozen=True)
class EvaluateTopics:
    """The topics one evaluator reads and writes."""

    answers: str
    labels: str
    evaluations: str
    state: str
    dead_letters: str
    shadow: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, shadow: str | None) -> EvaluateTopics:
        return cls(settings.delivery.answer_topic, settings.evaluation.label_topic, settings.evaluation.evaluation_topic,
                   settings.evaluation.evaluate_state_topic, settings.evaluation.label_dead_letter_topic, shadow)

    @property
    def inputs(self) -> list[str]:
        return [self.answers, *([self.shadow] if self.shadow else []), self.labels]

    def role(self, topic: str) -> Role | None:
        """live for the answer topic, shadow for the shadow topic, None for the label topic."""
        return "live" if topic == self.answers else "shadow" if topic == self.shadow else None


async def tombstone_retention_ms(settings: Settings, topic: str) -> int:
    """The changelog's ``delete.retention.ms``: how long a deletion stays readable in a compacted topic, so how
    old a cleanly closed state file may be and still be brought up to date from the tail."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import KafkaError

    admin = kafka_admin(settings.connection, client_id=f"{settings.connection.client_id}-evaluate")
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"delete.retention.ms": None})])
    except KafkaError:
        return DEFAULT_DELETE_RETENTION_MS
    finally:
        await admin.close()
    for response in responses:
        for error_code, _message, _kind, _topic, entries in (tuple(r)[:5] for r in response.resources):
            for name, value, *_ in entries if error_code == 0 else ():
                if name == "delete.retention.ms" and value is not None:
                    return int(value)
    return DEFAULT_DELETE_RETENTION_MS


async def prepare_topics(settings: Settings, topics: EvaluateTopics) -> int:
    """The number of partitions every input topic shares; missing topics are created (``create_topics``):
    the inputs and outputs with ``topic_partitions`` (or the answer topic's count), the state topic compacted
    with one partition per unit. EvaluateSetupError when the counts differ or a topic is missing."""
    from aiokafka.admin.new_topic import NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = kafka_admin(settings.connection, client_id=f"{settings.connection.client_id}-evaluate")
    await admin.start()
    try:
        counts = await _partition_counts(admin, [*topics.inputs, topics.state])
        known = [counts[name] for name in (topics.answers, topics.labels) if name in counts]
        partitions = known[0] if known else settings.delivery.topic_partitions
        wanted: dict[str, tuple[int, dict[str, str]]] = {name: (partitions, {}) for name in (*topics.inputs, topics.evaluations, topics.dead_letters)}
        wanted[topics.state] = (partitions, {"cleanup.policy": "compact"})
        missing = [name for name in wanted if name not in counts and name not in (topics.evaluations,
                                                                                  topics.dead_letters)]
        if missing and not settings.delivery.create_topics:
            raise EvaluateSetupError(f"missing topics {missing}: create them with {partitions} partitions (the "
                                     "state topic compacted), or run with --create-topics")
        if settings.delivery.create_topics:
            existing = set(await admin.list_topics())
            for name, (count, config) in wanted.items():
                if name not in existing:
                    try:
                        await admin.create_topics([NewTopic(name, count, 1, topic_configs=config)])
                    except TopicAlreadyExistsError:
                        pass
            # Every topic, outputs too: a reader of the evaluations started next must find the topic there.
            counts = await _created(admin, list(wanted))
        _check_counts(counts, topics)
        return counts[topics.answers]
    finally:
        await admin.close()


async def _created(admin: AIOKafkaAdminClient, names: list[str], within_s: float = 10.0) -> dict[str, int]:
    """The partition counts of topics just created, once the metadata shows them all (or as it stands after
    ``within_s``): described at once, a topic created a moment ago may not be there yet."""
    deadline = time.monotonic() + within_s
    while True:
        counts = await _partition_counts(admin, names)
        if all(name in counts for name in names) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


async def _partition_counts(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    described = await admin.describe_topics(names)
    return {topic["topic"]: len(topic["partitions"]) for topic in described
            if topic.get("error_code", 0) == 0 and topic["partitions"]}


def _check_counts(counts: dict[str, int], topics: EvaluateTopics) -> None:
    answers = counts.get(topics.answers)
    for name in [*topics.inputs, topics.state]:
        if counts.get(name) is None:
            raise EvaluateSetupError(f"topic {name!r} does not exist (create_topics is off)")
        if counts[name] != answers:
            what = "the changelog" if name == topics.state else "labels" if name == topics.labels else "shadow answers"
            raise EvaluateSetupError(
                f"topic {name!r} has {counts[name]} partitions and the answer topic {topics.answers!r} has {answers}: "
                f"{what} are joined with the answers of the same partition (all keyed by request id), so the counts "
                f"must match. Create {name!r} with {answers} partitions (kafka-topics.sh --alter --partitions "
                f"{answers} when it has fewer, and republish its records so each lands on its key's partition), or "
                "name another topic")
