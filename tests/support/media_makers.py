"""Real media files for tests: encoded images and videos as bytes, made on the spot.

Plain functions (no pytest), so any test module can ``from tests.support.media_makers import make_png``. Every
maker is deterministic for its arguments. Images are noise (so they do not compress to nothing and two
seeds really differ); videos are a moving gradient plus noise, so every frame differs from the last.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import tempfile
import zlib
from functools import lru_cache

import numpy as np

__all__ = [
    "data_url",
    "frames_array",
    "make_avi",
    "make_bmp",
    "make_gif",
    "make_jpeg",
    "make_mp4",
    "make_mp4_bomb",
    "make_png",
    "make_png_header_only",
    "make_smooth_png",
    "make_video",
    "make_webm",
    "make_webp",
    "noise_image",
    "webm_supported",
]


def noise_image(w: int, h: int, seed: int = 0):
    """An RGB PIL image of uniform noise."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _encode(w: int, h: int, seed: int, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image = noise_image(w, h, seed)
    if fmt == "GIF":
        image = image.convert("P")
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def make_png(w: int, h: int, seed: int = 0) -> bytes:
    return _encode(w, h, seed, "PNG")


def make_jpeg(w: int, h: int, seed: int = 0, quality: int = 90) -> bytes:
    return _encode(w, h, seed, "JPEG", quality=quality)


def make_webp(w: int, h: int, seed: int = 0) -> bytes:
    return _encode(w, h, seed, "WEBP", quality=90)


def make_gif(w: int, h: int, seed: int = 0) -> bytes:
    return _encode(w, h, seed, "GIF")


