"""A row scheduler for replays whose passes depend only on where each request was read, never on timing.

``OrderedPasses`` is the other ``passes.RowScheduler`` beside the serving one (``batching.BatchScheduler``): per
partition, the rows of its requests in offset order, ``rows_per_pass`` at a time, the last pass of a partition
taking what is left once the range says the partition is read to its end. So a replay of the same model over
the same requests cuts the same passes, whatever the worker count or the timing, and reproduces its answers
bit for bit (``d3stream replay --deterministic``: jobs/replay.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial

from d3stream.core.batching import PassRecord
from d3stream.core.passes import Outcome, model_thread
from d3stream.core.seams import Position, Scheduling
from d3stream.runtime import Row

# One row's answer: its probabilities and the record of the pass that ran it.
_RowFuture = asyncio.Future[tuple[list[float], PassRecord]]


@dataclass
class _Slot:
    offset: int
    rows: list[Row] | None = None  # None while the request is not prepared yet
    futures: list[_RowFuture] = field(default_factory=list)


PartitionKey = tuple[str, int]


def _settled_with(settled: Callable[[int, list[Outcome]], object], number: int,
                  done: asyncio.Future[list[Outcome]]) -> None:
    settled(number, list(done.result()))


class OrderedPasses:
    """A row scheduler whose passes depend only on the source order: per partition, rows in offset order,
    ``rows_per_pass`` at a time (the last pass of a partition takes what is left)."""

    def __init__(self, run: Callable[[list[Row]], list[list[float]]], rows_per_pass: int,
                 executor: Executor | None = None, on_pass: Callable[[PassRecord], None] | None = None):
        self._run = run
        self.rows_per_pass = rows_per_pass
        self._executor = executor or model_thread()
        self._on_pass = on_pass
        self._queues: dict[PartitionKey, deque[_Slot]] = {}
        self._ready: dict[PartitionKey, list[tuple[tuple[Row, int], _RowFuture]]] = {}
        self._closed: set[PartitionKey] = set()
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[None]] = set()
        self.passes: list[list[tuple[PartitionKey, int]]] = []  # (partition, offset) of each row, per pass

    @property
    def passes_run(self) -> int:
        return len(self.passes)

    def expect(self, positions: Sequence[Position]) -> None:
        for topic, partition, offset in positions:
            self._queues.setdefault((topic, partition), deque()).append(_Slot(offset))

    def finished(self, position: Position) -> None:
        """The request of ``position`` is answered; if it never submitted rows it holds nothing back."""
        topic, partition, offset = position
        for slot in self._queues.get((topic, partition), ()):
            if slot.offset == offset and slot.rows is None:
                slot.rows = []
        self._advance((topic, partition))

    def close_partition(self, topic: str, partition: int) -> None:
        """The partition's range is fully fetched: its last, partial pass may run."""
        key = (topic, partition)
        self._closed.add(key)
        self._advance(key)

    def enqueue_many(self, requests: Sequence[tuple[Sequence[Row], Position, Scheduling]],
                     settled: Callable[[int, list[Outcome]], object]) -> None:
        """Each request's rows placed by ``enqueue``; ``settled`` once a request's rows have all run."""
        for number, (rows, position, _) in enumerate(requests):
            done = self.enqueue(rows, position)
            done.add_done_callback(partial(_settled_with, settled, number))

    def enqueue(self, rows: Sequence[Row], position: Position,
                scheduling: Scheduling | None = None) -> asyncio.Future[list[Outcome]]:
        """Fill the request's place in its partition's order; its passes run once every earlier request of the
        partition is placed (or answered without rows). ``scheduling`` is ignored: passes follow the source
        order only (and replays do not honour deadlines)."""
        topic, partition, offset = position
        slot = next(s for s in self._queues[(topic, partition)] if s.offset == offset)
        loop = asyncio.get_running_loop()
        slot.futures = [loop.create_future() for _ in rows]
        slot.rows = list(rows)
        self._advance((topic, partition))
        return asyncio.gather(*slot.futures, return_exceptions=True)

    def _advance(self, partition: PartitionKey) -> None:
        queue = self._queues.get(partition, deque())
        ready = self._ready.setdefault(partition, [])
        while queue and queue[0].rows is not None:
            slot = queue.popleft()
            ready += [((row, slot.offset), future) for row, future in zip(slot.rows or [], slot.futures, strict=True)]
        while len(ready) >= self.rows_per_pass:
            self._launch(partition, ready[: self.rows_per_pass])
            del ready[: self.rows_per_pass]
        if ready and not queue and partition in self._closed:
            self._launch(partition, list(ready))
            ready.clear()

    def _launch(self, partition: PartitionKey, group: list[tuple[tuple[Row, int], _RowFuture]]) -> None:
        self.passes.append([(partition, offset) for (_, offset), _ in group])
        task = asyncio.get_running_loop().create_task(self._run_pass(group))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_pass(self, group: list[tuple[tuple[Row, int], _RowFuture]]) -> None:
        rows = [row for (row, _), _ in group]
        loop = asyncio.get_running_loop()
        async with self._lock:  # one pass at a time on the model thread
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self._run, rows)
            except Exception as exc:  # noqa: BLE001 - deterministic mode does not re-split: the pass fails whole
                for _, future in group:
                    if not future.done():
                        future.set_exception(exc)
                return
        lengths = [row.length for row in rows]
        record = PassRecord(len(rows), sum(lengths), len(rows) * max(lengths), time.perf_counter() - started)
        if self._on_pass is not None:
            self._on_pass(record)
        for (_, future), result in zip(group, results, strict=True):
            if not future.done():
                future.set_result((result, record))

    async def close(self) -> None:
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
