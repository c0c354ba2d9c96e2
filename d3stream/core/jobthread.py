"""One worker thread for the event loop's small blocking jobs, woken once for many of them.

Preparing a question prompt (tokenising, templating), decoding an image or planning a shared prefix takes
tens to hundreds of microseconds: too long to run on the event loop, too short for ``run_in_executor``'s
per-call cost (a concurrent future, its lock and condition, a chained asyncio future, a thread wake-up and
a callback per job), which with thousands of requests in flight cost about a fifth of the event loop.
``JobThread.run`` queues the job instead; the thread takes every job queued since it last looked, runs
them in order and hands all their results back to the loop in one callback.

Jobs run one at a time on one thread, as with a one-worker ``ThreadPoolExecutor``: by priority (a request's
lane: 0 before 1 before 2), in submission order within one. A job of a higher priority queued while lower ones
wait runs next, and its result is handed back at once, so an interactive request is not prepared after a
flood's backlog. A job's exception is raised from its own ``await`` and touches no other job.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
# A queued job and the future its result goes to. Jobs of every result type share the queues, and no type says
# "the same T for both, some T per entry": the future's result type is left open (what ``run`` types for its caller).
_Job = tuple[Callable[[], object], "asyncio.Future[Any]"]
# A job run: its future, and its result or the exception it raised.
Outcome = tuple["asyncio.Future[Any]", object, BaseException | None]
# Results of a backlog go back to the event loop in batches of this many jobs.
HAND_BACK_EVERY = 32


class JobThread:
    """A single worker thread that runs callables for the event loop, many per wake-up."""

    def __init__(self, name: str, priorities: int = 3, initializer: Callable[[], object] | None = None):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=initializer)
        # Deques, not a heap under a lock: appending and popping are atomic, and a lock held by the worker
        # when the interpreter switches threads would stall the event loop for a whole switch interval.
        self._queued: list[deque[_Job]] = [deque() for _ in range(priorities)]
        self._draining = False  # a drain is scheduled or running and will see what is queued now

    def run(self, job: Callable[[], T], priority: int = 1) -> asyncio.Future[T]:
        """Queue ``job`` (no arguments: bind them with a lambda or ``functools.partial``); await its result.
        ``priority``: 0 runs before 1 before 2 (clamped to the levels there are)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        level = min(max(priority, 0), len(self._queued) - 1)
        self._queued[level].append((job, future))
        if not self._draining:
            self._draining = True
            # A second drain racing the first is harmless: the one worker runs them one after the other.
            self._executor.submit(self._drain, loop)
        return future

    def _next(self) -> tuple[int, _Job] | None:
        for level, queued in enumerate(self._queued):
            if queued:
                try:
                    return level, queued.popleft()
                except IndexError:  # taken meanwhile by a racing drain
                    continue
        return None

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        outcomes: list[Outcome] = []
        while True:
            taken = self._next()
            if taken is None:
                if outcomes and not self._hand_back(loop, outcomes):
                    return
                outcomes = []
                self._draining = False
                if not any(self._queued):
                    return
                self._draining = True  # a job arrived while this drain was finishing: take it too
                continue
            level, (job, future) = taken
            try:
                outcomes.append((future, job(), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the job's own awaiter
                outcomes.append((future, None, exc))
            # Results go back together (one callback for many jobs), except behind an urgent job, which
            # should not wait for the rest of the backlog.
            if level == 0 or len(outcomes) >= HAND_BACK_EVERY:
                if not self._hand_back(loop, outcomes):
                    return
                outcomes = []

    @staticmethod
    def _hand_back(loop: asyncio.AbstractEventLoop, outcomes: list[Outcome]) -> bool:
        try:
            loop.call_soon_threadsafe(_settle, outcomes)
        except RuntimeError:  # the loop closed while jobs ran: nobody is waiting any more
            return False
        return True

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._executor.shutdown(wait=True)


def _settle(outcomes: list[Outcome]) -> None:
    for future, result, error in outcomes:
        if future.cancelled():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
