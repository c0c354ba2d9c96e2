"""Vision encoding: the features of the images and videos of a pass, computed once per request.

On the model thread, the first time one of a request's rows runs: the vision tower encodes its images and
videos (``RequestMedia.features``), and every later row of the request reuses them. The media of all the
requests of a pass are encoded together, ``media_batch_patches`` patches per call of the tower (0: each
request on its own, the reference behaviour); each image keeps its own attention block, so the features are
those of a per-request encoding up to summation order. With a ``MediaFeatureCache`` (``cache.py``) each
image and video is looked up first and only the misses are encoded. ``encoder_outputs`` hands a pass's
features to the backbone in placeholder order.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from d3stream.runtime.cache import Entry, MediaFeatureCache, tensor_bytes
from d3stream.runtime.device import to_device
from d3stream.runtime.kinds import MEDIA_KINDS, MediaKind
from d3stream.runtime.loading import Checkpoint
from d3stream.runtime.rows import Features, RequestMedia, Row

if TYPE_CHECKING:
    import torch

# Vision patches (before the 2x2 merge) one call of the vision tower may take when it encodes the images or
# videos of many requests of a pass together: bounds the tower's activations as max_batch_tokens bounds the
# backbone's. A 1280x1280 image is 6,400 patches; the largest image the processor makes, 16,384.
DEFAULT_MEDIA_BATCH_PATCHES = 32768

# One image or video to encode: its patches and its [t, h, w] grid row.
Item = tuple["torch.Tensor", "torch.Tensor"]
# One encoded item: its merged features and, for Qwen3-VL, its deepstack features (one per layer).
Encoded = tuple["torch.Tensor", "list[torch.Tensor] | None"]


class TowerOutput(Protocol):
    """What the backbone's ``get_image_features`` / ``get_video_features`` return with ``return_dict=True``: the
    merged features of each item (transformers annotates them as one tensor; they come split per item). Qwen3-VL's
    also carries ``deepstack_features``, read where present."""

    @property
    def pooler_output(self) -> Sequence[torch.Tensor]: ...


def split_media(pixels: torch.Tensor, grids: torch.Tensor) -> list[Item]:
    """A request's stacked patches cut per image (or video): (its patches, its grid row), in order."""
    items, start = [], 0
    for grid in grids:
        count = int(grid.prod())
        items.append((pixels[start : start + count], grid))
        start += count
    return items


def patch_groups(grids: Sequence[torch.Tensor], budget: int) -> list[list[int]]:
    """Indices of ``grids`` cut, in order, into groups of at most ``budget`` patches (an item larger than
    the budget alone)."""
    groups: list[list[int]] = []
    patches = 0
    for number, grid in enumerate(grids):
        count = int(grid.prod())
        if groups and patches + count <= budget:
            groups[-1].append(number)
            patches += count
        else:
            groups.append([number])
            patches = count
    return groups


def _deepstack(stacks: Sequence[list[torch.Tensor] | None]) -> list[list[torch.Tensor]] | None:
    """Per-item deepstack features regrouped per layer; None when the tower has none (Qwen3.5)."""
    present = [stack for stack in stacks if stack is not None]
    if not present:
        return None
    return [[stack[layer] for stack in present] for layer in range(len(present[0]))]


