"""Several async iterators read at once, their items handed on in the order they come.

The pipeline answers a fetch in several independent steps (the text requests of each lane, each media
request, each request held by its tenant's quota, each batch of shadow answers) and hands their answers on
as each step produces them: the steps are async generators that yield values, and ``Streams`` reads them
side by side, so no step needs a callback to hand its results back. A step may be added while the others
run (a shadow step starts once its live answers exist).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Streams(Generic[T]):
    """Async iterators drained side by side, each in a task of its own; iterate to receive their items.

    An iterator that raises does not stop the others: their items are still handed on (a shadow step still
    delivers the live answers it holds when the live step fails), and the first exception is raised to the
    reader once every iterator has ended. The ones still running are cancelled if the reader stops early."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._wake = asyncio.Event()
        self._running: set[asyncio.Future[None]] = set()
        self._failed: BaseException | None = None

    def add(self, stream: AsyncIterator[T]) -> None:
        """Start reading ``stream`` (at once: it runs while the reader waits for something else)."""
        task = asyncio.ensure_future(self._drain(stream))
        self._running.add(task)
        task.add_done_callback(self._ended)

    async def _drain(self, stream: AsyncIterator[T]) -> None:
        async for item in stream:
            self._items.append(item)
            self._wake.set()

    def _ended(self, task: asyncio.Future[None]) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failed is None:
            self._failed = task.exception()
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            while True:
                if self._items:
                    items, self._items = self._items, []
                    for item in items:
                        yield item
                    continue
                if not self._running:
                    if self._failed is not None:
                        raise self._failed
                    return
                self._wake.clear()
                await self._wake.wait()
        finally:
            for task in list(self._running):
                task.cancel()
