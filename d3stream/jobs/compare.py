"""``d3stream compare A B``: how far apart two sets of answers are, and (with labels) which one is right.

A and B are answer events -- two model versions, a replay against the live topic, a GPU run against a
CPU run -- read from JSON-lines files or from Kafka topic ranges (``kafka:TOPIC`` or
``kafka:TOPIC@START-END``). They are joined by request id and question id and compared on:

* agreement of the decisions: the choice key for ``choice``, ``p >= 0.5`` for ``noul``, the most
  probable level (argmax) for ``score``;
* ``|Δp|``, the absolute difference of the probability of each option, its mean and maximum;
* the score MAE ``|score_a - score_b|`` and the confidence shift ``mean(conf_b - conf_a)``;

overall, per question type and per question id, with the requests that disagree most side by side.
With labels (label events, or ``{"id", "question", "answer"}`` lines) each side also gets accuracy, Brier score, log loss and
expected calibration error (ECE).

The figures come from pure functions over parsed records -- :func:`load_answers` (records by request
id), :func:`compare` (a :class:`Report`) and :func:`write_report` (``report.md`` and PNG plots) -- and
:func:`register` adds the sub-command to the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from d3stream_client.contract import Label

from d3stream.core.agreement import (
    ECE_BINS,
    GroupStats,
    JoinedQuestion,
    LabelStats,
    Slot,
    group_stats,
    join_slots,
    label_key,
    label_stats,
    parse_slot,
)
from d3stream.runtime.kinds import QUESTION_TYPE_NAMES

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from matplotlib.figure import Figure

    from d3stream.config import Settings

log = structlog.get_logger(__name__)

DEFAULT_TOP = 10
DEFAULT_OUT = "compare-report"
KAFKA_PREFIX = "kafka:"


class SourceError(Exception):
    """An answer source that cannot be read (no such topic, broker unreachable, timeout)."""


# -- loading ---------------------------------------------------------------------------------------


class AnswerSet(dict[str, dict[str, Any]]):
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

            hint = f" ({await explain_failure(settings, exc)})"
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
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import KafkaError

    consumer = AIOKafkaConsumer(**{
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

        options = client_options(settings, "consumer", client_id=settings.client_id)
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


def label_events(records: Iterable[object], source: str) -> list[dict[str, Any]]:
    """The records of a label topic that are label events, as the evaluator reads them (the label schema);
    the others (no id, no labels, not JSON) are skipped, and how many is logged: the evaluator dead-letters
    them, and one of them must not stop a comparison."""
    events: list[dict[str, Any]] = []
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


# -- one answered question -------------------------------------------------------------------------


# -- the comparison --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabelReport:
    """Both sides against the labels, over the joined questions that have a usable label."""

    n: int
    a: LabelStats
    b: LabelStats
    by_type: dict[str, tuple[LabelStats, LabelStats]]
    unmatched: int  # labels of no joined question
    invalid: int  # labels of a joined question that name no option of it


@dataclass(frozen=True)
class SideSummary:
    """What one side holds."""

    source: str
    requests: int
    duplicates: int
    invalid_records: int
    request_errors: int
    request_error_codes: dict[str, int]
    questions: int
    question_errors: int
    question_error_codes: dict[str, int]


@dataclass(frozen=True)
class Disagreement:
    """A request's joined questions, largest ``|Δp|`` first."""

    request_id: str
    max_abs_dp: float
    questions: tuple[JoinedQuestion, ...]


