"""Where compare's answers and labels come from: JSON-lines files and Kafka topic ranges.

A source is a file of answer events (or label events, or ``{"id", "question", "answer"}`` lines) or
``kafka:TOPIC[@START-END]``: every partition of the topic from START to END (exclusive), committed records
only, up to the end offsets at the time of the call (``read_topic``, ``read_range``). Answers are kept by
request id (``AnswerSet``; records without an id are counted, not kept), labels by (request id, question id),
the first label of a question counting, as ``d3stream evaluate`` joins them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import structlog
from d3stream_client.contract import Label

if TYPE_CHECKING:
    from aiokafka import TopicPartition

    from d3stream.kafka.connection import AIOKafkaConsumer
    from d3stream.settings import Settings

log = structlog.get_logger(__name__)


DEFAULT_TOP = 10
DEFAULT_OUT = "compare-report"
KAFKA_PREFIX = "kafka:"


class SourceError(Exception):
    """An answer source that cannot be read (no such topic, broker unreachable, timeout)."""


# -- loading ---------------------------------------------------------------------------------------


class AnswerSet(dict[str, dict[str, object]]):
    """Answer records by request id (the last record of each id), with what loading saw.

    A plain ``dict`` for every purpose, plus ``source`` (where it came from), ``duplicates`` (records
    replaced by a later record of the same id: at-least-once delivery repeats) and ``invalid`` (records
    that are not a JSON object with a non-empty string ``id``; they are left out).
    """

    def __init__(self, source: str = "", duplicates: int = 0, invalid: int = 0) -> None:
        super().__init__()
        self.source = source
        self.duplicates = duplicates
        self.invalid = invalid


def records_to_answers(records: Iterable[object], source: str = "") -> AnswerSet:
    """The answer records by id: a later record of an id replaces an earlier one (and is counted)."""
    answers = AnswerSet(source)
    for record in records:
        if not isinstance(record, dict) or not isinstance(request_id := record.get("id"), str) or not request_id:
            answers.invalid += 1
            continue
        if request_id in answers:
            answers.duplicates += 1
            del answers[request_id]  # keep the insertion order of the kept (last) record
        answers[request_id] = record
    return answers


@dataclass(frozen=True)
class TopicRange:
    """``kafka:TOPIC@START-END``: offsets ``START <= offset < END`` of every partition.

    ``start`` None reads from the beginning of each partition, ``end`` None up to its end offset (the
    last stable offset, as the consumer reads committed records only) at the time of the call.
    """

    topic: str
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        if self.start is None and self.end is None:
            return f"{KAFKA_PREFIX}{self.topic}"
        start = "" if self.start is None else str(self.start)
        end = "" if self.end is None else str(self.end)
        return f"{KAFKA_PREFIX}{self.topic}@{start}-{end}"


_RANGE = re.compile(r"^(\d*)(?:-(\d*))?$")


def parse_source(source: str | Path) -> TopicRange | Path:
    """``kafka:TOPIC[@START[-END]]`` as a :class:`TopicRange`; anything else is a file path (``-`` is stdin)."""
    if isinstance(source, Path) or not source.startswith(KAFKA_PREFIX):
        return Path(source)
    body = source[len(KAFKA_PREFIX):]
    topic, _, offsets = body.partition("@")
    if not topic:
        raise ValueError(f"{source!r}: no topic name after {KAFKA_PREFIX!r}")
    if not offsets:
        return TopicRange(topic)
    match = _RANGE.match(offsets)
    if match is None:
        raise ValueError(f"{source!r}: the offset range is START-END (numbers, END optional), got {offsets!r}")
    start = int(match.group(1)) if match.group(1) else None
    end = int(match.group(2)) if match.group(2) else None
    if start is not None and end is not None and end <= start:
        raise ValueError(f"{source!r}: END ({end}) must be greater than START ({start}); END is exclusive")
    return TopicRange(topic, start, end)


def read_jsonl(path: Path) -> list[object]:
    """The JSON documents of a JSON-lines file (blank lines skipped); ValueError names a bad line."""
    if str(path) == "-":
        lines = sys.stdin.read().splitlines()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
    documents: list[object] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            documents.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
    return documents


def _decode_value(value: bytes | None) -> object:
    if value is None:
        return None
    try:
        return json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


async def _start(consumer: AIOKafkaConsumer, source: TopicRange, bootstrap_servers: str, timeout_s: float,
                 settings: Settings | None) -> None:
    """Start ``consumer``; SourceError names the cluster (and, given the settings, the setting to change)."""
    from aiokafka.errors import KafkaError

    try:
        await asyncio.wait_for(consumer.start(), timeout_s)
    except (KafkaError, TimeoutError, OSError) as exc:
        await consumer.stop()
        hint = ""
        if settings is not None:  # the connection settings: find which of them to change
            from d3stream.kafka.connection import explain_failure

            hint = f" ({await explain_failure(settings.connection, exc)})"
        raise SourceError(f"{source}: cannot reach the Kafka cluster at {bootstrap_servers}{hint}: {exc!r}") from exc


async def _partitions(consumer: AIOKafkaConsumer, source: TopicRange, bootstrap_servers: str, deadline: float,
                      timeout_s: float) -> list[TopicPartition]:
    """Every partition of the source's topic, in order; SourceError when there is no such topic."""
    from aiokafka import TopicPartition

    if source.topic not in await consumer.topics():
        raise SourceError(f"{source}: no topic {source.topic!r} at {bootstrap_servers}")
    # Assigning partition 0 (every topic has one) makes the client track the topic's metadata;
    # ``topics()`` fetched it into a throwaway copy only.
    consumer.assign([TopicPartition(source.topic, 0)])
    while (partitions := consumer.partitions_for_topic(source.topic)) is None:
        if time.monotonic() > deadline:
            raise SourceError(f"{source}: no partition metadata within {timeout_s:g} s")
        await asyncio.sleep(0.05)
    return [TopicPartition(source.topic, partition) for partition in sorted(partitions)]