class VisionEncoder:
    """Runs the vision tower over the media of a pass, through the feature cache when there is one."""

    def __init__(self, checkpoint: Checkpoint, *, media_batch_patches: int = DEFAULT_MEDIA_BATCH_PATCHES):
        self.checkpoint = checkpoint
        # Vision patches per call of the vision tower when the media of many requests in one pass are encoded
        # together (``encode``); 0 encodes each request's media on its own.
        self.media_batch_patches = int(media_batch_patches)
        # Optional bounded cache of vision-tower features (``runtime/cache.py``); None: encode per request.
        self.media_cache: MediaFeatureCache | None = None

    def _tower(self, kind: str) -> Callable[..., TowerOutput]:
        """The backbone's encoder of one media kind (``get_image_features`` / ``get_video_features``)."""
        backbone = self.checkpoint.backbone
        return backbone.get_image_features if kind == "image" else backbone.get_video_features

    def encode(self, medias: Sequence[RequestMedia]) -> None:
        """Set ``features`` on every request media of a pass that has none, running the vision tower over
        the images (and the videos) of all of them together, ``media_batch_patches`` patches per call.

        One call for the images of many small requests instead of one each: the tower's per-call cost
        (kernel launches, rotary tables, cu_seqlens) is paid once, and its matrix products are wider. With a
        cache, an image in two requests of the pass is encoded once.
        """
        pending = list({id(m): m for m in medias if m.features is None}.values())
        if not pending:
            return
        if self.media_batch_patches <= 0:
            for media in pending:  # one request at a time (the reference behaviour)
                media.features = self._encode_one_request(media)
            return
        # Set on the requests only once every call succeeded: a failing pass (split and retried by the
        # scheduler) must not leave a request with half of its features.
        made: dict[int, dict[str, Features]] = {id(media): {} for media in pending}
        for kind in MEDIA_KINDS:
            users = [m for m in pending if kind.pixels_input in m.inputs]
            if users:
                for media, features in zip(users, self._encode_kind(kind, users), strict=True):
                    made[id(media)][kind.name] = features
        for media in pending:
            media.features = made[id(media)]

    def _encode_kind(self, kind: MediaKind, users: list[RequestMedia]) -> list[Features]:
        """The features of one kind of media for each of ``users``: cached items looked up, the others encoded
        in groups of at most ``media_batch_patches`` patches."""
        cache = self.media_cache
        # Every item of the pass under one key: its cache key, or its place (never looked up or kept) when there
        # is no cache or the request was prepared without content digests.
        item_keys: list[list[str]] = []
        cached: set[str] = set()
        for n, media in enumerate(users):
            keys = cache.keys(self.checkpoint, media, kind.name) if cache is not None else None
            if keys is None:
                keys = [f"{n}/{i}" for i in range(len(media.inputs[kind.grid_input]))]
            else:
                cached.update(keys)
            item_keys.append(keys)
        found: dict[str, Entry] = {}
        missing: dict[str, Item] = {}  # key -> an item to encode
        for media, keys in zip(users, item_keys, strict=True):
            items = split_media(media.inputs[kind.pixels_input], media.inputs[kind.grid_input])
            for key, item in zip(keys, items, strict=True):
                if key in found or key in missing:
                    continue  # the same media twice in the pass: encoded (or looked up) once
                entry = cache.get(key) if cache is not None and key in cached else None
                if entry is None:
                    missing[key] = item
                else:
                    found[key] = entry
        found.update(self._encode_missing(kind.name, missing, cached))
        made = []
        for keys in item_keys:
            entries = [found[key] for key in keys]
            made.append(Features([entry.pooled for entry in entries], _deepstack([e.deepstack for e in entries])))
        return made

    def _encode_missing(self, kind: str, missing: dict[str, Item], cached: set[str]) -> dict[str, Entry]:
        """Encode the items under ``missing`` in patch-budget groups; each one's entry, also put in the cache
        when its key is a cache key (in ``cached``)."""
        cache = self.media_cache
        keys_to_encode = list(missing)
        encoded: dict[str, Entry] = {}
        for group in patch_groups([missing[k][1] for k in keys_to_encode], self.media_batch_patches):
            chosen = [keys_to_encode[g] for g in group]
            outputs = self._encode_items(kind, [missing[k] for k in chosen])
            for key, (pooled, layers) in zip(chosen, outputs, strict=True):
                size = tensor_bytes(pooled) + sum(tensor_bytes(t) for t in layers or [])
                entry = Entry(pooled, layers, size)
                encoded[key] = entry
                if cache is not None and key in cached:
                    cache.put(key, entry)
                    cache.encoded += 1
        return encoded

    def _encode_items(self, kind: str, items: Sequence[Item]) -> list[Encoded]:
        """One vision-tower call over ``items``; per item its merged features and, for Qwen3-VL, its
        deepstack features (copies when the call held several items, so a cached entry does not keep the
        whole call's output alive)."""
        import torch

        pixels = torch.cat([item[0] for item in items])
        grids = torch.stack([item[1] for item in items])
        pixels, grids = to_device([pixels, grids], self.checkpoint.device)
        output = self._tower(kind)(pixels, grids, return_dict=True)
        deep = getattr(output, "deepstack_features", None)  # Qwen3-VL's; None or absent for Qwen3.5
        several = len(items) > 1
        results: list[Encoded] = []
        for position, pooled in enumerate(output.pooler_output):
            layers = None if deep is None else [layer[position] for layer in deep]
            if several:
                pooled = pooled.clone()
                layers = None if layers is None else [t.clone() for t in layers]
            results.append((pooled, layers))
        return results

    def _encode_one_request(self, media: RequestMedia) -> dict[str, Features]:
        """The features of one request's media, all its images in one call (``media_batch_patches`` = 0)."""
        if self.media_cache is not None and media.contents is not None:
            return self.media_cache.request_features(self.checkpoint, media)
        features: dict[str, Features] = {}
        device = self.checkpoint.device
        for kind in MEDIA_KINDS:
            if kind.pixels_input not in media.inputs:
                continue
            pixels, grid = media.inputs[kind.pixels_input], media.inputs[kind.grid_input]
            output = self._tower(kind.name)(pixels.to(device), grid.to(device), return_dict=True)
            deep = getattr(output, "deepstack_features", None)  # Qwen3-VL feeds them into its first layers too
            features[kind.name] = Features(
                list(output.pooler_output), None if deep is None else [list(layer) for layer in deep]
            )
        return features

    def encoder_outputs(self, rows: Sequence[Row]) -> dict[str, types.SimpleNamespace] | None:
        """The vision features of every media row of a pass, in row order (placeholder order), as the
        backbone's ``mm_encoder_outputs``; None for a pass without media."""
        gathered: dict[str, types.SimpleNamespace] = {}
        for kind in ("image", "video"):
            pooled: list[torch.Tensor] = []
            deep: list[list[torch.Tensor]] | None = None
            for row in rows:
                features = None if row.media is None or row.media.features is None else row.media.features.get(kind)
                if features is None:
                    continue
                pooled += features.pooled
                if features.deepstack is not None:
                    deep = deep or [[] for _ in features.deepstack]
                    for collected, layer in zip(deep, features.deepstack, strict=True):
                        collected += layer
            if pooled:
                gathered[kind] = types.SimpleNamespace(pooler_output=pooled, deepstack_features=deep)
        return gathered or None
