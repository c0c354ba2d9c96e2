"""Image and video inputs: decoding, sampling, and the strict limits for bytes from outside.

Two ways in:

* **in process** (a library caller trusts its inputs): PIL images, local paths, ``data:`` URLs and, for
  videos, frame arrays. Only PIL's decompression-bomb guard bounds them.
* **strict** (what the service uses for bytes fetched from object storage or sent inline): encoded
  bytes or ``data:`` URLs only, checked before anything expensive happens. Images must be PNG, JPEG or
  WebP, at most 8,000,000 bytes and 16,000,000 source pixels, and pass PIL's integrity check. Videos
  must be MP4, WebM, QuickTime or Matroska, at most 32,000,000 bytes, 300 seconds and 8,294,400 pixels
  per frame.

Every refusal is a ``ValueError`` whose message says what was wrong (never an object's repr or a heap
address), so the service can turn it into an error answer. Videos are sampled at 2 frames per second,
at least 4 and at most 32 frames spread evenly over the whole clip; the frame count is made even because
every two frames form one token group.

Bounded work: an image's size is read from its header (``image_header``) before it is decoded, and a
video's frame size, rate and count before any frame is read, so a caller's ``MediaBudget`` (pixels and
frames a request may decode to) refuses media before the work. A video is read frame by frame only across
short gaps between sampled frames; across longer ones the reader seeks, so the frames read stay about
``VIDEO_MAX_FRAMES * VIDEO_SEEK_GAP`` whatever frame rate and length the container claims (a clip of
120,000 samples at 1000 fps used to be decoded in full). Seeking still decodes from the previous
keyframe inside FFmpeg, which a hostile file can put far back: callers that take bytes from outside run
decoding with a deadline (the service: ``d3stream.core.decoding``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

if TYPE_CHECKING:
    import cv2
    from numpy.typing import NDArray
    from PIL import Image, ImageFile

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
# What one image or video frame costs in memory, per pixel of the source and per pixel after the processor's
# resize, in two parts. Kept from its decode until its request is answered: the vision inputs the processor
# returns (float32 patches, an image's pixels twice for the temporal patch: 24 bytes a resized pixel) and what
# the allocator keeps around them. Preparing, on top of that until the request is prepared: the decoded RGB
# pixels (3 bytes a source pixel; let go once the request is prepared, core/record.py) and the processor's
# copies while it converts and resizes. Requests are prepared one at a time and the next one's copies reuse the
# memory of the last, so a worker's peak is the kept parts of every request in flight plus the preparing parts
# of those not prepared yet. Measured as the peak RSS growth of decoding and preparing one and three requests
# of six 16-megapixel PNGs, and a 1080p clip, on the tiny checkpoints' processor (docs/MEASUREMENTS.md);
# tests/system/test_media_memory.py keeps the count within 25 % of it.
IMAGE_KEPT_PER_PROCESSED_PIXEL = 26.5
IMAGE_PREPARING_PER_SOURCE_PIXEL = 8.0
IMAGE_PREPARING_PER_PROCESSED_PIXEL = 19.5
VIDEO_KEPT_PER_PROCESSED_PIXEL = 12.0
VIDEO_PREPARING_PER_SOURCE_PIXEL = 7.8

@dataclass(frozen=True)
class MediaMemory:
    """Bytes media hold: ``kept`` until the request is answered, ``preparing`` more until it is prepared."""

    kept: int
    preparing: int

    @property
    def total(self) -> int:
        return self.kept + self.preparing

    def __add__(self, other: MediaMemory) -> MediaMemory:
        return MediaMemory(self.kept + other.kept, self.preparing + other.preparing)


# A container frame rate outside this range is not believed; the clip is read as 24 fps instead.
VIDEO_SOURCE_FPS = (0.1, 1000.0)
VIDEO_UNKNOWN_FPS = 24.0
# Sampled frames further apart than this are reached by seeking, nearer ones by reading on.
VIDEO_SEEK_GAP = 24
# A container that does not say how many frames it has is counted by reading, at most this far
# (300 s at 60 fps); a longer one is refused.
VIDEO_MAX_COUNTED_FRAMES = 18_000

# "<_io.BytesIO object at 0x7f...>" and the like in library messages: an object's repr says nothing to a
# producer and leaks heap addresses.
_OBJECT_REPR = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")


def reason(exc: BaseException) -> str:
    """``Type: message`` of a library exception, without object reprs or heap addresses."""
    text = _OBJECT_REPR.sub("", str(exc)).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class MediaBudgetExceeded(ValueError):
    """A request's media would decode to more pixels or video frames than its ``MediaBudget`` allows."""


