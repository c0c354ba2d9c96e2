"""The live evaluator's waiting entries on local disk, so memory does not grow with how many are waiting.

One partition's state (``evaluation.JoinState``) keeps, per request id, the encoded record that waits for its
label or its answer, the stream time its id was first seen, and how many answers and label events of it
wait. At production rates that is millions of entries a week, so they live in an embedded database file
rather than in the worker's heap: SQLite, from Python's standard library. Why SQLite and not RocksDB (as
Kafka Streams and Quix Streams use): it is on every Python without a dependency, it writes a batch's changes
and the changelog offset they reach in one atomic transaction (what the restart shortcut below needs), and
it keeps a second index, by first sight, that the window and the byte budget walk oldest first. Its page
cache is bounded (``CACHE_KIB``); the rest stays in the file and the operating system's file cache.

The file is a local copy of the partition's changelog topic, which stays the durable truth:

* a batch's changes are written in one SQLite transaction, committed only after the Kafka transaction that
  carries them to the changelog has committed (``commit``); a Kafka failure rolls them back (``rollback``),
  so the file never holds what the changelog does not;
* a clean close (a stop, a rebalance) records the changelog offset the file accounts for and marks it clean;
  a worker that opens a clean file whose offset is still in the changelog reads only the changelog's tail
  from there (``resume_from``). After a crash (the file not marked clean), or on a new machine, the worker
  wipes the file and restores the whole partition from the changelog.

Entries evicted by the byte budget before their window leave a marker (a few dozen bytes), so a label that
comes later for an evicted answer is counted as such at once instead of waiting a window for nothing.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Ids per query when a batch's entries are read ahead.
PREFETCH_STEP = 500
# SQLite's page cache per partition, in KiB: the hot part of the id index; the rest is read from the file.
CACHE_KIB = 16_384
# What a row costs on disk beyond its id and value: the row header, its entry in the id index and in the
# first-sight index, and page slack (measured: with it, the count is within a few percent of the file's used
# pages at two million entries; docs/MEASUREMENTS.md).
ROW_OVERHEAD_BYTES = 110

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY,
    first_ms INTEGER NOT NULL,
    value BLOB NOT NULL,
    answers INTEGER NOT NULL,
    labels INTEGER NOT NULL,
    marker INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS by_first_sight ON entries (first_ms);
CREATE INDEX IF NOT EXISTS live_by_first_sight ON entries (first_ms) WHERE marker = 0;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class Held:
    """One request id's entry: when it was first seen (stream ms), its encoded record, how many of its answers
    wait for a label and of its label events for an answer, and whether it is only an eviction marker."""

    first_ms: int
    value: bytes
    answers: int = 0
    labels: int = 0
    marker: bool = False

    def size(self, request_id: str) -> int:
        """What the entry counts against the byte budget."""
        return len(request_id) + len(self.value) + ROW_OVERHEAD_BYTES


@dataclass(frozen=True)
class Totals:
    """The sums the evaluator reports without scanning: bytes held, answers and labels waiting, entries."""

    bytes: int = 0
    answers: int = 0
    labels: int = 0
    entries: int = 0


class WaitingStore:
    """One partition's entries in a SQLite file (``path``; None: in memory, for tests and tools).

    Reads see the open batch's own changes; ``commit`` makes them durable with the changelog offset they
    reach, ``rollback`` forgets them."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path) if self.path is not None else ":memory:", isolation_level=None,
                                   check_same_thread=False)
        # The changelog is the durable copy: a power cut may lose the file's last commits, never corrupt it.
        for pragma in ("journal_mode = WAL", "synchronous = NORMAL", f"cache_size = -{CACHE_KIB}",
                       "temp_store = MEMORY"):
            self._db.execute(f"PRAGMA {pragma}")
        self._db.executescript(_SCHEMA)
        self._in_batch = False
        # The batch's writes, by id (None: deleted), applied in one executemany when the store is next queried
        # or committed: a write per statement cost a fifth of the evaluator's time at 10,000 answers a second.
        self._pending: dict[str, Held | None] = {}
        # Entries read ahead for the batch (``prefetch``; None: known to be absent), until the next write-out.
        self._read: dict[str, Held | None] = {}

    # ------------------------------------------------------------------------------------- entries

    def prefetch(self, request_ids: Iterable[str]) -> None:
        """Read the entries of these ids ahead, a few hundred per query (the ids a batch is about to look up:
        one query each cost more than the rest of taking an answer in)."""
        wanted = sorted({i for i in request_ids if i not in self._pending and i not in self._read})
        for start in range(0, len(wanted), PREFETCH_STEP):
            chunk = wanted[start:start + PREFETCH_STEP]
            found = {row[0]: Held(row[1], row[2], row[3], row[4], bool(row[5])) for row in self._db.execute(
                "SELECT id, first_ms, value, answers, labels, marker FROM entries WHERE id IN "
                f"({','.join('?' * len(chunk))})", chunk)}
            for request_id in chunk:
                self._read[request_id] = found.get(request_id)

    def get(self, request_id: str) -> Held | None:
        if request_id in self._pending:
            return self._pending[request_id]
        if request_id in self._read:
            return self._read[request_id]
        row = self._db.execute("SELECT first_ms, value, answers, labels, marker FROM entries WHERE id = ?",
                               (request_id,)).fetchone()
        return None if row is None else Held(row[0], row[1], row[2], row[3], bool(row[4]))

    def put(self, request_id: str, held: Held) -> None:
        self._pending[request_id] = held

    def delete(self, request_id: str) -> None:
        self._pending[request_id] = None

    def flush(self) -> None:
        """Write the batch's buffered changes into its open transaction."""
        self._read.clear()
        if not self._pending:
            return
        self._begin()
        pending, self._pending = self._pending, {}
        self._db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                             [(request_id, held.first_ms, held.value, held.answers, held.labels, int(held.marker))
                              for request_id, held in pending.items() if held is not None])
        self._db.executemany("DELETE FROM entries WHERE id = ?",
                             [(request_id,) for request_id, held in pending.items() if held is None])

    def seen_before(self, horizon_ms: int, limit: int) -> list[tuple[str, Held]]:
        """Up to ``limit`` entries first seen before ``horizon_ms``, oldest first (markers too)."""
        return self._rows("SELECT id, first_ms, value, answers, labels, marker FROM entries WHERE first_ms < ? "
                          "ORDER BY first_ms LIMIT ?", (horizon_ms, limit))

    def oldest_live(self, limit: int) -> list[tuple[str, Held]]:
        """Up to ``limit`` entries that are not markers, oldest first: what the byte budget evicts first."""
        return self._rows("SELECT id, first_ms, value, answers, labels, marker FROM entries WHERE marker = 0 "
                          "ORDER BY first_ms LIMIT ?", (limit,))

    def oldest_markers(self, limit: int) -> list[tuple[str, Held]]:
        """Up to ``limit`` markers, oldest first: evicted only when no entry is left to evict."""
        return self._rows("SELECT id, first_ms, value, answers, labels, marker FROM entries WHERE marker = 1 "
                          "ORDER BY first_ms LIMIT ?", (limit,))

    def oldest_first_ms(self) -> int | None:
        """When the oldest entry (a marker too) was first seen: how far back the state reaches."""
        self.flush()
        row = self._db.execute("SELECT MIN(first_ms) FROM entries").fetchone()
        return None if row is None else row[0]

    def newest_first_ms(self) -> int | None:
        """When the newest entry was first seen: the stream time a restored state starts from."""
        self.flush()
        row = self._db.execute("SELECT MAX(first_ms) FROM entries").fetchone()
        return None if row is None else row[0]

    def _rows(self, sql: str, parameters: tuple[int, ...]) -> list[tuple[str, Held]]:
        self.flush()
        return [(row[0], Held(row[1], row[2], row[3], row[4], bool(row[5])))
                for row in self._db.execute(sql, parameters)]

    def entries(self) -> Iterator[tuple[str, Held]]:
        """Every entry (tests and tools)."""
        self.flush()
        for row in self._db.execute("SELECT id, first_ms, value, answers, labels, marker FROM entries"):
            yield row[0], Held(row[1], row[2], row[3], row[4], bool(row[5]))

    def totals(self) -> Totals:
        """The sums, counted from the entries (on open; the state keeps them up to date after that)."""
        self.flush()
        row = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(id) + LENGTH(value)), 0), COALESCE(SUM(answers), 0), "
            "COALESCE(SUM(labels), 0), COUNT(*) FROM entries").fetchone()
        return Totals(row[0] + row[3] * ROW_OVERHEAD_BYTES, row[1], row[2], row[3])

    def clear(self) -> None:
        """No entry any more (before a restore from the changelog), in the open batch."""
        self._pending.clear()
        self._read.clear()
        self._begin()
        self._db.execute("DELETE FROM entries")
        for name in ("bytes", "answers", "labels", "entries"):
            self._db.execute("DELETE FROM meta WHERE name = ?", (f"total_{name}",))

    # --------------------------------------------------------------------------------- transactions

    def _begin(self) -> None:
        if not self._in_batch:
            self._db.execute("BEGIN")
            self._in_batch = True

    def commit(self, totals: Totals | None = None) -> None:
        """Make the batch's changes durable; ``totals``: the sums after them (read back by ``saved_totals``
        instead of a scan)."""
        self.flush()
        self._begin()
        if totals is not None:
            for name in ("bytes", "answers", "labels", "entries"):
                self._set(f"total_{name}", getattr(totals, name))
        self._db.execute("COMMIT")
        self._in_batch = False

    def saved_totals(self) -> Totals | None:
        """The sums committed with the last batch (None: none were)."""
        values = [self._get(f"total_{name}") for name in ("bytes", "answers", "labels", "entries")]
        if any(value is None for value in values):
            return None
        return Totals(*(int(value or 0) for value in values))

    def rollback(self) -> None:
        """Forget the batch's changes (its Kafka transaction failed)."""
        self._pending.clear()
        self._read.clear()
        if self._in_batch:
            self._db.execute("ROLLBACK")
            self._in_batch = False

    # ---------------------------------------------------------------------------------- checkpoint

    def resume_from(self, log_start: int, log_end: int, retention_ms: int | None) -> int | None:
        """Where to read the changelog from to bring this file up to date: the offset it accounts for, when it
        was closed cleanly, that offset is within the log, and it was closed less than the changelog's
        tombstone retention ago (an older file could miss deletions compacted away since). None: restore the
        whole partition."""
        offset, clean, closed_ms = self._get("changelog_offset"), self._get("clean"), self._get("closed_ms")
        if not clean or offset is None or not log_start <= offset <= log_end:
            return None
        if retention_ms is not None and closed_ms is not None and time.time() * 1000 - closed_ms > retention_ms:
            return None
        return offset

    def opened(self) -> None:
        """Work starts on the file: it is not clean until closed with the changelog offset it accounts for."""
        self._begin()
        self._set("clean", 0)
        self.commit()

    def close(self, changelog_offset: int | None = None) -> None:
        """End the work on the file and close it. With ``changelog_offset`` (a clean stop or a rebalance: every
        change is committed to the changelog, up to that offset) it is marked clean, with when; without (a
        fenced or failed owner), the next owner restores the partition from the whole changelog."""
        self.rollback()
        if changelog_offset is not None:
            self._begin()
            self._set("changelog_offset", changelog_offset)
            self._set("clean", 1)
            self._set("closed_ms", int(time.time() * 1000))
            self.commit()
        self._db.close()

    def _get(self, name: str) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def _set(self, name: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    def disk_bytes(self) -> int:
        """Bytes of the file's pages in use (the budget's count is checked against this in the benchmark)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        size = self._db.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)