async def _seek_range(consumer: AIOKafkaConsumer, source: TopicRange,
                      tps: list[TopicPartition]) -> dict[TopicPartition, int]:
    """Each partition with records in the range positioned at its start; the offset to stop at, by partition.
    The partitions without any are paused."""
    consumer.assign(tps)
    beginnings = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    stops: dict[TopicPartition, int] = {}
    for tp in tps:
        start = max(beginnings[tp], source.start or 0)
        stop = ends[tp] if source.end is None else min(ends[tp], source.end)
        if start < stop:
            consumer.seek(tp, start)
            stops[tp] = stop
    consumer.pause(*[tp for tp in tps if tp not in stops])
    return stops


async def _read_to_stops(consumer: AIOKafkaConsumer, source: TopicRange, stops: dict[TopicPartition, int],
                         deadline: float, timeout_s: float) -> list[object]:
    """The decoded values of every partition up to its stop offset (``stops`` is emptied as they get there)."""
    values: list[object] = []
    while stops:
        if time.monotonic() > deadline:
            raise SourceError(f"{source}: not read to its end offsets within {timeout_s:g} s")
        batches = await consumer.getmany(*stops, timeout_ms=500)
        for tp, records in batches.items():
            values.extend(_decode_value(r.value) for r in records if tp in stops and r.offset < stops[tp])
        for tp in list(stops):
            # The position, not the last record: transaction markers and aborted records are skipped.
            if await consumer.position(tp) >= stops[tp]:
                consumer.pause(tp)
                del stops[tp]
    return values


async def read_topic(
    bootstrap_servers: str,
    source: TopicRange,
    *,
    timeout_s: float = 60.0,
    security: Mapping[str, object] | None = None,
    settings: Settings | None = None,
) -> list[object]:
    """The decoded values (None for a value that is not JSON) of a topic range, committed records only.

    A plain consumer without a group reads every partition from ``START`` (or its beginning) to ``END``
    or its end offset at the time of the call, so it terminates on a live topic; records of one
    partition come in offset order (the records of one key share a partition).
    """
    from aiokafka.errors import KafkaError

    from d3stream.kafka.connection import raw_client

    consumer = raw_client("consumer", **{
        "bootstrap_servers": bootstrap_servers,
        "group_id": None,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        **dict(security or {}),
    })
    deadline = time.monotonic() + timeout_s
    await _start(consumer, source, bootstrap_servers, timeout_s, settings)
    try:
        tps = await _partitions(consumer, source, bootstrap_servers, deadline, timeout_s)
        stops = await _seek_range(consumer, source, tps)
        return await _read_to_stops(consumer, source, stops, deadline, timeout_s)
    except KafkaError as exc:
        raise SourceError(f"{source}: {exc!r}") from exc
    finally:
        await consumer.stop()