@dataclass
class MediaBudget:
    """What one request's media may still decode to, spent as each image or video header is read.

    ``None`` is no limit. The setting names go into the refusal, so the message says which knob to turn.
    """

    pixels: int | None = None
    frames: int | None = None
    pixels_setting: str = "max_media_pixels"
    frames_setting: str = "max_video_frames"

    def spend(self, what: str, pixels: int, frames: int = 0) -> None:
        if self.frames is not None:
            if frames > self.frames:
                raise MediaBudgetExceeded(
                    f"{what} needs {frames:,} decoded video frames; the request has {self.frames:,} left "
                    f"(setting: {self.frames_setting})"
                )
            self.frames -= frames
        if self.pixels is not None:
            if pixels > self.pixels:
                raise MediaBudgetExceeded(
                    f"{what} decodes to {pixels:,} pixels; the request has {self.pixels:,} left "
                    f"(setting: {self.pixels_setting})"
                )
            self.pixels -= pixels


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


def _decode_image(data: bytes) -> Image.Image:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - PIL raises many exception classes
        raise ValueError(f"the image could not be decoded ({reason(exc)})") from exc


def _open_checked(data: bytes) -> ImageFile.ImageFile:
    """The PIL image of encoded bytes from outside, opened (header read, nothing decoded) and checked:
    byte limit, format, pixel limit."""
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data):,} bytes, over the {MAX_IMAGE_BYTES:,} byte limit")
    try:
        probe = Image.open(io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001 - unidentified, decompression bomb, ...
        raise ValueError(f"the image could not be identified ({reason(exc)})") from exc
    try:
        if probe.format not in IMAGE_FORMATS:
            raise ValueError(f"the image is {probe.format or 'of an unknown format'}; send PNG, JPEG or WebP")
        width, height = probe.size
        if width * height > MAX_IMAGE_SOURCE_PIXELS:
            raise ValueError(
                f"the image has {width * height:,} pixels; at most {MAX_IMAGE_SOURCE_PIXELS:,} are accepted"
            )
    except BaseException:
        probe.close()
        raise
    return probe


def image_memory(pixels: int) -> MediaMemory:
    """What one image of ``pixels`` source pixels holds (``MediaMemory``)."""
    processed = min(max(pixels, IMAGE_MIN_PIXELS), IMAGE_MAX_PIXELS)
    return MediaMemory(int(IMAGE_KEPT_PER_PROCESSED_PIXEL * processed),
                       int(IMAGE_PREPARING_PER_SOURCE_PIXEL * pixels + IMAGE_PREPARING_PER_PROCESSED_PIXEL * processed))


def video_memory(frames: int, frame_pixels: int) -> MediaMemory:
    """What a video of ``frames`` sampled frames of ``frame_pixels`` pixels holds, like ``image_memory``."""
    processed = min(max(frame_pixels, VIDEO_MIN_PIXELS), VIDEO_MAX_PIXELS)
    return MediaMemory(int(frames * VIDEO_KEPT_PER_PROCESSED_PIXEL * processed),
                       int(frames * VIDEO_PREPARING_PER_SOURCE_PIXEL * frame_pixels))


def image_header(data: bytes) -> tuple[int, int]:
    """(width, height) of encoded image bytes from outside, from the header alone, after the strict byte,
    format and pixel checks (ValueError otherwise). Nothing is decoded."""
    with _open_checked(data) as probe:
        return probe.size


def checked_image_bytes(data: bytes) -> Image.Image:
    """Strictly read encoded image bytes from outside: format, size and pixel limits, integrity check."""
    with _open_checked(data) as probe:
        try:
            probe.verify()
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"the image failed the integrity check ({reason(exc)})") from exc
    return _decode_image(data)


