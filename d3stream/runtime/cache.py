"""A bounded cache of vision-tower features, so the same image in many requests is encoded once.

Each image (and each video) of a request is keyed by

* the content hash of the decoded media (mode, size and pixels of the PIL image; shape and bytes of a
  video's sampled frames plus its frame indices and frame rate, which set its timestamps),
* the settings of the processor that turned it into patches (``to_dict()`` of the image or video
  processor: sizes, pixel budgets, patch and merge sizes, normalisation, ...) and its patch grid,
* the model it was encoded by (checkpoint directory, identity, device, vision-tower dtype),

so two requests share an entry only when the vision tower would see exactly the same input. Entries are
the tower's outputs (the merged features, plus Qwen3-VL's deepstack features) and are evicted least
recently used once their tensors exceed ``max_bytes``; an entry larger than the whole budget is not kept.

Wiring: ``model.media_cache = MediaFeatureCache(max_bytes=..., on_lookup=metrics.count_media_cache)``;
``VisionEncoder.encode`` (``vision.py``) then asks the cache for each image and video of every request in a
pass and encodes only the ones it misses, the misses of all those requests in shared calls of the tower (an image
two requests of the pass share, once). ``request_features`` is the one-request form
(``media_batch_patches = 0``). ``stats()`` gives hits, misses, evictions, encoded, entries and bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from d3stream.runtime.kinds import IMAGE, MEDIA_KINDS, VIDEO, MediaKind, media_kind
from d3stream.runtime.package import Manifest
from d3stream.runtime.rows import Features, RequestMedia

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from transformers import ProcessorMixin
    from transformers.image_processing_base import ImageProcessingMixin

    from d3stream.runtime.media import Video

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class Entry:
    """The vision-tower output of one image or video."""

    pooled: torch.Tensor  # [tokens, hidden]
    deepstack: list[torch.Tensor] | None  # per deepstack layer: [tokens, hidden] (Qwen3-VL), else None
    nbytes: int


class EncodingModel(Protocol):
    """What the cache needs of the model whose vision tower made its features (a loaded ``Checkpoint``, or
    the ``D3`` holding it): where it came from, where it runs, its processor and its backbone."""

    @property
    def root(self) -> Path: ...
    @property
    def manifest(self) -> Manifest | None: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def processor(self) -> ProcessorMixin | None: ...
    @property
    def backbone(self) -> torch.nn.Module | None: ...  # a transformers model with get_image_features / ...


def tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def vision_dtype(model: EncodingModel) -> str:
    """The dtype the vision tower computes in (its first parameter's); empty for a model without one."""
    backbone = model.backbone
    if backbone is None:
        return ""
    for name, parameter in backbone.named_parameters():
        if "visual" in name:
            return str(parameter.dtype)
    return ""


def settings_digest(processor: ImageProcessingMixin) -> str:
    """A digest of an image or video processor's settings (a video processor is an image processor too in
    transformers); any setting that changes patches changes it."""
    try:
        settings = processor.to_dict()
    except Exception:  # noqa: BLE001 - a processor without to_dict: fall back to its attributes
        settings = dict(vars(processor))
    settings = {k: v for k, v in settings.items() if not k.startswith("_")}
    settings["__class__"] = type(processor).__name__
    text = json.dumps(settings, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def image_digest(image: Image.Image) -> str:
    """Content hash of a decoded PIL image."""
    digest = hashlib.sha256()
    digest.update(f"image|{image.mode}|{image.size[0]}x{image.size[1]}|".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def video_digest(video: Video) -> str:
    """Content hash of a sampled video: its frames and the metadata that sets their timestamps."""
    import numpy as np

    frames = np.ascontiguousarray(video.frames)
    digest = hashlib.sha256()
    meta = {"shape": list(frames.shape), "dtype": str(frames.dtype), **video.metadata()}
    digest.update(("video|" + json.dumps(meta, sort_keys=True, default=repr) + "|").encode())
    digest.update(frames.tobytes())
    return digest.hexdigest()


def content_digests(images: list[Image.Image], videos: list[Video]) -> dict[str, list[str]]:
    """The content digest of each image and video, by media kind (``RequestMedia.contents``)."""
    return {IMAGE.name: [image_digest(image) for image in images], VIDEO.name: [video_digest(video) for video in videos]}


class MediaFeatureCache:
    """LRU cache of vision features bounded by the bytes of its tensors. Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, *, on_lookup: Callable[[bool], None] | None = None):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self.on_lookup = on_lookup
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.encoded = 0  # images and videos run through the vision tower

    # ------------------------------------------------------------------------------------------- store

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        """The entry (marked most recently used) or None; counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if self.on_lookup is not None:
            self.on_lookup(entry is not None)
        return entry

    def put(self, key: str, entry: Entry) -> bool:
        """Store an entry, evicting the least recently used ones past ``max_bytes``; False when too large."""
        with self._lock:
            if entry.nbytes > self.max_bytes:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.evictions += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int | float | None]:
        lookups = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else None,
            "evictions": self.evictions,
            "encoded": self.encoded,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
        }

    # ---------------------------------------------------------------------------------------- features

    @staticmethod
    def model_namespace(model: EncodingModel) -> str:
        """The model, device and vision-tower dtype the features came from: the same weights cast to another
        dtype encode the same image to different features, and a cached BF16 encoding must not answer an FP32
        run."""
        identity = ((model.manifest or {}).get("identity") or {}).get("model_sha256")
        return f"{model.root}|{identity}|{model.device}|{vision_dtype(model)}"

    def keys(self, model: EncodingModel, media: RequestMedia, kind: str) -> list[str] | None:
        """The cache key of each image (``kind="image"``) or video of a request's media; None when it was
        prepared without content digests (no cache then): encoded, not looked up or kept."""
        if media.contents is None:
            return None
        found = media_kind(kind)
        settings = settings_digest(getattr(model.processor, found.processor_attribute))
        grids = media.inputs[found.grid_input].tolist()
        namespace = self.model_namespace(model)
        return [
            hashlib.sha256(f"{namespace}|{kind}|{settings}|{grid}|{content}".encode()).hexdigest()
            for content, grid in zip(media.contents[found.name], grids, strict=True)
        ]

    def request_features(self, model: EncodingModel, media: RequestMedia) -> dict[str, Features]:
        """The features of ``media`` (``RequestMedia.features``), encoding only the images and videos not
        cached."""
        features: dict[str, Features] = {}
        for media_type in MEDIA_KINDS:
            kind = media_type.name
            if media_type.pixels_input not in media.inputs:
                continue
            keys = self.keys(model, media, kind)
            assert keys is not None  # the encoder asks only for requests prepared with content digests
            found: dict[str, Entry] = {}
            missing: list[int] = []
            for number, key in enumerate(keys):
                if key in found or any(keys[m] == key for m in missing):
                    continue  # the same media twice in one request: encoded (or looked up) once
                entry = self.get(key)
                if entry is None:
                    missing.append(number)
                else:
                    found[key] = entry
            if missing:
                found.update(self._encode(model, media, media_type, missing, keys))
            entries = [found[key] for key in keys]
            # Every entry of a kind comes from the same model (the namespace is in its key): all have deepstack
            # features (Qwen3-VL) or none has.
            deepstacks = [entry.deepstack for entry in entries if entry.deepstack is not None]
            deep = None
            if deepstacks:
                layers = len(deepstacks[0])
                deep = [[stack[layer] for stack in deepstacks] for layer in range(layers)]
            features[kind] = Features([entry.pooled for entry in entries], deep)
        return features

    def _encode(
        self, model: EncodingModel, media: RequestMedia, kind: MediaKind, numbers: list[int], keys: list[str]
    ) -> dict[str, Entry]:
        import torch

        grid = media.inputs[kind.grid_input]
        pixels = media.inputs[kind.pixels_input]
        patches = grid.prod(-1).tolist()
        starts = [0]
        for count in patches:
            starts.append(starts[-1] + int(count))
        chosen = torch.cat([pixels[starts[n] : starts[n + 1]] for n in numbers])
        encode = getattr(model.backbone, kind.features_method)
        output = encode(chosen.to(model.device), grid[numbers].to(model.device), return_dict=True)
        pooled = list(output.pooler_output)
        deep = getattr(output, "deepstack_features", None)
        self.encoded += len(numbers)
        made: dict[str, Entry] = {}
        for position, number in enumerate(numbers):
            layers = None if deep is None else [layer[position] for layer in deep]
            if len(numbers) > 1:  # split views would keep the whole batch's output alive: own the bytes counted
                pooled[position] = pooled[position].clone()
                layers = None if layers is None else [t.clone() for t in layers]
            size = tensor_bytes(pooled[position]) + sum(tensor_bytes(t) for t in layers or [])
            entry = Entry(pooled[position], layers, size)
            self.put(keys[number], entry)
            made[keys[number]] = entry
        return made


@runtime_checkable
class CachingModel(Protocol):
    """A model that encodes media through an optional ``MediaFeatureCache`` (``D3`` is one)."""

    media_cache: MediaFeatureCache | None


@contextlib.contextmanager
def lent_media_caches(models: Iterable[object], capacity: int, on_lookup: Callable[[bool], None]) -> Iterator[None]:
    """Each model (one with a ``media_cache``) encodes through a cache of ``capacity`` bytes of its own while
    the block runs, and gets back the cache it had however the block ends, so a model shared with other
    callers (a replay beside a live service, the next test) keeps no features, and no counter, from it.
    ``capacity`` 0 lends nothing."""
    with contextlib.ExitStack() as stack:
        for model in models:
            if capacity > 0 and isinstance(model, CachingModel):
                stack.enter_context(_lent(model, capacity, on_lookup))
        yield


@contextlib.contextmanager
def _lent(model: CachingModel, capacity: int, on_lookup: Callable[[bool], None]) -> Iterator[None]:
    before = model.media_cache
    model.media_cache = MediaFeatureCache(capacity, on_lookup=on_lookup)
    try:
        yield
    finally:
        model.media_cache = before
