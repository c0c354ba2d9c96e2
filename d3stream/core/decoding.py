"""Decoding a request's media for the service: off the prepare thread, within a budget, with a deadline.

Three rules for media from outside (``runtime.media`` reads the bytes; this module decides where and how
long):

* **Budget before work.** Image sizes come from their headers and every video's sampled frames from its
  header, and are spent against the request's ``MediaBudget`` (``max_media_pixels``,
  ``max_video_frames``) before anything is decoded; an image is counted once per reference, since the
  processor resizes each reference on its own, but decoded once however often it is named.
* **Not on the prepare thread, and not in one line.** Up to ``media_decode_processes`` decodes run side by
  side: videos each in a worker process of their own, images on as many threads. A text-only request never
  waits behind a decode, and one request's heavy or hostile media delay another's only while every slot is
  taken, each for at most one deadline.
* **A deadline for every decode** (``media_decode_timeout_s``), counted from when the decode gets its slot,
  not while it waits for one. Videos run in worker processes (spawned, not forked: the parent runs torch and
  asyncio threads); a job past the deadline has its process killed and replaced: FFmpeg seeks from the
  previous keyframe, which a hostile file can put 100,000 frames back, and a thread could not be stopped.
  Images stay in threads: their decode is bounded by the 16-megapixel header check (about 0.1 s for the
  largest), a process hop would double it (the decoded pixels are pickled back), and the deadline still
  answers the request in time; the thread then finishes the bounded decode on its own.

The first decoding process starts with the worker (the first video should not wait for it), the others when
first needed; each holds about 30 MB of its own (docs/MEMORY.md).

A decode past its deadline raises ``DecodeTimeout`` (a ``ValueError``: the service answers
``media_unreadable``); a budget overrun raises ``runtime.media.MediaBudgetExceeded``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from d3stream.runtime import media as media_io
from d3stream.settings import MediaSettings

if TYPE_CHECKING:
    from PIL import Image

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The directory d3stream is imported from, so the decoding process imports this same copy.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class DecodeTimeout(ValueError):
    """A decode that ran past its deadline and was abandoned."""


class DecodeCrashed(ValueError):
    """The decoding process ended in the middle of a job (a crash in FFmpeg, or killed from outside)."""


@dataclass
class DecodedMedia:
    """A request's decoded images and videos, one per reference, in request order."""

    images: list[Image.Image]
    videos: list[media_io.Video]

    @property
    def memory(self) -> media_io.MediaMemory:
        """What the media hold: decoded pixels and vision inputs until the request is answered, the processor's
        copies until it is prepared (``media_io.image_memory``, ``video_memory``; an object named twice counts
        once)."""
        seen: dict[int, media_io.MediaMemory] = {}
        for image in self.images:
            seen[id(image)] = media_io.image_memory(image.width * image.height)
        for video in self.videos:
            count, height, width = video.frames.shape[:3]
            seen[id(video)] = media_io.video_memory(int(count), int(height * width))
        return sum(seen.values(), media_io.MediaMemory(0, 0))


def decode_videos(datas: Sequence[bytes], budget: media_io.MediaBudget, labels: Sequence[str]) -> list[media_io.Video]:
    """Strictly decode videos against one budget (runs in the decoding process)."""
    return _each_named(lambda data, label: media_io.checked_video_bytes(data, budget, label), datas, labels)


def probe_videos(datas: Sequence[bytes], labels: Sequence[str]) -> list[media_io.VideoHeader]:
    """Each video's header after the strict checks, no frame decoded (runs in the decoding process)."""
    return _each_named(lambda data, label: media_io.checked_video_header(data), datas, labels)


def _each_named(read: Callable[[bytes, str], T], datas: Sequence[bytes], labels: Sequence[str]) -> list[T]:
    """``read(data, label)`` of each item; a ValueError names the item it came from (a budget overrun already
    names what it counted)."""
    results = []
    for data, label in zip(datas, labels, strict=True):
        try:
            results.append(read(data, label))
        except media_io.MediaBudgetExceeded:
            raise
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from exc
    return results