@dataclass(frozen=True)
class Report:
    """Everything :func:`compare` finds; :meth:`headline` is the ``--json`` object."""

    a: SideSummary
    b: SideSummary
    only_a: tuple[str, ...]  # request ids only in A
    only_b: tuple[str, ...]
    only_a_questions: int  # questions of requests on both sides, answered (or errored) only in A
    only_b_questions: int
    skipped_questions: int  # on both sides, or on one side of a request the other refused: not compared for errors
    unreadable_questions: int  # on both sides, but an unknown type, no probabilities, or different types
    overall: GroupStats
    by_type: dict[str, GroupStats]
    by_question: dict[str, GroupStats]
    top: tuple[Disagreement, ...]
    labels: LabelReport | None
    joined: tuple[JoinedQuestion, ...] = field(default=(), repr=False)

    def headline(self) -> dict[str, Any]:
        """The headline figures as one JSON-ready object."""
        out: dict[str, Any] = {
            "joined": self.overall.joined,
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "agreement": self.overall.agreement,
            "mean_abs_dp": self.overall.mean_abs_dp,
            "max_abs_dp": self.overall.max_abs_dp,
            "score_mae": self.overall.score_mae,
            "confidence_shift": self.overall.confidence_shift,
            "only_a_questions": self.only_a_questions,
            "only_b_questions": self.only_b_questions,
            "skipped_questions": self.skipped_questions,
            "duplicates_a": self.a.duplicates,
            "duplicates_b": self.b.duplicates,
            "errors_a": self.a.request_errors,
            "errors_b": self.b.request_errors,
            "question_errors_a": self.a.question_errors,
            "question_errors_b": self.b.question_errors,
        }
        if self.labels is not None:
            out.update(
                labelled=self.labels.n,
                accuracy_a=self.labels.a.accuracy,
                accuracy_b=self.labels.b.accuracy,
                brier_a=self.labels.a.brier,
                brier_b=self.labels.b.brier,
                ece_a=self.labels.a.ece,
                ece_b=self.labels.b.ece,
                log_loss_a=self.labels.a.log_loss,
                log_loss_b=self.labels.b.log_loss,
            )
        return out


def _error_code(value: object) -> str:
    if isinstance(value, dict):
        value = value.get("code")
    return value if isinstance(value, str) and value else "unknown"


