"""Each unit's state on local disk, backed by a compacted changelog topic, as Kafka Streams keeps state.

A unit's waiting answers and labels (``join_state.JoinState``) live in a file (``state_store.WaitingStore``,
under ``evaluate_state_dir``), and every change is also written, one record per request id, to the unit's
partition of the changelog (``evaluate_state_topic``), in the same transaction as the unit's evaluations and
input offsets (``kafka/units.py``). The file's batch is committed only after that transaction, with the
changelog offset it reaches. When a worker takes a unit over (``Changelog.restore``):

* a file closed cleanly (a stop, a rebalance) is brought up to date from its changelog offset: only the
  changelog's tail is read, whatever the state's size;
* after a crash, or on a machine without the file, the whole partition is restored from the changelog.

Rebuilding the state from the input topics at start was the alternative; it would re-read up to
``evaluate_window_s`` (days) of answers and labels at every start, where the changelog holds only what still
waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import structlog
from aiokafka.structs import TopicPartition

from d3stream.jobs.evaluate.join_state import JoinState
from d3stream.jobs.evaluate.state_store import WaitingStore
from d3stream.settings import Settings, cache_root

if TYPE_CHECKING:
    from d3stream.kafka.connection import AIOKafkaConsumer

log = structlog.get_logger(__name__)

# Changelog records read per step while a unit's state is brought up to date.
RESTORE_STEP = 10_000


class Restore(TypedDict):
    """How one unit's state was brought up to date: from the changelog's tail after a clean close, or a whole
    restore; what it read, what waits, how long it took."""

    partition: int
    mode: Literal["tail", "restore"]
    records: int
    waiting: int
    answers_waiting: int
    seconds: float


def state_path(settings: Settings, partition: int) -> Path:
    """The file of one unit's state: ``evaluate_state_dir`` (default ``$D3STREAM_CACHE/evaluate``), then the
    cluster (a digest of ``bootstrap_servers``), the group and the changelog topic, so workers of several
    clusters, groups or changelogs can share a volume, and a file is never brought up to date from another
    cluster's changelog of the same name (a local broker started anew, say)."""
    evaluation = settings.evaluation
    root = Path(evaluation.evaluate_state_dir).expanduser() if evaluation.evaluate_state_dir else cache_root() / "evaluate"
    cluster = hashlib.sha256(settings.connection.bootstrap_servers.encode()).hexdigest()[:12]
    return (root / cluster / _file_name(evaluation.evaluate_group_id)
            / f"{_file_name(evaluation.evaluate_state_topic)}-{partition}.sqlite3")


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class Changelog:
    """The changelog topic read back through ``reader`` (a consumer outside any group, read_committed): one
    unit at a time, since the reader is assigned the partition it reads."""

    def __init__(self, settings: Settings, reader: AIOKafkaConsumer, *, tombstone_retention_ms: int) -> None:
        self.settings = settings
        self.topic = settings.evaluation.evaluate_state_topic
        self.reader = reader
        self.tombstone_retention_ms = tombstone_retention_ms
        self.restores: list[Restore] = []  # how each unit's state was brought up to date (tests, logs)
        self._reading = asyncio.Lock()

    async def restore(self, partition: int) -> JoinState:
        """The unit's state from its file and the changelog: the changelog's tail after the file's offset when
        the file was closed cleanly, else the whole changelog into a wiped file."""
        async with self._reading:
            return await self._restore(partition)

    async def _restore(self, partition: int) -> JoinState:
        evaluation = self.settings.evaluation
        started = time.perf_counter()
        tp = TopicPartition(self.topic, partition)
        self.reader.assign([tp])
        log_start = (await self.reader.beginning_offsets([tp]))[tp]
        log_end = (await self.reader.end_offsets([tp]))[tp]
        store = WaitingStore(state_path(self.settings, partition))
        resume = store.resume_from(log_start, log_end, self.tombstone_retention_ms)
        store.opened()  # not clean until closed: a crash from here on means a whole restore next time
        state = JoinState(window_ms=int(evaluation.evaluate_window_s * 1000),
                          max_bytes=evaluation.evaluate_max_state_bytes, store=store)
        if resume is None:
            state.restore_begin()
        records = 0
        async for chunk in self._read(tp, log_start if resume is None else resume, log_end):
            records += state.apply(chunk, counted=resume is not None)
        if resume is None:
            state.restore_end()
        state.commit()
        seconds = time.perf_counter() - started
        how: Restore = {"partition": partition, "mode": "tail" if resume is not None else "restore", "records": records,
                        "waiting": len(state), "answers_waiting": state.answers_waiting, "seconds": round(seconds, 3)}
        self.restores.append(how)
        log.info("evaluating partition", **how, records_per_s=round(records / seconds) if seconds > 0 else None)
        return state

    async def end(self, partition: int) -> int | None:
        """The changelog partition's end (last stable offset); None when it cannot be read."""
        tp = TopicPartition(self.topic, partition)
        async with self._reading:
            try:
                return (await self.reader.end_offsets([tp]))[tp]
            except Exception:  # noqa: BLE001 - without the offset the file is not clean: a whole restore next time
                log.warning("changelog end not read; the partition's state will be restored whole next time",
                            partition=partition, exc_info=True)
                return None

    async def _read(self, tp: TopicPartition, start: int, end: int) -> AsyncIterator[list[tuple[str, bytes | None]]]:
        """The unit's changelog records from ``start`` up to ``end`` (read_committed), oldest first, a step at
        a time: a whole partition is never held in memory."""
        if start >= end:
            return
        self.reader.seek(tp, start)
        while await self.reader.position(tp) < end:
            fetched = await self.reader.getmany(tp, timeout_ms=500, max_records=RESTORE_STEP)
            records = [(r.key.decode(), r.value) for r in fetched.get(tp, []) if r.key is not None and r.offset < end]
            if records:
                yield records