# -------------------------------------------------------------------------------------- worker process


def _serve_jobs(connection: Connection) -> None:
    """The decoding process: run (function, args) jobs sent over ``connection`` until it closes."""
    import cv2  # noqa: F401 - imported once here, not inside the first job's deadline

    while True:
        try:
            message = connection.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            function, args = pickle.loads(message)
            outcome: tuple[str, object] = ("ok", function(*args))
        except media_io.MediaBudgetExceeded as exc:
            outcome = ("budget", str(exc))
        except ValueError as exc:
            outcome = ("unreadable", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the request, the process goes on
            outcome = ("unreadable", f"the media could not be decoded ({media_io.reason(exc)})")
        connection.send(outcome)


class _Slot:
    """One decoding process and the parent's end of its socket; started on first use, replaced when killed.

    A plain ``python -P -m d3stream.core.decoding <fd>`` child, not a ``multiprocessing`` one: spawn and
    forkserver re-import the parent's main module (a script, a test runner), fork would copy torch's
    and asyncio's threads mid-state. ``-P`` keeps the current folder off its ``sys.path`` (``-m`` would put
    it first): started in a folder that holds another ``d3stream/`` (a checkout, a copy), it still imports
    the code its parent runs, from ``_PACKAGE_ROOT``. It runs in a process group of its own: Ctrl-C reaches
    every process of the terminal's foreground group, and this one's end is its parent's to decide (the parent
    closes the connection, or kills it; a parent gone closes it too), not a KeyboardInterrupt's traceback beside
    the worker's clean stop."""

    def __init__(self, name: str):
        self.name = name
        self.process: subprocess.Popen | None = None
        self.connection: Connection | None = None

    def ensure_started(self) -> Connection:
        """The connection to this slot's process, started first when there is none (or it ended)."""
        if self.process is not None and self.process.poll() is None and self.connection is not None:
            return self.connection
        self.kill()
        parent, child = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", "d3stream.core.decoding", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                process_group=0,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))},
            )
        finally:
            child.close()
        self.connection = Connection(parent.detach())
        return self.connection

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(5)
            self.process = None
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class ProcessDecoder:
    """Runs decode jobs in ``processes`` worker processes; a job past its deadline has its process killed
    and replaced. Blocking waits run in threads of their own, never on the event loop."""

    def __init__(self, processes: int = 1, timeout_s: float = 10.0, setting: str = "media_decode_timeout_s"):
        self.timeout_s = timeout_s
        self.setting = setting
        self._idle: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._all = [_Slot(f"d3stream-decode-{number}") for number in range(max(1, processes))]
        for slot in self._all:
            self._idle.put(slot)
        self._slots = max(1, processes)
        self._waiters = ThreadPoolExecutor(max_workers=self._slots, thread_name_prefix="d3stream-decode-wait")
        self._closed = threading.Event()
        # Jobs running now by their function's name: a video's header probe and its decode are two jobs, and
        # only the second is the long one (read by tests and metrics).
        self.running: Counter[str] = Counter()
        self._counting = threading.Lock()  # the waiters' threads count side by side
        self.abandoned = 0  # jobs killed at their deadline

    @property
    def busy(self) -> int:
        """Jobs running now, of any kind."""
        with self._counting:
            return sum(self.running.values())

    # Untyped for now: as ``Callable[[*Ts], T]`` with ``*args: *Ts`` (returning T), ``decode`` must first stop
    # reusing one local for the videos' results and the images'.
    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in a worker process within the deadline; its ValueError is re-raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._waiters, self._call, function, args)

    def _call(self, function: Callable[..., Any], args: tuple) -> Any:
        slot = self._idle.get()
        job = getattr(function, "__name__", "job")
        with self._counting:
            self.running[job] += 1
        try:
            if self._closed.is_set():
                raise DecodeCrashed("the worker is shutting down")
            connection = slot.ensure_started()
            try:
                connection.send((function, args))
                finished = connection.poll(self.timeout_s)
                if finished:
                    kind, value = connection.recv()
            except (EOFError, OSError) as exc:
                slot.kill()
                raise DecodeCrashed(f"the decoding process ended during the decode ({type(exc).__name__})") from exc
            if not finished:
                slot.kill()
                self.abandoned += 1
                log.warning("decode abandoned at its deadline", timeout_s=self.timeout_s)
                raise DecodeTimeout(
                    f"decoding took longer than {self.timeout_s:g} s and was abandoned (setting: {self.setting})"
                )
        finally:
            with self._counting:
                self.running[job] -= 1
            self._idle.put(slot)
        if kind == "ok":
            return value
        if kind == "budget":
            raise media_io.MediaBudgetExceeded(value)
        raise ValueError(value)

    def warm(self) -> None:
        """Start one process now (starting one takes about half a second of CPU), so the first video does not
        wait; the others start when first needed."""
        slot = self._idle.get()
        try:
            slot.ensure_started()
        finally:
            self._idle.put(slot)

    def close(self) -> None:
        """Kill the processes; a job still waiting fails with DecodeCrashed."""
        self._closed.set()
        for slot in self._all:  # a busy one too: its waiter sees the end of the pipe and cleans up
            process = slot.process
            if process is not None and process.poll() is None:
                process.kill()
        slots = []
        while True:
            try:
                slots.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for slot in slots:
            slot.kill()
            self._idle.put(slot)
        self._waiters.shutdown(wait=True, cancel_futures=True)