def _answers_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``answers`` of a record, or None for a request-level error (or a record without answers)."""
    answers = record.get("answers")
    if record.get("error") is not None or not isinstance(answers, dict):
        return None
    return answers


def summarise(answers: Mapping[str, Mapping[str, Any]], source: str = "") -> SideSummary:
    """Request and question counts, and errors by code, of one side."""
    request_codes: Counter[str] = Counter()
    question_codes: Counter[str] = Counter()
    questions = 0
    for record in answers.values():
        slots = _answers_of(record)
        if slots is None:
            request_codes[_error_code(record.get("error"))] += 1
            continue
        questions += len(slots)
        for slot in slots.values():
            if isinstance(slot, dict) and "error" in slot:
                question_codes[_error_code(slot.get("error"))] += 1
    return SideSummary(
        source=getattr(answers, "source", source) or source,
        requests=len(answers),
        duplicates=getattr(answers, "duplicates", 0),
        invalid_records=getattr(answers, "invalid", 0),
        request_errors=sum(request_codes.values()),
        request_error_codes=dict(sorted(request_codes.items())),
        questions=questions,
        question_errors=sum(question_codes.values()),
        question_error_codes=dict(sorted(question_codes.items())),
    )


def _label_report(joined: Sequence[JoinedQuestion], labels: Labels) -> LabelReport:
    by_key = {(q.request_id, q.question_id): q for q in joined}
    pairs: dict[str, list[tuple[JoinedQuestion, str]]] = defaultdict(list)
    invalid = unmatched = 0
    for key, expected in labels.items():
        question = by_key.get(key)
        if question is None:
            unmatched += 1
            continue
        option_a, option_b = label_key(question.a, expected), label_key(question.b, expected)
        if option_a is None or option_b is None:
            invalid += 1
            continue
        pairs[question.type].append((question, option_a))
    everything = [pair for kind in QUESTION_TYPE_NAMES for pair in pairs.get(kind, [])]
    return LabelReport(
        n=len(everything),
        a=label_stats([(q.a, key) for q, key in everything]),
        b=label_stats([(q.b, key) for q, key in everything]),
        by_type={
            kind: (label_stats([(q.a, k) for q, k in pairs[kind]]), label_stats([(q.b, k) for q, k in pairs[kind]]))
            for kind in QUESTION_TYPE_NAMES if pairs.get(kind)
        },
        unmatched=unmatched,
        invalid=invalid,
    )


@dataclass
class _Joined:
    """The questions of two answer sets joined by request and question id, and the ones left out."""

    questions: list[JoinedQuestion] = field(default_factory=list)
    only_a: int = 0  # questions of requests on both sides, answered (or errored) only in A
    only_b: int = 0
    skipped: int = 0  # an error on either side
    unreadable: int = 0  # an unknown type, no probabilities, or different types

    def request(self, request_id: str, answers_a: dict[str, Any], answers_b: dict[str, Any]) -> None:
        """Join the questions of one request both sides answered."""
        self.only_a += len(answers_a.keys() - answers_b.keys())
        self.only_b += len(answers_b.keys() - answers_a.keys())
        for question_id in sorted(answers_a.keys() & answers_b.keys()):
            raw_a, raw_b = answers_a[question_id], answers_b[question_id]
            if any(isinstance(raw, dict) and "error" in raw for raw in (raw_a, raw_b)):
                self.skipped += 1
                continue
            slot_a, slot_b = parse_slot(raw_a), parse_slot(raw_b)
            if slot_a is None or slot_b is None or slot_a.type != slot_b.type:
                self.unreadable += 1
                continue
            self.questions.append(join_slots(request_id, question_id, slot_a, slot_b))


def _join(a: Mapping[str, Mapping[str, Any]], b: Mapping[str, Mapping[str, Any]]) -> _Joined:
    joined = _Joined()
    for request_id in sorted(set(a) & set(b)):
        answers_a, answers_b = _answers_of(a[request_id]), _answers_of(b[request_id])
        if answers_a is None or answers_b is None:
            joined.skipped += len(answers_a or answers_b or ())
            continue
        joined.request(request_id, answers_a, answers_b)
    return joined


def _disagreements(joined: Sequence[JoinedQuestion]) -> list[Disagreement]:
    """Every request with joined questions, largest ``|Δp|`` first (then by id)."""
    by_request: dict[str, list[JoinedQuestion]] = defaultdict(list)
    for question in joined:
        by_request[question.request_id].append(question)
    return sorted(
        (
            Disagreement(rid, max(q.max_abs_dp for q in qs),
                         tuple(sorted(qs, key=lambda q: (-q.max_abs_dp, q.question_id))))
            for rid, qs in by_request.items()
        ),
        key=lambda d: (-d.max_abs_dp, d.request_id),
    )


def compare(
    a: Mapping[str, Mapping[str, Any]],
    b: Mapping[str, Mapping[str, Any]],
    labels: Labels | None = None,
    *,
    top: int = DEFAULT_TOP,
) -> Report:
    """Join two answer sets (request id -> answer record) by request and question id and compare them.

    A question is joined when both sides answered it without error, with the same type. Questions of a
    request that one side refused (request-level ``error``) or answered with an error slot are counted
    in ``skipped_questions``; requests only on one side in ``only_a`` / ``only_b``.
    """
    joined = _join(a, b)
    questions = joined.questions
    by_type_lists: dict[str, list[JoinedQuestion]] = defaultdict(list)
    by_question_lists: dict[str, list[JoinedQuestion]] = defaultdict(list)
    for question in questions:
        by_type_lists[question.type].append(question)
        by_question_lists[question.question_id].append(question)
    return Report(
        a=summarise(a),
        b=summarise(b),
        only_a=tuple(sorted(set(a) - set(b))),
        only_b=tuple(sorted(set(b) - set(a))),
        only_a_questions=joined.only_a,
        only_b_questions=joined.only_b,
        skipped_questions=joined.skipped,
        unreadable_questions=joined.unreadable,
        overall=group_stats(questions),
        by_type={kind: group_stats(by_type_lists[kind]) for kind in QUESTION_TYPE_NAMES if kind in by_type_lists},
        by_question={qid: group_stats(qs) for qid, qs in sorted(by_question_lists.items())},
        top=tuple(_disagreements(questions)[:top]),
        labels=None if labels is None else _label_report(questions, labels),
        joined=tuple(questions),
    )


# -- output ----------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.4f}"


def _md(text: object) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in rows]
    return lines


def _stats_row(name: str, stats: GroupStats) -> list[str]:
    return [name, str(stats.joined), _pct(stats.agreement), _fmt(stats.mean_abs_dp), _fmt(stats.max_abs_dp),
            _fmt(stats.score_mae), _signed(stats.confidence_shift)]


_STATS_HEADER = ["", "joined", "agreement", "mean abs Δp", "max abs Δp", "score MAE", "confidence shift (B − A)"]


def _probabilities_text(slot: Slot) -> str:
    return ", ".join(f"{k} {p:.3f}" for k, p in slot.probabilities.items())


def _decision_text(slot: Slot) -> str:
    text = f"{slot.decision} ({slot.decision_probability:.3f})"
    if slot.type == "score" and slot.score is not None:
        text += f", score {slot.score:.3f}"
    return text


def _codes(codes: Mapping[str, int]) -> str:
    return ", ".join(f"{code} {count}" for code, count in codes.items()) or "–"


def _headline_section(report: Report) -> list[str]:
    headline = report.headline()
    return ["## Headline", "", *_table(["figure", "value"], [
        ["joined questions", headline["joined"]],
        ["agreement (choice, noul, score decisions)", _pct(headline["agreement"])],
        ["mean abs Δp (per option)", _fmt(headline["mean_abs_dp"])],
        ["max abs Δp", _fmt(headline["max_abs_dp"])],
        ["score MAE", _fmt(headline["score_mae"])],
        ["confidence shift (B − A)", _signed(headline["confidence_shift"])],
        ["requests only in A / only in B", f"{len(report.only_a)} / {len(report.only_b)}"],
        ["questions only in A / only in B", f"{report.only_a_questions} / {report.only_b_questions}"],
        ["questions not compared: errors / unreadable or type differs",
         f"{report.skipped_questions} / {report.unreadable_questions}"],
    ])]


def _sides_section(report: Report) -> list[str]:
    a, b = report.a, report.b
    lines = ["", "## Sides", ""]
    lines += _table(["", "A", "B"], [
        ["requests", a.requests, b.requests],
        ["duplicate records (last kept)", a.duplicates, b.duplicates],
        ["invalid records (no id)", a.invalid_records, b.invalid_records],
        ["request-level errors", a.request_errors, b.request_errors],
        ["request errors by code", _codes(a.request_error_codes), _codes(b.request_error_codes)],
        ["questions", a.questions, b.questions],
        ["question errors", a.question_errors, b.question_errors],
        ["question errors by code", _codes(a.question_error_codes), _codes(b.question_error_codes)],
    ])
    if report.only_a or report.only_b:
        lines += [""]
        for side, ids in (("A", report.only_a), ("B", report.only_b)):
            if ids:
                shown = ", ".join(f"`{_md(i)}`" for i in ids[:20]) + (" ..." if len(ids) > 20 else "")
                lines.append(f"Only in {side} ({len(ids)}): {shown}  ")
    return lines


def _groups_section(report: Report, plots: Sequence[str]) -> list[str]:
    """Per question type and per question id, with their plots."""
    lines: list[str] = []
    for plot in plots:
        if plot == "abs_dp_histogram.png":
            lines += ["", f"![abs Δp histogram]({plot})"]
    lines += ["", "## Per question type", ""]
    lines += _table(["type"] + _STATS_HEADER[1:],
                    [_stats_row(kind, stats) for kind, stats in report.by_type.items()] + [
                        _stats_row("all", report.overall)])
    lines += ["", "## Per question id", ""]
    lines += _table(["question", "type"] + _STATS_HEADER[1:],
                    [[qid, stats.types] + _stats_row(qid, stats)[1:] for qid, stats in report.by_question.items()])
    if "agreement_by_question.png" in plots:
        lines += ["", "![agreement by question](agreement_by_question.png)"]
    return lines


def _disagreements_section(report: Report) -> list[str]:
    lines = ["", f"## Largest disagreements (top {len(report.top)} requests by max abs Δp)", ""]
    if not report.top:
        lines.append("No joined questions.")
    for item in report.top:
        lines += [f"### `{_md(item.request_id)}`: max abs Δp {item.max_abs_dp:.4f}", ""]
        lines += _table(
            ["question", "type", "A decision", "B decision", "agree", "max abs Δp", "A probabilities",
             "B probabilities"],
            [[q.question_id, q.type, _decision_text(q.a), _decision_text(q.b), "yes" if q.agree else "**no**",
              f"{q.max_abs_dp:.4f}", _probabilities_text(q.a), _probabilities_text(q.b)] for q in item.questions],
        )
        lines.append("")
    return lines


def _labels_section(labels: LabelReport, plots: Sequence[str]) -> list[str]:
    lines = ["## Against the labels", "",
             f"{labels.n} labelled joined questions ({labels.unmatched} labels match no joined question, "
             f"{labels.invalid} name no option of their question).", ""]
    rows: list[list[object]] = [[
        "all", labels.n, _fmt(labels.a.accuracy), _fmt(labels.b.accuracy), _fmt(labels.a.brier),
        _fmt(labels.b.brier), _fmt(labels.a.ece), _fmt(labels.b.ece), _fmt(labels.a.log_loss),
        _fmt(labels.b.log_loss)]]
    rows += [[kind, sa.n, _fmt(sa.accuracy), _fmt(sb.accuracy), _fmt(sa.brier), _fmt(sb.brier), _fmt(sa.ece),
              _fmt(sb.ece), _fmt(sa.log_loss), _fmt(sb.log_loss)] for kind, (sa, sb) in labels.by_type.items()]
    lines += _table(["type", "n", "accuracy A", "accuracy B", "Brier A", "Brier B", "ECE A", "ECE B", "log loss A",
                     "log loss B"], rows)
    lines += ["", "Brier score: the sum over the options of (p − onehot)², averaged over questions (0 best, 2 "
              "worst); for noul the two-class sum over false and true, i.e. twice the binary Brier score. "
              f"ECE: {ECE_BINS} equal-width bins on the probability of the decided option (the max "
              "probability), sum of bin weight × abs(accuracy − mean confidence). Log loss: −ln p(label), "
              "p clipped at 1e-15.", ""]
    if "reliability.png" in plots:
        lines += ["![reliability diagram](reliability.png)", ""]
    return lines


def render_markdown(report: Report, plots: Sequence[str] = ()) -> str:
    """``report.md``: headline, per type, per question id, the top disagreements side by side, labels."""
    lines = ["# d3stream compare", "", f"- **A**: `{report.a.source}`", f"- **B**: `{report.b.source}`", ""]
    lines += _headline_section(report)
    lines += _sides_section(report)
    lines += _groups_section(report, plots)
    lines += _disagreements_section(report)
    if report.labels is not None:
        lines += _labels_section(report.labels, plots)
    return "\n".join(lines).rstrip() + "\n"


# One colour per question type in registry order (a new type fails here until it has one), one per side.
_TYPE_COLORS = dict(zip(QUESTION_TYPE_NAMES, ("#4C72B0", "#DD8452", "#55A868"), strict=True))
_SIDE_COLORS = {"A": "#4C72B0", "B": "#C44E52"}


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_abs_dp_histogram(report: Report, path: Path) -> Path:
    """Histogram of ``|Δp|`` per option, stacked by question type, with the mean and max marked."""
    figure = _figure(8, 4.8)
    axes = figure.add_subplot()
    groups = {kind: [d for q in report.joined if q.type == kind for d in q.deltas.values()] for kind in QUESTION_TYPE_NAMES}
    groups = {kind: values for kind, values in groups.items() if values}
    overall = report.overall
    if groups:
        top = max(overall.max_abs_dp or 0.0, 0.01) * 1.02
        edges = [top * i / 30 for i in range(31)]
        axes.hist(list(groups.values()), bins=edges, stacked=True, color=[_TYPE_COLORS[k] for k in groups],
                  label=[f"{k} ({len(v)} options)" for k, v in groups.items()], edgecolor="white", linewidth=0.5)
        axes.axvline(overall.mean_abs_dp or 0.0, color="black", linestyle="--", linewidth=1,
                     label=f"mean {overall.mean_abs_dp:.4f}")
        axes.axvline(overall.max_abs_dp or 0.0, color="black", linestyle=":", linewidth=1,
                     label=f"max {overall.max_abs_dp:.4f}")
        axes.set_xlim(0, top)
        axes.legend(title="question type", frameon=False)
    else:
        axes.text(0.5, 0.5, "no joined questions", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(f"How far apart A and B are: |Δp| per option over {overall.joined} joined questions "
                   f"(agreement {_pct(overall.agreement)})", fontsize=10)
    axes.set_xlabel("|p_A − p_B| of an option")
    axes.set_ylabel("options")
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path)
    return path


def plot_agreement_by_question(report: Report, path: Path, limit: int = 30) -> Path:
    """Decision agreement per question id (the least agreeing ``limit``), with the mean ``|Δp|`` written on."""
    items = sorted(report.by_question.items(), key=lambda kv: ((kv[1].agreement or 0.0), kv[0]))[:limit]
    figure = _figure(8, max(2.5, 0.35 * len(items) + 1.5))
    axes = figure.add_subplot()
    names = [f"{qid} ({stats.types})" for qid, stats in items]
    values = [100 * (stats.agreement or 0.0) for _, stats in items]
    colors = [_TYPE_COLORS.get(stats.types, "#8172B3") for _, stats in items]
    bars = axes.barh(names, values, color=colors)
    for bar, (_, stats) in zip(bars, items, strict=True):
        axes.text(min(bar.get_width(), 100) + 1, bar.get_y() + bar.get_height() / 2,
                  f"{stats.joined} q, mean |Δp| {_fmt(stats.mean_abs_dp, 3)}", va="center", fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 135)
    axes.set_xticks([0, 20, 40, 60, 80, 100])
    axes.set_xlabel("decisions that agree (%)")
    axes.set_title("Agreement of A and B per question id (least agreeing first)", fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(path)
    return path


def plot_reliability(report: Report, path: Path) -> Path:
    """Reliability diagram of both sides: accuracy against confidence per bin, and the bin counts."""
    labels = report.labels
    assert labels is not None
    figure = _figure(7, 7.5)
    grid = figure.add_gridspec(2, 1, height_ratios=(3, 1))
    top = figure.add_subplot(grid[0])
    bottom = figure.add_subplot(grid[1], sharex=top)
    top.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly calibrated")
    width = 1 / ECE_BINS
    for offset, (side, stats, source) in zip(
        (-width / 5, width / 5), (("A", labels.a, report.a.source), ("B", labels.b, report.b.source)), strict=True
    ):
        filled = [(b.mean_confidence, b.accuracy) for b in stats.bins  # the bins with questions
                  if b.mean_confidence is not None and b.accuracy is not None]
        top.plot([confidence for confidence, _ in filled], [accuracy for _, accuracy in filled], marker="o",
                 color=_SIDE_COLORS[side], label=f"{side}: {source} (ECE {_fmt(stats.ece, 3)}, accuracy "
                 f"{_pct(stats.accuracy)})")
        bottom.bar([(b.lower + b.upper) / 2 + offset for b in stats.bins], [b.count for b in stats.bins],
                   width=width * 0.4, color=_SIDE_COLORS[side], label=side)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.02)
    top.set_ylabel("accuracy in the bin")
    top.set_title(f"Reliability diagram: {labels.n} labelled questions, {ECE_BINS} bins", fontsize=10)
    top.legend(loc="upper left", fontsize=8, frameon=False)
    top.grid(alpha=0.3)
    bottom.set_xlabel("confidence: probability of the decided option (max probability)")
    bottom.set_ylabel("questions")
    bottom.legend(fontsize=8, frameon=False)
    bottom.grid(axis="y", alpha=0.3)
    figure.savefig(path)
    return path


def write_report(report: Report, out: str | Path) -> list[Path]:
    """Write ``report.md`` and the PNG plots into ``out`` (created); return the paths written."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    plots = [plot_abs_dp_histogram(report, folder / "abs_dp_histogram.png")]
    if report.by_question:
        plots.append(plot_agreement_by_question(report, folder / "agreement_by_question.png"))
    if report.labels is not None:
        plots.append(plot_reliability(report, folder / "reliability.png"))
    markdown = folder / "report.md"
    markdown.write_text(render_markdown(report, [p.name for p in plots]), encoding="utf-8")
    return [markdown, *plots]


