"""One worker thread for the event loop's small blocking jobs, woken once for many of them.

Preparing a question prompt (tokenising, templating), decoding an image or planning a shared prefix takes
tens to hundreds of microseconds: too long to run on the event loop, too short for ``run_in_executor``'s
per-call cost (a concurrent future, its lock and condition, a chained asyncio future, a thread wake-up and
a callback per job), which with thousands of requests in flight cost about a fifth of the event loop.
``JobThread.run`` queues the job instead; the thread takes every job queued since it last looked, runs
them in order and hands all their results back to the loop in one callback.

Jobs run one at a time, in submission order, on one thread, as with a one-worker ``ThreadPoolExecutor``.
A job's exception is raised from its own ``await`` and touches no other job.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


class JobThread:
    """A single worker thread that runs callables for the event loop, many per wake-up."""

    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # A deque, not a list under a lock: appending and popping are atomic, and a lock held by the worker
        # when the interpreter switches threads would stall the event loop for a whole switch interval.
        self._queued: deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._draining = False  # a drain is scheduled or running and will see what is queued now

    def run(self, job: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``job`` (no arguments: bind them with a lambda or ``functools.partial``); await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queued.append((job, future))
        if not self._draining:
            self._draining = True
            # A second drain racing the first is harmless: the one worker runs them one after the other.
            self._executor.submit(self._drain, loop)
        return future

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        queued = self._queued
        while True:
            jobs = []
            while queued:
                jobs.append(queued.popleft())
            if not jobs:
                self._draining = False
                if not queued:
                    return
                self._draining = True  # a job arrived while this drain was finishing: take it too
                continue
            outcomes: list[Outcome] = []
            for job, future in jobs:
                try:
                    outcomes.append((future, job(), None))
                except BaseException as exc:  # noqa: BLE001 - handed to the job's own awaiter
                    outcomes.append((future, None, exc))
            try:
                loop.call_soon_threadsafe(_settle, outcomes)
            except RuntimeError:  # the loop closed while jobs ran: nobody is waiting any more
                return

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
