"""The prepare stage's worker thread: jobs run in order on one thread, each result (or error) reaches only its
own awaiter, and a burst of jobs is taken in far fewer wake-ups than jobs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from d3stream.core.jobthread import JobThread


def test_jobs_run_in_order_on_one_thread_and_errors_stay_with_their_job():
    async def scenario():
        worker = JobThread("test-jobs")
        seen: list[tuple[int, str]] = []

        def job(n: int):
            seen.append((n, threading.current_thread().name))
            if n == 3:
                raise ValueError("job 3 is bad")
            return n * n

        try:
            results = await asyncio.gather(*(worker.run(lambda n=n: job(n)) for n in range(8)), return_exceptions=True)
        finally:
            worker.shutdown()
        return results, seen

    results, seen = asyncio.run(scenario())
    assert [n for n, _ in seen] == list(range(8))
    assert len({name for _, name in seen}) == 1 and seen[0][1] != threading.main_thread().name
    assert isinstance(results[3], ValueError) and str(results[3]) == "job 3 is bad"
    assert [r for n, r in enumerate(results) if n != 3] == [n * n for n in range(8) if n != 3]


def test_a_burst_is_taken_in_few_wake_ups_and_later_jobs_still_run():
    async def scenario():
        worker = JobThread("test-burst")
        gate = threading.Event()
        wake_ups: list[int] = []
        original = worker._drain

        def counting_drain(loop):
            wake_ups.append(len(worker._queued))
            original(loop)

        worker._drain = counting_drain  # type: ignore[method-assign]
        try:
            first = worker.run(gate.wait)  # holds the thread while the burst queues up behind it
            burst = [worker.run(lambda n=n: n) for n in range(500)]
            gate.set()
            await first
            assert await asyncio.gather(*burst) == list(range(500))
            await asyncio.sleep(0.01)
            assert await worker.run(lambda: "later") == "later"  # the thread is woken again after going idle
        finally:
            worker.shutdown()
        return wake_ups

    wake_ups = asyncio.run(scenario())
    assert len(wake_ups) <= 3, wake_ups


def test_a_cancelled_awaiter_does_not_stop_the_others():
    async def scenario():
        worker = JobThread("test-cancel")
        try:
            slow = worker.run(lambda: time.sleep(0.05) or "slow")
            fast = worker.run(lambda: "fast")
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            return await fast
        finally:
            worker.shutdown()

    assert asyncio.run(scenario()) == "fast"


def test_an_urgent_job_runs_before_a_backlog_and_is_handed_back_at_once():
    """A priority-0 job queued behind a backlog of priority-2 jobs runs next, and its result reaches the event
    loop before the backlog is finished (an interactive request is not prepared after a flood's)."""
    worker = JobThread("test-priority")
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    def slow(name: str) -> str:
        if name == "low0":  # holds the thread until the urgent job is queued (not a guess at how long that takes)
            started.set()
            gate.wait(60)
        time.sleep(0.01)
        ran.append(name)
        return name

    async def scenario() -> int:
        backlog = [worker.run(lambda n=n: slow(f"low{n}"), priority=2) for n in range(30)]
        while not started.is_set():  # the backlog's first job is running
            await asyncio.sleep(0.001)
        urgent = worker.run(lambda: slow("high"), priority=0)
        gate.set()
        await urgent
        settled_first = sum(future.done() for future in backlog)
        await asyncio.gather(*backlog)
        return settled_first

    settled_first = asyncio.run(scenario())
    worker.shutdown()
    assert ran.index("high") <= 2, ran  # after the one or two low jobs already running
    assert settled_first <= 2, settled_first  # handed back without waiting for the rest of the backlog