class MediaDecoder:
    """A request's media: header checks against its budget, images on a thread, videos in a process,
    each reference decoded once, every decode under ``timeout_s``."""

    def __init__(self, *, timeout_s: float, processes: int = 1, max_pixels: int | None = None,
                 max_video_frames: int | None = None):
        self.timeout_s = timeout_s
        self.max_pixels = max_pixels
        self.max_video_frames = max_video_frames
        # As many image decodes at once as video decodes: images of several requests decode side by side.
        self._images = ThreadPoolExecutor(max_workers=max(1, processes), thread_name_prefix="d3stream-decode-images")
        self.processes = ProcessDecoder(processes, timeout_s)

    @classmethod
    def from_settings(cls, media: MediaSettings) -> MediaDecoder:
        """A decoder with a worker's deadline, processes and per-request pixel and frame budgets."""
        return cls(timeout_s=media.media_decode_timeout_s, processes=media.media_decode_processes,
                   max_pixels=media.max_media_pixels, max_video_frames=media.max_video_frames)

    def budget(self) -> media_io.MediaBudget:
        return media_io.MediaBudget(pixels=self.max_pixels, frames=self.max_video_frames)

    def image_pixels(self, images: Sequence[bytes]) -> list[int]:
        """Pixels of each image from its header (strict checks; nothing decoded)."""
        sizes = []
        for number, data in enumerate(images):
            try:
                width, height = media_io.image_header(data)
            except ValueError as exc:
                raise ValueError(f"images[{number}]: {exc}") from exc
            sizes.append(width * height)
        return sizes

    def estimate(self, image_pixels: Sequence[int], videos: Sequence[media_io.VideoHeader] = ()) -> int:
        """Bytes a request's media may come to hold while it is prepared (``DecodedMedia.memory``'s total),
        from its image and video headers: what it takes of the in-flight media budget while it decodes (given
        back down to what it holds once decoded, and once prepared)."""
        total = sum(media_io.image_memory(pixels).total for pixels in image_pixels)
        for header in videos:
            total += media_io.video_memory(header.sampled, header.width * header.height).total
        return total

    async def decode(self, images: Sequence[bytes], videos: Sequence[bytes],
                     reserve: Callable[[int], Awaitable[object]] | None = None) -> DecodedMedia:
        """Decode one request's media (one entry per reference; equal bytes are decoded once).

        Image headers are read and the budget spent first, and the videos' headers read in a decoding process
        (a job of its own, under the deadline: a video's size is known before it takes memory); then
        ``reserve(bytes)`` is awaited with the decoded size the media may reach (the service's in-flight media
        budget), then videos and images are decoded. ValueError (or MediaBudgetExceeded, or DecodeTimeout)
        names the reference."""
        budget = self.budget()
        loop = asyncio.get_running_loop()
        image_pixels = await loop.run_in_executor(self._images, self.image_pixels, images) if images else []
        for number, pixels in enumerate(image_pixels):
            budget.spend(f"images[{number}]", pixels)
        distinct_videos = _distinct(videos)
        labels = [f"videos[{first}]" for first in distinct_videos.values()]
        headers = await self.processes.run(probe_videos, list(distinct_videos), labels) if videos else []
        if reserve is not None:
            await reserve(self.estimate(image_pixels, headers))
        decoded_videos: list[media_io.Video] = []
        if videos:
            result = await self.processes.run(decode_videos, list(distinct_videos), budget, labels)
            by_content = dict(zip(distinct_videos, result, strict=True))
            decoded_videos = [by_content[data] for data in videos]
        decoded_images: list[Image.Image] = []
        if images:
            distinct = _distinct(images)
            began: asyncio.Future[None] = loop.create_future()
            job = loop.run_in_executor(self._images, _decode_images, list(distinct), list(distinct.values()),
                                       partial(loop.call_soon_threadsafe, _settle, began))
            try:
                either: list[asyncio.Future[None] | asyncio.Future[list[Image.Image]]] = [began, job]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)  # a free thread: the deadline starts
                result = await asyncio.wait_for(asyncio.shield(job), self.timeout_s)
            except TimeoutError:
                raise DecodeTimeout(
                    f"decoding the images took longer than {self.timeout_s:g} s and was abandoned "
                    f"(setting: {self.processes.setting})"
                ) from None
            by_content = dict(zip(distinct, result, strict=True))
            decoded_images = [by_content[data] for data in images]
        return DecodedMedia(decoded_images, decoded_videos)

    def warm(self) -> None:
        self.processes.warm()

    def close(self) -> None:
        self.processes.close()
        self._images.shutdown(wait=True, cancel_futures=True)


