"""Publishing a record to Kafka, and what to do when that fails.

Publish and commit errors fall in three classes (``classify``), whatever the delivery mode:

* *retriable* (a broker restart, a leader election, a timeout): retried with bounded backoff and counted
  (``d3stream_publish_retries``); a plain publish gives up after ``PUBLISH_BACKOFF_S`` (``WorkerFatal``),
  a partition's transaction is retried with backoff up to ``MAX_TXN_BACKOFF_S`` (commits.py).
* *record-fatal* (the broker or the producer refuses one record as too large): that record is replaced
  by its ``Outgoing.replacement`` (an answer becomes an ``answer_too_large`` error answer under the same
  id, a dead letter loses its raw bytes) and the replacement is published instead.
* *worker-fatal* (no permission, a fenced idempotent producer, a topic that does not exist, a record
  whose replacement is refused too): ``WorkerFatal`` naming the topic and the cause; the worker stops
  without committing past the record and exits non-zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from .events import HEADERS
from .limits import WorkerFatal
from .seams import RecordKind

log = structlog.get_logger(__name__)

PUBLISH_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# exactly_once: the longest wait between retries of a partition's failing transaction.
MAX_TXN_BACKOFF_S = 10.0

ErrorClass = Literal["retriable", "record", "worker"]


def classify(exc: BaseException, *, transactional: bool) -> ErrorClass:
    """Which of the three classes a publish or commit error is in (see the module's docstring)."""
    from aiokafka import errors

    if isinstance(exc, (errors.MessageSizeTooLargeError, errors.RecordTooLargeError,
                        errors.RecordListTooLargeError)):
        return "record"
    if isinstance(exc, (errors.TopicAuthorizationFailedError, errors.GroupAuthorizationFailedError,
                        errors.ClusterAuthorizationFailedError, errors.TransactionalIdAuthorizationFailed,
                        errors.InvalidTopicError, errors.UnsupportedVersionError)):
        return "worker"
    if not transactional and isinstance(exc, errors.ProducerFenced):
        return "worker"  # exactly_once handles fencing per partition (the partition moved)
    return "retriable"


def breaks_the_producer(exc: BaseException) -> bool:
    """Whether an idempotent producer must be replaced before it can send again: a batch the broker refused
    (too large) still took its sequence numbers, so every later batch of that partition is out of order."""
    from aiokafka import errors

    return isinstance(exc, (errors.OutOfOrderSequenceNumber, errors.InvalidProducerEpoch,
                            errors.MessageSizeTooLargeError, errors.RecordListTooLargeError))


def fatal(record: Outgoing | None, exc: BaseException, what: str = "publishing") -> WorkerFatal:
    """The worker-fatal error for ``exc``, naming the topic and the cause."""
    topic = f" to topic {record.topic!r}" if record is not None else ""
    hint = {
        "TopicAuthorizationFailedError": "grant this worker's principal Write (and Describe) on the topic",
        "GroupAuthorizationFailedError": "grant this worker's principal Read on the consumer group (group_id)",
        "TransactionalIdAuthorizationFailed": "grant Write on the transactional ids "
                                              "(transactional_id_prefix), or use delivery=at_least_once",
        "ClusterAuthorizationFailedError": "grant IdempotentWrite on the cluster",
        "MessageSizeTooLargeError": "not even the smallest replacement fits: raise the topic's max.message.bytes",
        "RecordTooLargeError": "not even the smallest replacement fits: raise max_request_size",
    }.get(type(exc).__name__, "see the cause")
    return WorkerFatal(f"{what}{topic} failed and cannot succeed by retrying: {type(exc).__name__}: {exc}; {hint}")


@dataclass
class Outgoing:
    """A record to publish because of one consumed offset (its answer, maybe a dead letter)."""

    topic: str
    key: bytes | None
    value: bytes
    kind: RecordKind = "answer"  # what it is, for a sink that is not a set of topics (a file keeps answers)
    # content-type and d3stream-schema, and the request headers an answer carries back (tracing.py).
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS, repr=False)
    # What to publish instead when this record is refused as too large (the refusal's text as argument);
    # None: nothing smaller exists, and a refusal is worker-fatal.
    replacement: Callable[[str], Outgoing] | None = field(default=None, repr=False, compare=False)


def replaced(record: Outgoing, exc: BaseException) -> Outgoing:
    """The record-fatal path: the smaller record to publish instead of ``record``, or WorkerFatal."""
    if record.replacement is None:
        raise fatal(record, exc) from exc
    log.warning("record refused as too large; publishing its replacement", topic=record.topic,
                error=f"{type(exc).__name__}: {exc}")
    substitute = record.replacement(f"{type(exc).__name__}: {exc}")
    substitute.replacement = None  # a refused replacement is worker-fatal, not replaced again
    return substitute


def retrieved(future: asyncio.Future) -> None:
    """Mark a future's exception as seen (asyncio otherwise logs it as never retrieved, with a traceback)."""
    if not future.cancelled():
        future.exception()


async def quietly_stop(producer: Any) -> None:
    try:
        await producer.stop()
    except Exception as exc:  # noqa: BLE001 - stopping a broken producer must not stop the worker
        log.debug("producer stop failed", error=str(exc))


async def send_with_retries(
    producer: Any, record: Outgoing, metrics: Any = None, enqueue: asyncio.Lock | None = None,
    renew: Callable[[Any, bool], Awaitable[Any]] | None = None,
) -> Outgoing:
    """Publish and wait for the acknowledgement, retrying retriable errors with backoff through broker
    outages (``PUBLISH_BACKOFF_S``, then ``WorkerFatal``). A record refused as too large is replaced by its
    ``replacement``; worker-fatal errors raise ``WorkerFatal`` at once. With ``enqueue``, records enter the
    producer's buffer one caller at a time (acknowledgements are awaited side by side). With ``renew``, a
    producer an error left unusable is replaced (``renew(producer, broken)`` returns the one to use). Returns the
    record that was published."""
    from aiokafka.errors import KafkaError

    retries = 0
    while True:
        try:
            if enqueue is None:
                await producer.send_and_wait(record.topic, value=record.value, key=record.key, headers=record.headers)
            else:
                async with enqueue:
                    acknowledged = await producer.send(record.topic, value=record.value, key=record.key,
                                                       headers=record.headers)
                await acknowledged
            return record
        except KafkaError as exc:
            kind = classify(exc, transactional=False)
            if renew is not None:
                producer = await renew(producer, breaks_the_producer(exc))
            if kind == "record":
                record = replaced(record, exc)
                continue
            if kind == "worker":
                raise fatal(record, exc) from exc
            if retries == len(PUBLISH_BACKOFF_S):
                raise fatal(record, exc, f"publishing (retried {retries} times over "
                                         f"{sum(PUBLISH_BACKOFF_S):.0f} s)") from exc
            pause = PUBLISH_BACKOFF_S[retries]
            retries += 1
            log.warning("publish failed; retrying", topic=record.topic, attempt=retries, error=str(exc))
            if metrics is not None:
                metrics.count_publish_retry(record.topic)
            await asyncio.sleep(pause)