def make_bmp(w: int, h: int, seed: int = 0) -> bytes:
    return _encode(w, h, seed, "BMP")


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def make_png_header_only(w: int, h: int, *, rows: int = 1) -> bytes:
    """A valid PNG signature and header for a ``w`` x ``h`` grayscale image whose pixel data stops after
    ``rows`` rows (all zero). Tiny for any size: a decompression bomb that only a reader which decodes it
    would notice is incomplete."""
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)  # 8-bit grayscale, no interlace
    data = zlib.compress(b"\x00" * ((w + 1) * rows), 9)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def make_smooth_png(w: int, h: int) -> bytes:
    """A horizontal gradient: compresses to almost nothing, so a 16-megapixel PNG is ~60 KB."""
    from PIL import Image

    row = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(np.broadcast_to(row, (h, w, 3))), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    """``data:<mime>;base64,<data>``."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


# ---------------------------------------------------------------------------------------------- videos


def frames_array(frames: int, w: int, h: int, seed: int = 0):
    """uint8 ``[frames, h, w, 3]`` RGB frames: a gradient that moves one step per frame, plus noise."""
    rng = np.random.default_rng(seed)
    x = np.arange(w, dtype=np.int32)[None, :]
    y = np.arange(h, dtype=np.int32)[:, None]
    out = np.empty((frames, h, w, 3), dtype=np.uint8)
    for number in range(frames):
        base = (x * 4 + y * 2 + number * 9 + seed * 31) % 256
        noise = rng.integers(0, 24, size=(h, w), dtype=np.int32)
        out[number, :, :, 0] = (base + noise) % 256
        out[number, :, :, 1] = (255 - base + noise) % 256
        out[number, :, :, 2] = (base * 3 + number * 5) % 256
    return out


def make_video(frames: int, w: int, h: int, fps: float, *, fourcc: str, suffix: str, seed: int = 0) -> bytes:
    """An encoded video written by OpenCV's ``VideoWriter`` (through a temporary file), as bytes.

    ``frames=0`` writes a file with no frames at all. Raises RuntimeError when OpenCV cannot open a
    writer for the codec and container.
    """
    import cv2

    descriptor, path = tempfile.mkstemp(prefix="d3-test-video-", suffix=suffix)
    os.close(descriptor)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), float(fps), (int(w), int(h)))
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write {fourcc} into {suffix}")
        try:
            if frames:
                for frame in frames_array(frames, w, h, seed):
                    writer.write(np.ascontiguousarray(frame[:, :, ::-1]))  # OpenCV writes BGR
        finally:
            writer.release()
        with open(path, "rb") as stream:
            return stream.read()
    finally:
        os.unlink(path)


def make_mp4(frames: int, w: int, h: int, fps: float = 10.0, seed: int = 0) -> bytes:
    """An MPEG-4 Part 2 (``mp4v``) video in an MP4 container."""
    return make_video(frames, w, h, fps, fourcc="mp4v", suffix=".mp4", seed=seed)


def make_webm(frames: int, w: int, h: int, fps: float = 10.0, seed: int = 0) -> bytes:
    """A VP8 video in a WebM container (check ``webm_supported()`` first)."""
    return make_video(frames, w, h, fps, fourcc="VP80", suffix=".webm", seed=seed)


def make_avi(frames: int, w: int, h: int, fps: float = 10.0, seed: int = 0) -> bytes:
    """A Motion-JPEG video in an AVI container (a container the strict loader does not take)."""
    return make_video(frames, w, h, fps, fourcc="MJPG", suffix=".avi", seed=seed)


@lru_cache(maxsize=1)
def webm_supported() -> bool:
    """True when this OpenCV build writes and reads back a VP8 WebM video."""
    import cv2

    try:
        data = make_webm(4, 32, 32, 10.0)
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False
    if data[:4] != b"\x1a\x45\xdf\xa3":
        return False
    descriptor, path = tempfile.mkstemp(suffix=".webm")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
        reader = cv2.VideoCapture(path)
        try:
            ok, _ = reader.read()
        finally:
            reader.release()
        return bool(ok)
    finally:
        os.unlink(path)


# --------------------------------------------------------------------------------------- video bombs

_MP4_CONTAINERS = (b"moov", b"trak", b"mdia", b"minf", b"stbl")


def _mp4_boxes(data: bytes):
    position = 0
    while position + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[position : position + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[position + 8 : position + 16])[0], 16
        elif size == 0:
            size = len(data) - position
        yield kind, data[position + header : position + size]
        position += size


def _mp4_box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def _with_duration(kind: bytes, payload: bytes, duration: int, timescale: int | None = None) -> bytes:
    """mvhd / mdhd: (timescale,) duration; tkhd: duration -- versions 0 and 1."""
    version = payload[0]
    if kind == b"tkhd":
        at = 20 if version == 0 else 28
    else:
        at = 12 if version == 0 else 20
        if timescale is not None:
            payload = payload[:at] + struct.pack(">I", timescale) + payload[at + 4 :]
        at += 4
    width = 4 if version == 0 else 8
    return payload[:at] + duration.to_bytes(width, "big") + payload[at + width :]


def make_mp4_bomb(samples: int, w: int, h: int, fps: int = 1000, *, keyframe: str = "every") -> bytes:
    """An MP4 of ``samples`` frames that all point at one stored ``mp4v`` frame: ``samples * 4`` bytes of
    sample table and a few KB of picture, however many frames it claims (30,000 frames: ~130 KB).

    ``keyframe="every"``: no sync-sample table, so every frame is a keyframe and seeking is cheap.
    ``"first"``: only the first frame is a keyframe, so FFmpeg decodes from the start on every seek.
    """
    import cv2

    descriptor, path = tempfile.mkstemp(prefix="d3-test-bomb-", suffix=".mp4")
    os.close(descriptor)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (w, h))
        row = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]
        writer.write(np.ascontiguousarray(np.broadcast_to(row, (h, w, 3))))
        writer.release()
        with open(path, "rb") as stream:
            data = stream.read()
    finally:
        os.unlink(path)
    top = list(_mp4_boxes(data))
    moov = dict(top)[b"moov"]
    mvhd = dict(_mp4_boxes(moov))[b"mvhd"]
    movie_scale = struct.unpack(">I", mvhd[12:16] if mvhd[0] == 0 else mvhd[20:24])[0]
    movie_duration = samples * movie_scale // fps

    def rebuilt(kind: bytes, payload: bytes) -> bytes:
        if kind in _MP4_CONTAINERS:
            inner = b"".join(rebuilt(k, p) for k, p in _mp4_boxes(payload) if k not in (b"edts", b"stss"))
            if kind == b"stbl" and keyframe == "first":
                inner += _mp4_box(b"stss", struct.pack(">III", 0, 1, 1))
            return _mp4_box(kind, inner)
        if kind in (b"mvhd", b"tkhd"):
            return _mp4_box(kind, _with_duration(kind, payload, movie_duration))
        if kind == b"mdhd":  # one tick per frame at fps ticks per second
            return _mp4_box(kind, _with_duration(kind, payload, samples, fps))
        if kind == b"stts":
            return _mp4_box(kind, struct.pack(">IIII", 0, 1, samples, 1))
        if kind == b"stsc":  # one sample per chunk
            return _mp4_box(kind, struct.pack(">IIIII", 0, 1, 1, 1, 1))
        if kind == b"stsz":
            size = struct.unpack(">I", payload[4:8])[0] or struct.unpack(">I", payload[12:16])[0]
            return _mp4_box(kind, struct.pack(">III", 0, size, samples))
        if kind == b"stco":  # every chunk at the one stored frame
            offset = struct.unpack(">I", payload[8:12])[0]
            return _mp4_box(kind, struct.pack(">II", 0, samples) + struct.pack(">I", offset) * samples)
        return _mp4_box(kind, payload)

    # moov comes after mdat in OpenCV's files, so the frame's offset does not move.
    return b"".join(rebuilt(kind, payload) if kind == b"moov" else _mp4_box(kind, payload) for kind, payload in top)