class ByteBudget:
    """Bytes of decoded media the worker holds at once (``max_inflight_media_bytes``): a request waits for
    its share before it decodes and holds it until it is answered. A share larger than the whole budget
    is cut to it, so one large request still runs, alone."""

    def __init__(self, capacity: int):
        self.capacity = max(1, int(capacity))
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def full(self) -> bool:
        return self.used >= self.capacity

    async def acquire(self, amount: int) -> int:
        """Wait until ``amount`` (cut to the capacity) fits beside what is held; returns what was taken."""
        amount = min(max(0, int(amount)), self.capacity)
        while self.used and self.used + amount > self.capacity:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += amount
        return amount

    def release(self, amount: int) -> None:
        self.used = max(0, self.used - int(amount))
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _distinct(items: Sequence[bytes]) -> dict[bytes, int]:
    """Each distinct content -> the number of the first reference that holds it."""
    first: dict[bytes, int] = {}
    for number, data in enumerate(items):
        first.setdefault(data, number)
    return first


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _decode_images(datas: list[bytes], numbers: list[int], began: Callable[[], object]) -> list[Image.Image]:
    """Decode images (on a decoding thread), saying first that the decode began: its deadline starts now."""
    began()
    return _each_named(lambda data, label: media_io.checked_image_bytes(data), datas,
                       [f"images[{number}]" for number in numbers])


if __name__ == "__main__":  # the decoding process: python -P -m d3stream.core.decoding <socket fd>
    _serve_jobs(Connection(int(sys.argv[1])))
