"""The pipeline's steps read side by side (d3stream.core.streams): every step's answers are handed on, even when
another step fails, so no answered request is left undelivered (its offset would never commit)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from d3stream.core.streams import Streams


async def step(name: str, count: int, pause: float) -> AsyncIterator[str]:
    for number in range(count):
        await asyncio.sleep(pause)
        yield f"{name}{number}"


async def failing(after: int) -> AsyncIterator[str]:
    for number in range(after):
        await asyncio.sleep(0)
        yield f"bad{number}"
    raise RuntimeError("the step failed")




def test_every_steps_items_are_handed_on_as_they_come():
    async def go() -> list[str]:
        streams: Streams[str] = Streams()
        streams.add(step("slow", 2, 0.02))
        streams.add(step("fast", 3, 0.001))
        return [item async for item in streams]

    got = asyncio.run(go())
    assert sorted(got) == ["fast0", "fast1", "fast2", "slow0", "slow1"]
    assert got.index("fast2") < got.index("slow1"), "a fast step does not wait for a slow one"


def test_a_failing_step_loses_no_item_of_the_others_and_is_raised_at_the_end():
    async def go() -> tuple[list[str], BaseException | None]:
        streams: Streams[str] = Streams()
        streams.add(failing(after=1))
        streams.add(step("live", 3, 0.01))  # still running when the other one fails
        got: list[str] = []
        try:
            async for item in streams:
                got.append(item)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(go())
    assert sorted(got) == ["bad0", "live0", "live1", "live2"]
    assert isinstance(error, RuntimeError) and "failed" in str(error)


def test_a_step_added_while_reading_is_read_too():
    async def go() -> list[str]:
        streams: Streams[str] = Streams()
        streams.add(step("first", 2, 0.005))
        got = []
        async for item in streams:
            got.append(item)
            if item == "first0":
                streams.add(step("later", 2, 0.001))
        return got

    assert sorted(asyncio.run(go())) == ["first0", "first1", "later0", "later1"]


@pytest.mark.timeout(30)
def test_a_reader_that_stops_early_cancels_what_still_runs():
    async def go() -> bool:
        stopped = asyncio.Event()

        async def endless() -> AsyncIterator[str]:
            try:
                while True:
                    await asyncio.sleep(0.001)
                    yield "tick"
            except asyncio.CancelledError:
                stopped.set()
                raise

        streams: Streams[str] = Streams()
        streams.add(endless())
        reader = streams.__aiter__()
        assert await reader.__anext__() == "tick"
        await reader.aclose()
        await asyncio.wait_for(stopped.wait(), 5)
        return stopped.is_set()

    assert asyncio.run(go())
