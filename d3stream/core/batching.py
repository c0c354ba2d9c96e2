"""Cross-event batching: packing question prompts from many requests into forward passes.

A forward pass costs roughly its padded tokens (rows x longest prompt), and a device saturates once a
pass holds a few thousand of them. So the scheduler:

* collects rows (question prompts) from every request being served, for at most ``linger_ms`` after
  the oldest one arrived, or until a full pass is waiting;
* sorts them by length, so rows of similar length share a pass and padding stays small;
* cuts passes of at most ``max_batch_rows`` rows and ``max_batch_tokens`` padded tokens (a single
  prompt longer than the budget runs alone: prompts are never truncated);
* runs the passes one after another on the model's thread and hands each row its probabilities and a
  record of the pass it rode in.

A pass that fails (out of memory, a runtime error) is split in half and each half retried; a row that
fails alone gets the exception, which the service reports for its request. One bad prompt therefore
costs its own request an error, not its neighbours theirs.

Shared traffic (docs/SCHEDULING.md): rows are taken by their *effective lane*, the request's priority lane
(0 is ``high``) less one for every ``lane_ageing_ms`` it has waited, lowest first, so a low lane is never
starved; within a lane the longest first, and the rest of a pass is filled from lower lanes. Everything
waiting is cut into passes at once (one sort per cut: sorting per pass made a queue of thousands of rows cost
quadratic time), and cut again before the next pass whenever a request queued since then is in a higher lane
than that pass, so a request that arrives while a flood is queued still rides the next pass, not the flood's
last; and at least every half ageing step, so ranks stay current. Rows of the same lane queued meanwhile wait
for the passes cut before them. Just before a pass runs,
the rows of a request past its deadline are dropped and settled with ``seams.DeadlineExceeded``: they cost
no device time.

A pass on the device is never interrupted, so how long a high row waits is bounded by the length of passes.
While a ``high`` row was queued within the last ``lane_ageing_ms``, every pass is cut to at most
``lane_pass_tokens`` padded tokens: the pass carrying the high row is short, and so is the one running when
it arrives. Without high traffic passes go back to the full ``max_batch_tokens``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Generic, TypeVar, cast

import structlog
from d3stream_client.contract import BatchRecord

from d3stream.core.seams import DEFAULT_SCHEDULING, DeadlineExceeded, Position, Scheduling

log = structlog.get_logger(__name__)

T = TypeVar("T")  # a row
R = TypeVar("R")  # what ``run`` makes of a row (a full-prompt row: its option probabilities)
V = TypeVar("V")  # whatever a future is settled with (``resolve``)


@dataclass(frozen=True)
class PassRecord:
    """One forward pass, as seen by each row that rode in it."""

    rows: int
    real_tokens: int
    padded_tokens: int
    seconds: float

    # The provenance ``batch`` of a request that rode this pass alone: one per pass, shared by its requests
    # (an answer's records are never changed once built).
    batch: BatchRecord = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", BatchRecord(passes=1, rows=self.rows, real_tokens=self.real_tokens,
                                                      padded_tokens=self.padded_tokens))


# One row's outcome: what ``run`` made of it and the record of the pass it rode in, or the exception of a row
# that failed alone (``DeadlineExceeded``: dropped at its request's deadline).
RowOutcome = tuple[R, PassRecord] | BaseException


class _Unset:
    """The outcome of a row that has not run yet."""


_UNSET = _Unset()


@dataclass(eq=False, slots=True)
class _Submission(Generic[R]):
    """One request's rows (one ``enqueue`` call, or one request of ``enqueue_many``): their outcomes, filled in
    as their passes finish, handed to ``done`` once all are in (a future per row cost more event-loop time than
    the passes' bookkeeping itself; ``enqueue_many`` settles many requests without a future each)."""

    done: Callable[[list[RowOutcome[R]]], object]
    outcomes: list[RowOutcome[R] | _Unset]
    remaining: int
    scheduling: Scheduling = DEFAULT_SCHEDULING
    expired: bool = False  # its deadline passed: its rows still waiting are dropped

    def settle(self, index: int, outcome: RowOutcome[R]) -> None:
        if self.outcomes[index] is not _UNSET:
            return
        self.outcomes[index] = outcome
        self.remaining -= 1
        if self.remaining == 0:
            # Every slot holds its outcome now (each settles once, and none is left unset); handed over as is,
            # not copied, since this runs for every request.
            self.done(cast("list[RowOutcome[R]]", self.outcomes))


def resolve(future: asyncio.Future[list[V]], outcomes: list[V]) -> None:
    """Settle ``future`` with a request's row outcomes (an ``enqueue_many`` callback made into a future)."""
    if not future.done():
        future.set_result(outcomes)


@dataclass(eq=False, slots=True)
class _Waiting(Generic[T, R]):
    row: T
    submission: _Submission[R]
    index: int
    since: float
    length: int

    def settle(self, outcome: RowOutcome[R]) -> None:
        self.submission.settle(self.index, outcome)


def _fill(upcoming: deque[_Waiting[T, R]], budget: int,
          max_rows: int) -> tuple[list[_Waiting[T, R]], list[_Waiting[T, R]]]:
    """One pass of at most ``max_rows`` rows and ``budget`` padded tokens taken from the front of ``upcoming``,
    and the rows skipped for it (in order)."""
    chosen: list[_Waiting[T, R]] = []
    skipped: list[_Waiting[T, R]] = []
    longest = 0
    while upcoming and len(chosen) < max_rows and len(skipped) <= max_rows:
        waiting = upcoming.popleft()
        size = waiting.length
        if chosen and (len(chosen) + 1) * max(longest, size) > budget:
            skipped.append(waiting)
            continue
        chosen.append(waiting)
        longest = max(longest, size)
    return chosen, skipped


class BatchScheduler(Generic[T, R]):
    """Packs rows (``T``) submitted by many requests into forward passes of ``run``, which makes an ``R`` of
    each."""

    def __init__(
        self,
        run: Callable[[list[T]], list[R]],
        *,
        length: Callable[[T], int],
        max_batch_rows: int = 64,
        max_batch_tokens: int = 4096,
        linger_ms: float = 5.0,
        executor: Executor | None = None,
        on_pass: Callable[[PassRecord], None] | None = None,
        lanes: bool = True,
        lane_ageing_ms: float = 2000.0,
        lane_pass_tokens: int = 0,
    ):
        if max_batch_rows < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_rows and max_batch_tokens must be positive")
        self._run = run
        self._on_pass = on_pass
        self._length = length
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.linger = linger_ms / 1000.0
        # Lanes off: every request rides as if it were in the middle lane (ageing still orders by arrival).
        self.lanes = lanes
        self.ageing = max(lane_ageing_ms, 1.0) / 1000.0
        # While high-lane rows were queued recently, passes are cut to this padded-token budget (0: never).
        self.lane_pass_tokens = lane_pass_tokens
        self._high_seen = float("-inf")  # when a high-lane row was last queued
        # One model thread: passes run one at a time, in the order they were cut.
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3stream-model")
        self._waiting: list[_Waiting[T, R]] = []
        self._waiting_tokens = 0
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._released = float("-inf")  # rows that arrived until then linger no more (see _loop)
        # Passes cut at the last cut and not run yet, in order; the lowest lane among rows queued since then.
        self._planned: deque[list[_Waiting[T, R]]] = deque()
        self._planned_at = float("-inf")
        self._best_new_lane: int | None = None
        self.passes_run = 0
        self.rows_run = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.device_seconds = 0.0  # the passes' measured seconds, summed (what answers' cost shares add up to)
        self.rows_expired = 0  # rows dropped because their request's deadline passed
        # Rows queued (waiting or cut, not run) whose request has a deadline: without any, nothing can expire and
        # the checks before each cut and pass are skipped.
        self._dated = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="d3stream-batcher")

    async def close(self) -> None:
        """Finish what was submitted, then stop."""
        self._closing = True
        self._arrived.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._owns_executor:
            self._executor.shutdown(wait=False)

    async def submit(self, rows: Sequence[T], scheduling: Scheduling | None = None) -> list[tuple[R, PassRecord]]:
        """Each row's result and the pass it ran in; raises what ``run`` raised for a row that fails alone
        (``DeadlineExceeded`` when the deadline passed first)."""
        results: list[tuple[R, PassRecord]] = []
        for outcome in await self.enqueue(rows, None, scheduling):
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        return results

    def expect(self, positions: Sequence[Position]) -> None:
        """Passes here are cut by arrival and length, not by where requests were read: nothing to keep."""

    def finished(self, position: Position) -> None:
        """See ``expect``."""

    def enqueue(self, rows: Sequence[T], position: Position | None = None,
                scheduling: Scheduling | None = None) -> asyncio.Future[list[RowOutcome[R]]]:
        """Queue one request's rows; the future gets every row's outcome (its result and pass record, or the
        exception of a row that failed alone) once the last of them is run (``position``, where the request was
        read, matters to source-ordered schedulers only; ``scheduling`` is the request's lane and deadline)."""
        future: asyncio.Future[list[RowOutcome[R]]] = asyncio.get_running_loop().create_future()
        self.enqueue_many([(rows, position, scheduling or DEFAULT_SCHEDULING)],
                          lambda _, outcomes: resolve(future, outcomes))
        return future

    def enqueue_many(self, requests: Sequence[tuple[Sequence[T], Position | None, Scheduling]],
                     settled: Callable[[int, list[RowOutcome[R]]], object]) -> None:
        """Queue the rows of several requests, each ``(rows, position, scheduling)``; ``settled(index, outcomes)``
        is called (on the event loop, as a pass finishes) once every row of request ``index`` is run, with one
        outcome per row as ``enqueue``'s future gets them. No future and no task per request."""
        if self._closing:
            raise RuntimeError("the batch scheduler is closed")
        self.start()
        now = time.perf_counter()
        length, waiting = self._length, self._waiting
        best = self._best_new_lane
        tokens = 0
        for number, (rows, _, scheduling) in enumerate(requests):
            if not rows:
                settled(number, [])
                continue
            outcomes: list[RowOutcome[R] | _Unset] = [_UNSET] * len(rows)
            submission = _Submission(partial(settled, number), outcomes, len(rows), scheduling)
            if scheduling.deadline is not None:
                self._dated += len(rows)
            lane = scheduling.lane
            if best is None or lane < best:
                best = lane
            if lane == 0 and self.lanes:
                self._high_seen = now
            for index, row in enumerate(rows):
                size = length(row)
                waiting.append(_Waiting(row, submission, index, now, size))
                tokens += size
        self._best_new_lane = best
        self._waiting_tokens += tokens
        self._arrived.set()

    def _full(self) -> bool:
        budget = self.pass_budget(time.perf_counter())
        return len(self._waiting) >= self.max_batch_rows or self._waiting_tokens >= budget

    def pass_budget(self, now: float) -> int:
        """Padded tokens a pass cut now may hold: ``lane_pass_tokens`` while a high-lane row was queued within
        the last ``lane_ageing_ms`` (short passes, so a high row waits for little), else ``max_batch_tokens``."""
        if self.lane_pass_tokens > 0 and now - self._high_seen < self.ageing:
            return min(self.lane_pass_tokens, self.max_batch_tokens)
        return self.max_batch_tokens

    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._planned:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if not self._planned:
                await self._linger()
            await self._next_pass()

    async def _next_pass(self) -> None:
        """Cut passes if due, and run the next one. A function of its own so that nothing of the pass outlives
        it: the loop waits, idle, for the next row, and a pass's rows lead to their requests' media."""
        now = time.perf_counter()
        if self._recut_due(now):
            self._released = now
            self._cut(now, time.time())
        if not self._planned:  # every waiting row had expired
            return
        group = self._planned.popleft()
        if self._dated:
            group = self._unexpired(group, time.time())
            self._dated -= sum(1 for waiting in group if waiting.submission.scheduling.deadline is not None)
        if not group:
            return
        try:
            await self._run_pass(group)
        except Exception as exc:  # noqa: BLE001 - the batcher must outlive any one pass
            log.exception("pass could not be completed")
            for waiting in group:
                waiting.settle(exc)

    async def _linger(self) -> None:
        """Wait up to ``linger_ms`` after the oldest new row for company, unless a pass is full already. Rows
        that were waiting when the last passes were cut have lingered already: they do not linger again."""
        oldest = self._waiting[0].since
        deadline = oldest + self.linger
        while not self._full() and not self._closing and oldest > self._released:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=remaining)
            except TimeoutError:
                break

    def _rank(self, waiting: _Waiting[T, R], now: float) -> int:
        """The row's effective lane: its request's lane, one higher for every ``lane_ageing_ms`` waited."""
        lane = waiting.submission.scheduling.lane if self.lanes else 1
        return lane - math.floor((now - waiting.since) / self.ageing)

    def _recut_due(self, now: float) -> bool:
        """Passes are cut again before the next one when a row queued since beats it (a higher lane), when half
        an ageing step has passed (ranks moved), or when none are left."""
        if not self._planned:
            return True
        if now - self._planned_at >= self.ageing / 2:
            return True
        new = self._best_new_lane
        return self.lanes and new is not None and new < self._rank(self._planned[0][0], now)

    def _cut(self, now: float, wall: float) -> None:
        """Cut passes from every row not run yet: by effective lane, the longest first within one, while they
        fit ``max_batch_rows`` and ``max_batch_tokens`` (a single prompt over the budget runs alone). A row too
        long to join a pass is skipped, up to ``max_batch_rows`` of them per pass (a later, shorter row may
        still fit), and leads the next pass."""
        for group in self._planned:
            self._waiting += group
        self._planned.clear()
        self._best_new_lane = None
        self._planned_at = now
        if self._dated:
            self._drop_expired(wall)
        ageing, floor = self.ageing, math.floor
        if self.lanes:
            def rank(w: _Waiting[T, R]) -> tuple[int, int, float]:
                return w.submission.scheduling.lane - floor((now - w.since) / ageing), -w.length, w.since
        else:
            def rank(w: _Waiting[T, R]) -> tuple[int, int, float]:
                return 1 - floor((now - w.since) / ageing), -w.length, w.since
        # A stable sort: rows equal in all three stay in the order they were queued.
        upcoming = deque(sorted(self._waiting, key=rank))
        budget = self.pass_budget(now)
        while upcoming:
            group, skipped = _fill(upcoming, budget, self.max_batch_rows)
            self._planned.append(group)
            upcoming.extendleft(reversed(skipped))
        self._waiting = []
        self._waiting_tokens = 0

    def _drop_expired(self, wall: float) -> None:
        """Settle the rows of requests past their deadline with ``DeadlineExceeded`` and forget them."""
        kept = self._unexpired(self._waiting, wall)
        self._waiting_tokens -= sum(w.length for w in self._waiting) - sum(w.length for w in kept)
        self._waiting = kept

    def _unexpired(self, rows: list[_Waiting[T, R]], wall: float) -> list[_Waiting[T, R]]:
        """``rows`` without those of requests past their deadline, which are settled ``DeadlineExceeded``."""
        kept: list[_Waiting[T, R]] = []
        for waiting in rows:
            submission = waiting.submission
            deadline = submission.scheduling.deadline
            if submission.expired or (deadline is not None and wall > deadline):
                if not submission.expired:
                    submission.expired = True
                    late = DeadlineExceeded(wall - (deadline or wall))
                    for index, outcome in enumerate(submission.outcomes):
                        if outcome is _UNSET:
                            submission.settle(index, late)
                self.rows_expired += 1
                self._dated -= 1
                continue
            kept.append(waiting)
        return kept

    async def _run_pass(self, group: list[_Waiting[T, R]]) -> None:
        loop = asyncio.get_running_loop()
        rows = [w.row for w in group]
        started = time.perf_counter()
        try:
            results = await loop.run_in_executor(self._executor, self._run, rows)
        except Exception as exc:  # noqa: BLE001 - any pass failure is contained to its rows
            if len(group) == 1:
                log.warning("row failed alone", error=f"{type(exc).__name__}: {exc}")
                group[0].settle(exc)
                return
            log.warning("pass failed; retrying each half", rows=len(group), error=f"{type(exc).__name__}: {exc}")
            _release_memory()
            middle = len(group) // 2
            await self._run_pass(group[:middle])
            await self._run_pass(group[middle:])
            return
        seconds = time.perf_counter() - started
        if len(results) != len(group):  # a broken run function: its rows fail, the scheduler goes on
            failure = RuntimeError(f"the model returned {len(results)} results for a pass of {len(group)} rows")
            for waiting in group:
                waiting.settle(failure)
            return
        lengths = [waiting.length for waiting in group]
        record = PassRecord(len(rows), sum(lengths), len(rows) * max(lengths), seconds)
        self.passes_run += 1
        self.rows_run += record.rows
        self.real_tokens += record.real_tokens
        self.padded_tokens += record.padded_tokens
        self.device_seconds += seconds
        if self._on_pass is not None:
            try:
                self._on_pass(record)
            except Exception:  # noqa: BLE001 - a metrics hook must not stop the model
                log.exception("pass hook failed")
        for waiting, result in zip(group, results, strict=True):
            waiting.submission.settle(waiting.index, (result, record))


def _release_memory() -> None:
    """After a failed pass (out of memory, say): the device's cached blocks go back before the halves run."""
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
