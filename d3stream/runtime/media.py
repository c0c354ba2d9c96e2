"""Image and video inputs: decoding, sampling, and the strict limits for bytes from outside.

Two ways in:

* **in process** (a library caller trusts its inputs): PIL images, local paths, ``data:`` URLs and, for
  videos, frame arrays. Only PIL's decompression-bomb guard bounds them.
* **strict** (what the service uses for bytes fetched from object storage or sent inline): encoded
  bytes or ``data:`` URLs only, checked before anything expensive happens. Images must be PNG, JPEG or
  WebP, at most 8,000,000 bytes and 16,000,000 source pixels, and pass PIL's integrity check. Videos
  must be MP4, WebM, QuickTime or Matroska, at most 32,000,000 bytes, 300 seconds and 8,294,400 pixels
  per frame.

Every refusal is a ``ValueError`` whose message says what was wrong, so the service can turn it into
an error answer. Videos are sampled at 2 frames per second, at least 4 and at most 32 frames spread
evenly over the whole clip; the frame count is made even because every two frames form one token group.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Image budget of the processor: each image is resized into this pixel range, aspect ratio kept.
IMAGE_MIN_PIXELS = 65_536
IMAGE_MAX_PIXELS = 1_638_400
# Strict loading (bytes from outside).
MAX_IMAGE_BYTES = 8_000_000
MAX_IMAGE_SOURCE_PIXELS = 16_000_000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
DATA_URL_IMAGE_TYPES = ("png", "jpeg", "jpg", "webp")

VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 32
VIDEO_MAX_PIXELS = 200_704  # per frame, after the processor's resize
VIDEO_MIN_PIXELS = 4_096
VIDEO_MAX_TOKENS = 16_384  # all videos of one request
MAX_VIDEO_BYTES = 32_000_000
MAX_VIDEO_SOURCE_PIXELS = 8_294_400
MAX_VIDEO_SECONDS = 300
VIDEO_FORMATS = ("mp4", "webm", "quicktime", "x-matroska")
# A container frame rate outside this range is not believed; the clip is read as 24 fps instead.
VIDEO_SOURCE_FPS = (0.1, 1000.0)
VIDEO_UNKNOWN_FPS = 24.0


# ------------------------------------------------------------------------------------------- data URLs


def split_data_url(value: str, media: str) -> tuple[str, str]:
    """``data:<media>/<subtype>[;params];base64,<text>`` -> ``(<subtype>[;params], <text>)``."""
    head, comma, text = value.partition(",")
    head = head.strip().lower()
    opening, closing = f"data:{media}/", ";base64"
    if not comma or not head.startswith(opening) or not head.endswith(closing):
        raise ValueError(f"expected a base64 data URL: data:{media}/<type>;base64,<data>")
    return head[len(opening) : -len(closing)], text


def decode_base64(text: str, limit: int | None = None) -> bytes:
    """Validated base64; with ``limit`` text too long to fit is refused before it is decoded."""
    if limit is not None and len(text) > 4 * math.ceil(limit / 3):
        raise ValueError(f"the encoded data exceeds the {limit:,} byte limit")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("the data URL does not hold valid base64") from exc
    if limit is not None and len(data) > limit:
        raise ValueError(f"the decoded data has {len(data):,} bytes, over the {limit:,} byte limit")
    return data


# ---------------------------------------------------------------------------------------------- images


def _decode_image(data: bytes) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - PIL raises many exception classes
        raise ValueError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from exc


def checked_image_bytes(data: bytes) -> Any:
    """Strictly read encoded image bytes from outside: format, size and pixel limits, integrity check."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data):,} bytes, over the {MAX_IMAGE_BYTES:,} byte limit")
    try:
        probe = Image.open(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - unidentified, decompression bomb, ...
        raise ValueError(f"the image could not be identified ({type(exc).__name__}: {exc})") from exc
    with probe:
        if probe.format not in IMAGE_FORMATS:
            raise ValueError(f"the image is {probe.format or 'of an unknown format'}; send PNG, JPEG or WebP")
        width, height = probe.size
        if width * height > MAX_IMAGE_SOURCE_PIXELS:
            raise ValueError(
                f"the image has {width * height:,} pixels; at most {MAX_IMAGE_SOURCE_PIXELS:,} are accepted"
            )
        try:
            probe.verify()
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"the image failed the integrity check ({type(exc).__name__}: {exc})") from exc
    return _decode_image(data)