def load_image(value: object, *, strict: bool = False) -> Image.Image:
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


class VideoMetadata(TypedDict):
    """A video's ``video_metadata`` for the video processor: it turns frame indices into timestamps."""

    total_num_frames: int
    fps: float
    width: int
    height: int
    duration: float
    frames_indices: list[int]


@dataclass
class Video:
    """Sampled RGB frames (uint8 ``[frames, height, width, 3]``, an even count) and where they came from."""

    frames: NDArray[np.uint8]
    fps: float
    indices: list[int]
    total_frames: int
    frames_read: int = 0  # frames this decode read from the file (seeks not counted): at most ~32 x 24

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the frames."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    def metadata(self) -> VideoMetadata:
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


def _assemble(frames: list[np.ndarray], indices: list[int], fps: float, total: int, read: int = 0) -> Video:
    if len(frames) % 2:  # frames pair up into token groups; repeat the last to complete the pair
        frames.append(frames[-1])
        indices.append(indices[-1])
    try:
        stacked = np.stack(frames)
    except ValueError as exc:
        raise ValueError("all frames of a video must have the same size") from exc
    return Video(np.ascontiguousarray(stacked), float(fps), list(indices), int(total), int(read))


def container_of(data: bytes) -> str | None:
    """The container a video's leading bytes announce: ``mp4`` (ISO BMFF, QuickTime too), ``matroska``
    (Matroska and WebM), or None."""
    if len(data) >= 12 and data[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip"):
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    return None


def _open_video(source: str) -> cv2.VideoCapture:
    import cv2

    try:
        backend = cv2.CAP_FFMPEG if cv2.videoio_registry.hasBackend(cv2.CAP_FFMPEG) else cv2.CAP_ANY
    except (AttributeError, cv2.error):
        backend = cv2.CAP_ANY
    return cv2.VideoCapture(source, backend)


def _count_frames(source: str, fps: float, strict: bool) -> int:
    """Frames of a video whose container does not say, counted by reading (bounded when strict)."""
    limit = min(int(MAX_VIDEO_SECONDS * fps), VIDEO_MAX_COUNTED_FRAMES) if strict else None
    reader = _open_video(source)
    total = 0
    try:
        while reader.grab():
            total += 1
            if limit is not None and total > limit:
                raise ValueError(
                    f"the video does not say how many frames it has, and has more than {limit:,} "
                    f"(at most {MAX_VIDEO_SECONDS} seconds and {VIDEO_MAX_COUNTED_FRAMES:,} frames are counted)"
                )
    finally:
        reader.release()
    return total


def _read_sampled(reader: cv2.VideoCapture, indices: list[int]) -> tuple[list[np.ndarray], list[int], int]:
    """The frames at ``indices`` (ascending): read on across short gaps, seek across long ones, so the
    frames read stay near ``len(indices) * VIDEO_SEEK_GAP`` however long the clip claims to be."""
    import cv2

    frames: list[np.ndarray] = []
    kept: list[int] = []
    position = 0  # the frame the next grab() returns
    read = 0
    for index in indices:
        if kept and index == kept[-1]:  # a repeated index (short clips): the same frame again
            frames.append(frames[-1])
            kept.append(index)
            continue
        if index - position > VIDEO_SEEK_GAP:
            reader.set(cv2.CAP_PROP_POS_FRAMES, index)
            position = index
        grabbed = True
        while position <= index:
            grabbed = reader.grab()
            read += 1
            position += 1
            if not grabbed:
                break
        if not grabbed:
            continue
        ok, frame = reader.retrieve()
        if ok and frame is not None and frame.size:
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            kept.append(index)
    return frames, kept, read


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says, read before any frame is: its frame size and rate, its length in frames
    and the frames that will be sampled."""

    width: int
    height: int
    fps: float
    total: int
    indices: list[int]

    @property
    def sampled(self) -> int:
        """Frames the processor will take (the sampled count, made even)."""
        return len(self.indices) + len(self.indices) % 2


def _read_header(reader: cv2.VideoCapture, source: str, strict: bool) -> VideoHeader:
    """The header of an opened video, after the strict frame-size and length checks."""
    import cv2

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
    if total <= 0:  # the container does not say: count the frames (bounded when strict)
        total = _count_frames(source, fps, strict)
    if total <= 0:
        raise ValueError("the video has no frames")
    if strict and total / fps > MAX_VIDEO_SECONDS:
        raise ValueError(f"each video must be at most {MAX_VIDEO_SECONDS} seconds long")
    return VideoHeader(width, height, fps, total, sample_indices(total, fps))


def _video_header(source: str, *, strict: bool) -> VideoHeader:
    """The header of a video file; no frame decoded."""
    import cv2

    reader = None
    try:
        reader = _open_video(source)
        return _read_header(reader, source, strict)
    except cv2.error as exc:
        raise ValueError(f"invalid video data ({type(exc).__name__})") from exc
    finally:
        if reader is not None:
            reader.release()


def _decode_video(source: str, *, strict: bool, budget: MediaBudget | None = None, what: str = "the video") -> Video:
    """Decode a video file with OpenCV (FFmpeg) and sample its frames; ``budget`` is spent on the sampled
    frames (from the header, before any is read)."""
    import cv2

    reader = None
    try:
        reader = _open_video(source)
        header = _read_header(reader, source, strict)
        if budget is not None:
            count = header.sampled
            budget.spend(f"{what} ({count} frames of {header.width}x{header.height})",
                         count * header.width * header.height, count)
        frames, kept, read = _read_sampled(reader, header.indices)
    except cv2.error as exc:
        raise ValueError(f"invalid video data ({type(exc).__name__})") from exc
    finally:
        if reader is not None:
            reader.release()
    if not frames:
        raise ValueError("no frame of the video could be decoded")
    return _assemble(frames, kept, header.fps, header.total, read)


@contextlib.contextmanager
def _as_file(data: bytes) -> Iterator[str]:
    """Bytes as a temporary file, so they read exactly like the same file given by path."""
    with tempfile.NamedTemporaryFile(prefix="d3-video-", delete=False) as handle:
        handle.write(data)
    try:
        yield handle.name
    finally:
        os.unlink(handle.name)


def _decode_video_bytes(data: bytes, *, strict: bool, budget: MediaBudget | None = None,
                        what: str = "the video") -> Video:
    with _as_file(data) as path:
        return _decode_video(path, strict=strict, budget=budget, what=what)


def _check_video_bytes(data: bytes) -> None:
    if len(data) > MAX_VIDEO_BYTES:
        raise ValueError(f"the video has {len(data):,} bytes, over the {MAX_VIDEO_BYTES:,} byte limit")
    if container_of(data) is None:
        raise ValueError("the video is not an MP4, WebM, QuickTime or Matroska file")


def checked_video_bytes(data: bytes, budget: MediaBudget | None = None, what: str = "the video") -> Video:
    """Strictly read encoded video bytes from outside: container, size, length and frame-size limits, and
    the sampled frames against ``budget`` before any is read."""
    _check_video_bytes(data)
    return _decode_video_bytes(data, strict=True, budget=budget, what=what)


def checked_video_header(data: bytes) -> VideoHeader:
    """The header of encoded video bytes from outside, after the same strict checks as ``checked_video_bytes``;
    no frame decoded: how much memory its decode will take is known before it starts."""
    _check_video_bytes(data)
    with _as_file(data) as path:
        return _video_header(path, strict=True)


def frames_video(value: object) -> Video:
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


def load_video(value: object, *, strict: bool = False) -> Video:
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