def default_bootstrap_servers() -> str:
    """``D3STREAM_BOOTSTRAP_SERVERS`` or the local default."""
    return os.environ.get("D3STREAM_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


def load_answers(
    source: str | Path,
    *,
    bootstrap_servers: str | None = None,
    timeout_s: float = 60.0,
    security: Mapping[str, object] | None = None,
    settings: Settings | None = None,
) -> AnswerSet:
    """Answer records by request id from a JSON-lines file or a ``kafka:TOPIC[@START-END]`` range.

    Only ``id`` is required of a record (and ``answers`` or ``error`` to be useful). An id seen more than
    once keeps its last record and counts in ``duplicates``. Call it outside a running event loop.
    """
    parsed = parse_source(source)
    if isinstance(parsed, TopicRange):
        records = read_range(parsed, settings=settings, timeout_s=timeout_s, bootstrap_servers=bootstrap_servers,
                             security=security)
        return records_to_answers(records, str(parsed))
    return records_to_answers(read_jsonl(parsed), str(source))


def read_range(
    source: TopicRange,
    *,
    settings: Settings | None = None,
    timeout_s: float = 60.0,
    bootstrap_servers: str | None = None,
    security: Mapping[str, object] | None = None,
) -> list[object]:
    """``read_topic`` outside an event loop, connected as ``settings`` say (the whole connection: security,
    kafka_options), else to ``bootstrap_servers`` (default: ``default_bootstrap_servers``) with ``security``."""
    if settings is not None:
        from d3stream.kafka.connection import client_options

        options = client_options(settings.connection, "consumer", client_id=settings.connection.client_id)
        bootstrap_servers = options.pop("bootstrap_servers")
        security = options
    servers = bootstrap_servers or default_bootstrap_servers()
    return asyncio.run(read_topic(servers, source, timeout_s=timeout_s, security=security, settings=settings))


Labels = dict[tuple[str, str], object]  # expected answer (a label, JSON) by (request id, question id)


def labels_of(documents: Iterable[object], source: str = "labels") -> Labels:
    """Expected answers by (request id, question id) from label documents of either form:

    * label events (``{"id", "labels": {question id: answer}, ...}``, the label topic's records; see
      ``d3stream_client.contract.Label``);
    * ``{"id", "question", "answer"}`` lines, one question each.

    ``answer`` is the choice key (``choice``), true or false (``noul``) or the level index or text
    (``score``). The first label of a question counts and later ones are ignored, as ``d3stream evaluate``
    joins them. ValueError names a document of neither form.
    """
    labels: Labels = {}
    for number, document in enumerate(documents, 1):
        if isinstance(document, dict) and isinstance(document.get("id"), str) and isinstance(document.get("labels"), dict):
            for question, expected in document["labels"].items():
                labels.setdefault((document["id"], question), expected)
            continue
        if not (
            isinstance(document, dict)
            and isinstance(document.get("id"), str)
            and isinstance(document.get("question"), str)
            and "answer" in document
        ):
            raise ValueError(f"{source}: label {number} is neither a label event {{\"id\": str, \"labels\": {{...}}}} "
                             f"nor {{\"id\": str, \"question\": str, \"answer\": ...}}")
        labels.setdefault((document["id"], document["question"]), document["answer"])
    return labels


def load_labels(source: str | Path, *, settings: Settings | None = None, timeout_s: float = 60.0) -> Labels:
    """Expected answers (``labels_of``) from a JSON-lines file or a ``kafka:TOPIC[@START-END]`` label topic
    range (records that are not JSON are skipped there: the evaluator dead-letters them)."""
    parsed = parse_source(source)
    if isinstance(parsed, TopicRange):
        return labels_of(label_events(read_range(parsed, settings=settings, timeout_s=timeout_s), str(parsed)),
                         str(parsed))
    return labels_of(read_jsonl(parsed), str(source))


def label_events(records: Iterable[object], source: str) -> list[dict[str, object]]:
    """The records of a label topic that are label events, as the evaluator reads them (the label schema);
    the others (no id, no labels, not JSON) are skipped, and how many is logged: the evaluator dead-letters
    them, and one of them must not stop a comparison."""
    events: list[dict[str, object]] = []
    skipped: dict[str, int] = {}
    for record in records:
        try:
            msgspec.convert(record, Label)
        except msgspec.ValidationError as exc:
            reason = str(exc).split(" - at ")[0] if isinstance(record, dict) else "not a JSON object"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        assert isinstance(record, dict)  # converted to a Label: a JSON object
        events.append(record)
    if skipped:
        log.warning("records that are not labels were skipped", source=source, skipped=sum(skipped.values()),
                    reasons=skipped)
    return events