def load_image(value: Any, *, strict: bool = False) -> Any:
    """One image as an RGB PIL image (no EXIF rotation, no resize).

    In process: a PIL image, a local path or a ``data:image/...;base64,`` URL. ``strict``: encoded
    bytes or a data URL of a PNG, JPEG or WebP file within the strict limits (see the module docstring).
    """
    from PIL import Image

    if strict:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return checked_image_bytes(bytes(value))
        if not isinstance(value, str) or not value.startswith("data:"):
            raise ValueError("strict mode takes images as encoded bytes or a data: URL, not a path or object")
        subtype, text = split_data_url(value, "image")
        if subtype not in DATA_URL_IMAGE_TYPES:
            raise ValueError(f"image data URLs take the types {', '.join(DATA_URL_IMAGE_TYPES)}, got {subtype!r}")
        return checked_image_bytes(decode_base64(text, MAX_IMAGE_BYTES))
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode_image(bytes(value))
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError("an image is a PIL image, encoded bytes, a local path or a data:image/...;base64 URL")
    if value.startswith("data:"):
        return _decode_image(decode_base64(split_data_url(value, "image")[1]))
    try:
        return _decode_image(Path(value).expanduser().read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read the image {value} ({exc})") from exc


# ---------------------------------------------------------------------------------------------- videos


@dataclass
class Video:
    """Sampled RGB frames (uint8 ``[frames, height, width, 3]``, an even count) and where they came from."""

    frames: np.ndarray
    fps: float
    indices: list[int]
    total_frames: int

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the frames."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    def metadata(self) -> dict[str, Any]:
        """The video processor's ``video_metadata``: it turns frame indices into timestamps."""
        width, height = self.size
        return {
            "total_num_frames": self.total_frames,
            "fps": self.fps,
            "width": width,
            "height": height,
            "duration": self.total_frames / self.fps,
            "frames_indices": list(self.indices),
        }


def sample_indices(total: int, fps: float) -> list[int]:
    """Source frames to keep: 2 per second, at least 4 and at most 32, spread over the whole clip."""
    count = int(total / fps * VIDEO_FPS)
    count = min(max(count, VIDEO_MIN_FRAMES), VIDEO_MAX_FRAMES, total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _assemble(frames: list[np.ndarray], indices: list[int], fps: float, total: int) -> Video:
    if len(frames) % 2:  # frames pair up into token groups; repeat the last to complete the pair
        frames.append(frames[-1])
        indices.append(indices[-1])
    try:
        stacked = np.stack(frames)
    except ValueError as exc:
        raise ValueError("all frames of a video must have the same size") from exc
    return Video(np.ascontiguousarray(stacked), float(fps), list(indices), int(total))


def container_of(data: bytes) -> str | None:
    """The container a video's leading bytes announce: ``mp4`` (ISO BMFF, QuickTime too), ``matroska``
    (Matroska and WebM), or None."""
    if len(data) >= 12 and data[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    return None


def _decode_video(source: str, *, strict: bool) -> Video:
    """Decode a video file with OpenCV (FFmpeg) and sample its frames."""
    import cv2

    try:
        backend = cv2.CAP_FFMPEG if cv2.videoio_registry.hasBackend(cv2.CAP_FFMPEG) else cv2.CAP_ANY
    except (AttributeError, cv2.error):
        backend = cv2.CAP_ANY
    frames: list[np.ndarray] = []
    kept: list[int] = []
    reader = None
    try:
        reader = cv2.VideoCapture(source, backend)
        if not reader.isOpened():
            raise ValueError("the video could not be opened")
        width = int(reader.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(reader.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width <= 0 or height <= 0:
            raise ValueError("the video has no frame size")
        if strict and width * height > MAX_VIDEO_SOURCE_PIXELS:
            raise ValueError(f"video frames must have at most {MAX_VIDEO_SOURCE_PIXELS:,} pixels")
        fps = float(reader.get(cv2.CAP_PROP_FPS) or 0.0)
        if not (math.isfinite(fps) and VIDEO_SOURCE_FPS[0] <= fps <= VIDEO_SOURCE_FPS[1]):
            fps = VIDEO_UNKNOWN_FPS
        total = int(reader.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        if total <= 0:  # the container does not say: count the frames (bounded when strict), then reopen
            limit = int(MAX_VIDEO_SECONDS * fps) if strict else None
            while reader.grab():
                total += 1
                if limit is not None and total > limit:
                    break
            reader.release()
            reader = cv2.VideoCapture(source, backend)
        if total <= 0:
            raise ValueError("the video has no frames")
        if strict and total / fps > MAX_VIDEO_SECONDS:
            raise ValueError(f"each video must be at most {MAX_VIDEO_SECONDS} seconds long")
        indices = sample_indices(total, fps)
        wanted = set(indices)
        for number in range(indices[-1] + 1):
            if not reader.grab():
                continue
            if number in wanted:
                ok, frame = reader.retrieve()
                if ok and frame is not None and frame.size:
                    frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
                    kept.append(number)
    except cv2.error as exc:
        raise ValueError(f"invalid video data ({type(exc).__name__})") from exc
    finally:
        if reader is not None:
            reader.release()
    if not frames:
        raise ValueError("no frame of the video could be decoded")
    return _assemble(frames, kept, fps, total)


def _decode_video_bytes(data: bytes, *, strict: bool) -> Video:
    # Bytes decode through a temporary file so they read exactly like the same file given by path.
    with tempfile.NamedTemporaryFile(prefix="d3-video-", delete=False) as handle:
        handle.write(data)
    try:
        return _decode_video(handle.name, strict=strict)
    finally:
        os.unlink(handle.name)


def checked_video_bytes(data: bytes) -> Video:
    """Strictly read encoded video bytes from outside: container, size, length and frame-size limits."""
    if len(data) > MAX_VIDEO_BYTES:
        raise ValueError(f"the video has {len(data):,} bytes, over the {MAX_VIDEO_BYTES:,} byte limit")
    if container_of(data) is None:
        raise ValueError("the video is not an MP4, WebM, QuickTime or Matroska file")
    return _decode_video_bytes(data, strict=True)


def frames_video(value: Any) -> Video:
    """A frame array read as frames sampled at 2 per second, thinned evenly to at most 32."""
    from PIL import Image

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("a video given as frames needs at least one frame")
        value = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in value]
        if len({frame.shape for frame in value}) != 1:
            raise ValueError("all frames of a video must have the same size")
        value = np.stack(value)
    array = np.asarray(value)
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or not len(array):
        raise ValueError(
            "a video given as frames is a uint8 [frames, height, width, 3] RGB array or a list of "
            "PIL images or [height, width, 3] arrays"
        )
    total = len(array)
    if total > VIDEO_MAX_FRAMES:
        indices = np.linspace(0, total - 1, VIDEO_MAX_FRAMES).round().astype(int).tolist()
    else:
        indices = list(range(total))
    return _assemble([array[i] for i in indices], indices, VIDEO_FPS, total)


def load_video(value: Any, *, strict: bool = False) -> Video:
    """One video, decoded and sampled.

    In process: a local path, encoded bytes, a ``data:video/<format>;base64,`` URL, a frame array or a
    ``Video``. ``strict``: encoded bytes or a data URL only, within the strict limits.
    """
    if isinstance(value, Video) and not strict:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return checked_video_bytes(bytes(value)) if strict else _decode_video_bytes(bytes(value), strict=False)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if strict and not (isinstance(value, str) and value.startswith("data:")):
        raise ValueError("strict mode takes videos as encoded bytes or a data:video/... URL")
    if not isinstance(value, str):
        return frames_video(value)
    if not value:
        raise ValueError("a video is a path, encoded bytes, a data:video/...;base64 URL or a frame array")
    if value.startswith("data:"):
        rest, text = split_data_url(value, "video")
        if not strict:
            return _decode_video_bytes(decode_base64(text), strict=False)
        subtype = rest.split(";", 1)[0]
        if subtype not in VIDEO_FORMATS:
            raise ValueError(f"video data URLs take the types {', '.join(VIDEO_FORMATS)}, got {subtype!r}")
        return checked_video_bytes(decode_base64(text, MAX_VIDEO_BYTES))
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"no video file at {value}")
    return _decode_video(str(path), strict=False)
