"""Run as ``python -m tests.support.media_memory_probe CHECKPOINT images|video``: decode and prepare one request's media
in a fresh process (``images``: then two more such requests, all kept, as a worker holds them until they are
answered), and print (JSON) the peak RSS growth beside the most the media budget counted, after the first
request and after the last.

The process is fresh so that nothing else's memory moves its RSS; its peak is the kernel's high-water mark
(VmHWM, reset just before the first decode), read after each request is prepared (its vision inputs
included): a thread sampling the RSS missed short peaks, and the same clip measured 104 to 176 MiB. The budget's
count follows the worker's ledger: a request holds its whole share while it is prepared, and its kept part
after that (``InFlightLedger.prepared``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import threading
import time

import numpy as np
from PIL import Image


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The process's highest RSS since ``start``: the kernel's own high-water mark (VmHWM), reset first through
    /proc/self/clear_refs, so no short peak between two samples is missed; a thread sampling every 5 ms where
    the kernel does not allow the reset."""

    def __init__(self, start: int) -> None:
        self._sampled = [start]
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
                clear.write("5")  # resets VmHWM to the current RSS
            self._kernel = True
        except OSError:
            self._kernel = False
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.is_set():
            self._sampled[0] = max(self._sampled[0], _rss())
            time.sleep(0.005)

    def value(self) -> int:
        if self._kernel:
            with open("/proc/self/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        return max(self._sampled[0], _rss())

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def images(count: int = 6, side: int = 4000) -> list[bytes]:
    """``count`` PNGs of ``side`` x ``side`` pixels (16 megapixels by default), smooth enough to stay under the
    8 MB object limit."""
    y, x = np.mgrid[0:side, 0:side]
    out = []
    for n in range(count):
        pixels = np.stack([x * 255 // side, y * 255 // side, (x + y + 50 * n) % 256], -1).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
        out.append(buffer.getvalue())
    return out


def video() -> bytes:
    """A 4-second 1080p clip (sampled at 2 fps: eight frames)."""
    from d3stream.dev.demo import sample_mp4

    return sample_mp4(frames=40, width=1920, height=1080, fps=10.0)


def main(checkpoint: str, case: str) -> dict[str, float]:
    from d3stream.core.decoding import MediaDecoder
    from d3stream.runtime import D3

    media = [video()] if case == "video" else images()
    model = D3.from_pretrained(checkpoint, device="cpu")
    model.prepare("warm", {"q": {"type": "noul"}}, decoded_images=[Image.new("RGB", (64, 64))])
    decoder = MediaDecoder(timeout_s=300, max_pixels=200_000_000, max_video_frames=1_000)
    decoder.warm()
    base = _rss()
    peak = _Peak(base)
    reserved: list[int] = []

    async def decode() -> object:
        async def reserve(amount: int) -> None:
            reserved.append(amount)

        if case != "video":
            return await decoder.decode([bytes(m) for m in media], [], reserve)
        return await decoder.decode([], media, reserve)

    counted = kept = 0
    prepared = []
    first: dict[str, int] = {}
    for _ in range(3 if case == "images" else 1):
        decoded = asyncio.run(decode())
        memory = decoded.memory  # type: ignore[attr-defined]
        counted = max(counted, kept + memory.total)  # while it is prepared
        prepared.append(model.prepare("state", {"q": {"type": "noul"}},
                                      decoded_images=decoded.images or None,  # type: ignore[attr-defined]
                                      decoded_videos=decoded.videos or None))  # type: ignore[attr-defined]
        kept += memory.kept
        first = first or {"counted": counted, "peak_growth": peak.value() - base}
    final_peak = peak.value()
    peak.stop()
    assert all(p.media is not None for p in prepared)
    decoder.close()
    return {"reserved": reserved[0], "held": memory.total, "first_counted": first["counted"],
            "first_peak_growth": first["peak_growth"], "counted": counted, "peak_growth": final_peak - base}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