def render_text(report: Report) -> str:
    """The terminal summary: sides, per-type table, labels."""
    a, b = report.a, report.b
    lines = []
    for side, summary in (("A", a), ("B", b)):
        lines.append(f"{side}: {summary.source}: {summary.requests} requests, {summary.duplicates} duplicates, "
                     f"{summary.request_errors} request errors, {summary.question_errors} question errors")
    lines.append(f"requests only in A {len(report.only_a)}, only in B {len(report.only_b)}; questions only in A "
                 f"{report.only_a_questions}, only in B {report.only_b_questions}, not compared "
                 f"{report.skipped_questions + report.unreadable_questions}")
    lines.append("")
    header = f"{'type':<10}{'joined':>8}{'agreement':>11}{'mean|Δp|':>10}{'max|Δp|':>10}{'scoreMAE':>10}" \
             f"{'conf B−A':>10}"
    lines.append(header)
    for name, stats in [*report.by_type.items(), ("all", report.overall)]:
        lines.append(f"{name:<10}{stats.joined:>8}{_pct(stats.agreement):>11}{_fmt(stats.mean_abs_dp):>10}"
                     f"{_fmt(stats.max_abs_dp):>10}{_fmt(stats.score_mae):>10}{_signed(stats.confidence_shift):>10}")
    if report.top:
        lines.append("")
        lines.append("largest disagreements: " + ", ".join(
            f"{d.request_id} ({d.max_abs_dp:.3f})" for d in report.top[:5]))
    if report.labels is not None:
        labels = report.labels
        lines += ["", f"{'labels (n=' + str(labels.n) + ')':<16}{'A':>10}{'B':>10}"]
        for name, va, vb in (("accuracy", labels.a.accuracy, labels.b.accuracy),
                             ("Brier", labels.a.brier, labels.b.brier), ("ECE", labels.a.ece, labels.b.ece),
                             ("log loss", labels.a.log_loss, labels.b.log_loss)):
            lines.append(f"{name:<16}{_fmt(va):>10}{_fmt(vb):>10}")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    from d3stream.config import load_settings
    from d3stream.kafka.connection import check_connection

    try:
        settings = load_settings(args)
        check_connection(settings)
        side_a = load_answers(args.a, settings=settings, timeout_s=args.timeout)
        side_b = load_answers(args.b, settings=settings, timeout_s=args.timeout)
        labels = load_labels(args.labels, settings=settings, timeout_s=args.timeout) if args.labels else None
    except (OSError, ValueError, SourceError) as exc:
        print(f"d3stream compare: {exc}", file=sys.stderr)
        return 2
    report = compare(side_a, side_b, labels, top=args.top)
    written = write_report(report, args.out)
    for side in (side_a, side_b):
        if side.invalid:
            print(f"d3stream compare: {side.source}: {side.invalid} records without an id were left out",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(report.headline()))
    else:
        print(render_text(report))
        print(f"\nreport: {written[0]}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``compare`` sub-command to the CLI's sub-command table."""
    parser = commands.add_parser(
        "compare",
        help="compare two sets of answers (files or Kafka topic ranges), optionally against labels",
        description="Join two sets of answer events by request and question id and report agreement, |Δp|, "
        "score MAE and confidence shift; with --labels also accuracy, Brier score, ECE and log loss of each side "
        "(the figures d3stream evaluate keeps live, from the same implementation). "
        "A source is a JSON-lines file of answer events or kafka:TOPIC[@START-END] (offsets "
        "START <= offset < END of every partition, committed records only, up to the end offsets at the "
        "time of the call).",
    )
    parser.add_argument("a", metavar="A", help="answers: JSON-lines file or kafka:TOPIC[@START-END]")
    parser.add_argument("b", metavar="B", help="answers to compare with A, same forms")
    parser.add_argument("--labels", metavar="L",
                        help='labels: label events {"id", "labels": {question: answer}} (a JSON-lines file or '
                        'kafka:TOPIC[@START-END]), or JSON lines {"id", "question", "answer"}; the first label '
                        'of a question counts')
    parser.add_argument("--out", default=DEFAULT_OUT, help="report folder (report.md and PNG plots)")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON object")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="requests listed as largest disagreements")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to read one Kafka topic range")
    from d3stream.config import CONNECTION_FIELDS, add_arguments

    add_arguments(parser, only=CONNECTION_FIELDS)  # for kafka: sources
    parser.set_defaults(run=_run)
