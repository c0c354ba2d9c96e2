"""The D3 model: load a code-readout checkpoint, prepare requests into rows, run rows, answer.

The work is cut into stages the streaming service can schedule on its own:

1. ``prepare`` validates one request, decodes its media, renders one prompt per question and tokenizes
   it. It touches no weights; the result is a ``Prepared`` request holding one ``Row`` per prompt
   (plus the per-question errors).
2. ``forward`` runs any list of rows, **from any requests**, as one left-padded forward pass and
   returns each row's option probabilities. Media features are computed once per request, the first
   time one of its rows runs, and reused by its other rows.
3. ``Prepared.answers`` turns the probabilities of its rows into the response object.

``system_one`` strings the three together for one request, ``batch_size`` questions per pass, as the
reference runtime does. Every row runs with position ids counted from its own first real token, so a
question gives the same probabilities alone or inside a mixed, padded batch (within bf16 tolerance).

Numerics follow the specification: BF16 backbone with SDPA attention, FP32 readout and softmax, the
checkpoint's temperature. ``noncausal_full_attention`` (Qwen3.5 only) lets the full-attention layers
read the whole prompt of their row while the Gated DeltaNet layers keep their causal scan.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from d3stream.runtime import format as builtin_format
from d3stream.runtime import media as media_io
from d3stream.runtime.package import sha256_file, verify_package
from d3stream.runtime.questions import (
    Question,
    answer_object,
    average_orders,
    normalize_question,
    question_error,
    require_json,
    reversed_question,
)

RUNTIME = "d3-runtime/1"
FORMAT_VERSION = 1
PROMPTS = ("d3",)
ATTENTION_MODES = ("causal", "noncausal_full_attention")
BACKBONES = ("qwen3_5", "qwen3_vl")
DEFAULT_BATCH_SIZE = 8
# A pass carrying both option orders (permutation_average) above this many padded tokens is split in two,
# so peak memory stays that of the original order.
MERGE_TOKENS = 8192
# Bytes a rendered prompt adds to the request's own text at most (system turn, headers, option codes'
# punctuation): generous, it only decides whether a request is cheap enough to skip a token estimate.
PROMPT_OVERHEAD_BYTES = 2048
# Vision patches (before the 2x2 merge) one call of the vision tower may take when it encodes the images or
# videos of many requests of a pass together: bounds the tower's activations as max_batch_tokens bounds the
# backbone's. A 1280x1280 image is 6,400 patches; the largest image the processor makes, 16,384.
DEFAULT_MEDIA_BATCH_PATCHES = 32768
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"


# ------------------------------------------------------------------------------------------ checkpoint


def load_file_module(path: Path) -> types.ModuleType:
    """Import a single-file module by path, once per file content (two checkpoints may share a process,
    and a file edited in place must not be served from the copy imported before the edit)."""
    import importlib.util
    import sys

    path = Path(path).absolute()
    identity = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    name = f"d3_format_{identity}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, str(path))
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def prompt_contract(root: Path) -> types.ModuleType:
    """The checkpoint's own ``d3_format.py`` when it ships one, else the built-in contract."""
    path = Path(root) / "d3_format.py"
    return load_file_module(path) if path.is_file() else builtin_format


def backbone_type(root: Path) -> str:
    """``model_type`` of the checkpoint's ``config.json``: ``qwen3_5`` or ``qwen3_vl``."""
    kind = json.loads((Path(root) / "config.json").read_text(encoding="utf-8")).get("model_type")
    if kind not in BACKBONES:
        raise ValueError(f"unsupported backbone model_type {kind!r}; expected one of {', '.join(BACKBONES)}")
    return kind


def backbone_class(kind: str) -> Any:
    if kind == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

        return Qwen3VLModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    return Qwen3_5Model


def vision_weights_present(root: Path) -> bool:
    """True when the checkpoint stores a vision tower (``visual.*`` tensors)."""
    index = Path(root) / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    else:
        from safetensors import safe_open

        names = []
        for path in sorted(Path(root).glob("model*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                names += list(handle.keys())
    return any(name.startswith(("visual.", "model.visual.")) for name in names)


@contextlib.contextmanager
def quiet_transformers() -> Iterable[None]:
    """Silence transformers' loading chatter (progress bars, the report of vision weights a text-only
    checkpoint leaves out on purpose); real errors still raise."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def sdpa_backends(device: Any) -> contextlib.AbstractContextManager:
    """On CUDA, keep SDPA off the cuDNN backend (``D3_CUDNN_SDPA=1`` restores PyTorch's choice)."""
    import torch

    if torch.device(device).type != "cuda" or not torch.version.cuda or os.environ.get("D3_CUDNN_SDPA") == "1":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def host_transfer(device: Any) -> tuple[bool, bool]:
    """(pin, non_blocking) for copying host tensors to ``device``: on CUDA the batch is built in pinned
    (page-locked) memory and copied without blocking the host, so the next pass's preparation overlaps the
    copy; elsewhere both are pointless (a CPU "copy" is a no-op, and pinning needs a CUDA driver)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return cuda, cuda


def to_device(tensors: Sequence[Any], device: Any) -> tuple[Any, ...]:
    """``tensors`` on ``device``, through pinned memory with non-blocking copies where that pays
    (``host_transfer``). PyTorch's caching host allocator keeps a pinned buffer alive until its copy is done."""
    pin, non_blocking = host_transfer(device)
    return tuple((t.pin_memory() if pin else t).to(device, non_blocking=non_blocking) for t in tensors)


def bucketed_width(width: int) -> int:
    """``width`` rounded up to a length bucket: the next multiple of an eighth of the power of two at or
    below it, at least 16 (so 300 -> 320, 1000 -> 1024, 2100 -> 2304): at most 1/8 more padding, and a few
    dozen distinct widths up to 8k instead of every length."""
    if width <= 16:
        return 16
    step = max(16, (1 << (width.bit_length() - 1)) // 8)
    return -(-width // step) * step


# The Gated DeltaNet functions of transformers' qwen3_5 modeling that a kernel package may replace: at import,
# transformers binds each to flash-linear-attention (``fla``, PyPI ``fla-core``) or ``causal_conv1d`` when
# that package imports, else to its own PyTorch code ("correct but much slower", its warning says).
GATED_DELTANET_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",  # prefill: the chunked delta-rule scan (fla)
    "torch_recurrent_gated_delta_rule",  # one token on cached states (fla)
    "causal_conv1d_fn",  # the short depthwise convolution before the scan (causal_conv1d)
    "causal_conv1d_update",  # its one-token form on a cached conv state (causal_conv1d)
)
REFERENCE_KERNEL = "torch-reference"


def kernel_report() -> dict[str, str]:
    """Which implementation transformers bound for each Gated DeltaNet op: ``module.function`` of a kernel
    package (``fla...``, ``causal_conv1d...``, hub ``kernels...``) or ``torch-reference``.

    transformers wraps each function in a closure over the implementation it picked; the closures are
    walked rather than the packages imported here, so the report says what really runs, not what is installed.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    def bound(function: Any) -> str:
        seen, stack = set(), [function]
        while stack:
            current = stack.pop()
            if id(current) in seen or not callable(current):
                continue
            seen.add(id(current))
            module = getattr(current, "__module__", "") or ""
            if module.startswith(("fla", "causal_conv1d", "kernels")):
                return f"{module}.{getattr(current, '__name__', '?')}"
            for cell in getattr(current, "__closure__", None) or ():
                with contextlib.suppress(ValueError):
                    stack.append(cell.cell_contents)
        return REFERENCE_KERNEL

    return {name: bound(getattr(qwen, name)) for name in GATED_DELTANET_FUNCTIONS if hasattr(qwen, name)}


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Run transformers' reference PyTorch code for every Gated DeltaNet op for the duration, whatever kernel
    package it bound: the fast kernels' check (``bench.kernel_check``) answers the same requests both ways
    with the same weights in one process. The model code calls these functions by their module-level
    names, and ``functools.wraps`` leaves the reference under each wrapper's ``__wrapped__``."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    saved = {name: getattr(qwen, name) for name in GATED_DELTANET_FUNCTIONS if hasattr(qwen, name)}
    try:
        for name, function in saved.items():
            setattr(qwen, name, inspect.unwrap(function))
        yield
    finally:
        for name, function in saved.items():
            setattr(qwen, name, function)


def kernel_path(kernels: Mapping[str, str]) -> str:
    """``fast`` when every op runs a kernel package, ``reference`` when none does, else ``mixed``;
    ``none`` for a backbone without Gated DeltaNet layers (an empty report)."""
    if not kernels:
        return "none"
    fast = [implementation != REFERENCE_KERNEL for implementation in kernels.values()]
    return "fast" if all(fast) else "reference" if not any(fast) else "mixed"


def _patch_embed_as_matmul(self: Any, hidden_states: Any) -> Any:
    import torch.nn.functional as F

    weight = self.proj.weight
    flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(flat, weight.reshape(weight.shape[0], -1), self.proj.bias).view(-1, self.embed_dim)


def linearize_patch_embed(model: Any) -> int:
    """Run each vision patch embedding as the matrix product it equals; returns how many were found.

    The embedding is a Conv3d whose kernel equals its stride over inputs already cut into patches: a
    linear map of each flattened patch. Some convolution backends search a new kernel for every new
    patch count, which would stall on each new image size; the product has no such cost.
    """
    import torch

    count = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if (
            isinstance(proj, torch.nn.Conv3d)
            and tuple(proj.kernel_size) == tuple(proj.stride)
            and hasattr(module, "embed_dim")
        ):
            module.forward = types.MethodType(_patch_embed_as_matmul, module)
            count += 1
    return count


def _split_media(pixels: Any, grids: Any) -> list[tuple[Any, Any]]:
    """A request's stacked patches cut per image (or video): (its patches, its grid row), in order."""
    items, start = [], 0
    for grid in grids:
        count = int(grid.prod())
        items.append((pixels[start : start + count], grid))
        start += count
    return items


def _patch_groups(grids: Sequence[Any], budget: int) -> list[list[int]]:
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


# ------------------------------------------------------------------------------------ prepared requests


@dataclass
class RequestMedia:
    """The images and videos of one request, processed once and shared by all of its rows."""

    images: list[Any]
    videos: list[media_io.Video]
    inputs: dict[str, Any]  # pixel_values / image_grid_thw / pixel_values_videos / video_grid_thw
    image_slots: list[list[int]]  # token ids that replace each image placeholder
    video_slots: list[list[int]]  # token ids that replace each video placeholder
    features: dict[str, Any] | None = None  # vision-tower output, filled the first time a row runs

    @property
    def visual_tokens(self) -> int:
        return sum(map(len, self.image_slots)) + sum(map(len, self.video_slots))


@dataclass(eq=False)
class Row:
    """One prompt ready to run: a question (or its reversed-option twin) of one request."""

    key: str
    ids: list[int]
    options: int
    media: RequestMedia | None = None
    positions: Any = None  # [3, length] multimodal RoPE positions; None means 0..length-1
    reversed: bool = False
    # The rendered prompt text (media placeholders unexpanded), kept for shared-prefix reuse
    # (``runtime/prefix.py`` splits it at the question header); None for rows built by hand.
    text: str | None = None

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass
class Prepared:
    """A validated, tokenized request: its rows (question prompts) and per-question errors."""

    keys: list[str]
    model_name: str
    questions: dict[str, Question] = field(default_factory=dict)
    errors: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    media: RequestMedia | None = None
    contract: Any = builtin_format

    @property
    def input_tokens(self) -> int:
        return sum(row.length for row in self.rows)

    def answers(self, probabilities: Mapping[Row, Sequence[float]]) -> dict[str, Any]:
        """The response ``{"model", "answers", "usage"}`` from the probabilities of every row."""
        merged: dict[str, Sequence[float]] = {}
        twins: list[Row] = []  # reversed-option rows, averaged in once their originals are in
        tokens = 0
        for row in self.rows:
            tokens += len(row.ids)
            if row.reversed:
                twins.append(row)
            else:
                merged[row.key] = probabilities[row]
        for row in twins:
            merged[row.key] = average_orders(merged[row.key], probabilities[row])
        answers: dict[str, Any] = {}
        errors, questions, contract = self.errors, self.questions, self.contract
        for key in self.keys:
            if key in errors:
                answers[key] = errors[key]
                continue
            question = questions[key]
            try:
                answers[key] = answer_object(question, merged[key], contract=contract)
            except ValueError as exc:
                answers[key] = question_error(question, "invalid_model_output", str(exc))
        return {"model": self.model_name, "answers": answers, "usage": {"input_tokens": tokens, "output_tokens": 0}}


# -------------------------------------------------------------------------------------------- the model


class D3:
    """A loaded code-readout checkpoint answering System One requests."""

    def __init__(
        self,
        root: Path,
        *,
        device: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        manifest: dict[str, Any] | None = None,
        max_length: int | None = None,
        readout_dtype: str | None = None,
        model_name: str | None = None,
        permutation_average: bool = False,
        media_batch_patches: int = DEFAULT_MEDIA_BATCH_PATCHES,
        pad_buckets: bool = False,
    ):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        started = time.perf_counter()
        self.torch = torch
        self.root = Path(root)
        self.manifest = manifest
        self.contract = prompt_contract(self.root)
        config_file = self.root / "decision_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{config_file.name} must hold a JSON object")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{config_file.name} has format_version {config.get('format_version')!r}; "
                f"this runtime reads version {FORMAT_VERSION}"
            )
        self.config = config
        self.backbone_type = backbone_type(self.root)
        for key, default, allowed in (
            ("prompt", "d3", PROMPTS),
            ("attention_mode", "causal", ATTENTION_MODES),
            ("pooling", "last", ("last",)),
        ):
            if config.get(key, default) not in allowed:
                raise ValueError(
                    f"{config_file.name}: {key} must be one of {', '.join(allowed)}, got {config.get(key)!r}"
                )
        self.prompt = config.get("prompt", "d3")
        self.attention_mode = config.get("attention_mode", "causal")
        if self.attention_mode == "noncausal_full_attention" and self.backbone_type != "qwen3_5":
            raise ValueError(
                f"{self.attention_mode} needs a qwen3_5 backbone; this checkpoint is {self.backbone_type}"
            )
        self.temperature = float(config.get("temperature", 1.0))
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"{config_file.name}: temperature must be finite and positive, got {self.temperature}")
        self.readout_dtype = readout_dtype or config.get("readout_dtype", "float32")
        if self.readout_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"readout_dtype must be float32 or bfloat16, got {self.readout_dtype!r}")
        limit = config.get("max_length") if max_length is None else max_length
        self.max_length = int(limit) if limit else None
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        self.model_name = model_name or (manifest or {}).get("model_name") or self.root.name
        self.permutation_average = bool(permutation_average)
        # Vision patches per call of the vision tower when the media of many requests in one pass are encoded
        # together (``_encode_pass_media``); 0 encodes each request's media on its own.
        self.media_batch_patches = int(media_batch_patches)
        # Round each pass's padded width up to a length bucket (``bucketed_width``); off by default: on the
        # CPU it did not pay (bench/README.md, "Shape buckets").
        self.pad_buckets = bool(pad_buckets)

        # A vision checkpoint's processor carries the same tokenizer: load it once (it is 33 MB of BPE).
        self.has_vision_weights = vision_weights_present(self.root)
        self.processor = None
        processor_error: str | None = None
        if self.has_vision_weights:
            try:
                self.processor = self._load_processor()
            except Exception as exc:  # noqa: BLE001 - text requests do not need the processor
                processor_error = f"the image processor failed to load ({type(exc).__name__}: {exc})"
        if self.processor is not None:
            self.tokenizer = self.processor.tokenizer
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.root))
        self.tokenizer.padding_side = "left"
        codes, token_ids = self.contract.answer_codes(self.tokenizer)
        if config.get("codes") != codes or config.get("token_ids") != token_ids:
            raise ValueError(
                f"the answer codes or token ids in {config_file.name} differ from the ones this tokenizer gives"
            )
        self.codes, self.token_ids = codes, token_ids
        probe = "State:\nA"
        if self.tokenizer(probe)["input_ids"] != self.tokenizer(probe, add_special_tokens=False)["input_ids"]:
            raise ValueError("the tokenizer adds special tokens; prompts must be tokenized exactly as rendered")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has no pad token")
        vocabulary = self.tokenizer.get_vocab()
        self.image_token_id = vocabulary.get(IMAGE_TOKEN)
        self.video_token_id = vocabulary.get(VIDEO_TOKEN)
        # Every added token (special or not: <|im_start|>, <|im_end|>, <think>, the vision tokens, ...). In
        # text from a request they are plain text, never control tokens (``_user_text_as_text``).
        self.added_token_ids = frozenset(int(i) for i in self.tokenizer.get_added_vocab().values())
        self._template_added: dict[tuple[int, int], list[int]] = {}
        # Most prompt tokens summed over one request's prompts (``limit_request_tokens``); None: no limit.
        self.max_request_tokens: int | None = None

        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.kernels = kernel_report() if self.backbone_type == "qwen3_5" else {}
        if self.device.type == "cpu" and any(v.startswith(("fla", "causal_conv1d")) for v in self.kernels.values()):
            raise RuntimeError(
                "flash-linear-attention / causal-conv1d kernels are GPU-only; run on a GPU or use an "
                "environment without them for CPU inference"
            )
        torch.manual_seed(20260919)
        with quiet_transformers():
            self.backbone = backbone_class(self.backbone_type).from_pretrained(
                str(self.root),
                dtype=torch.bfloat16,
                attn_implementation="sdpa",
                device_map={"": str(self.device)},
            )
        self.backbone.eval().requires_grad_(False)
        weight = load_file(str(self.root / "readout.safetensors")).get("weight")
        hidden = self.backbone.config.text_config.hidden_size
        if weight is None or tuple(weight.shape) != (self.contract.MAX_OPTIONS, hidden):
            shape = None if weight is None else tuple(weight.shape)
            raise ValueError(
                f"readout.safetensors: weight has shape {shape}, expected {(self.contract.MAX_OPTIONS, hidden)}"
            )
        self.readout = weight.to(self.device, getattr(torch, self.readout_dtype))

        self.image_unavailable: str | None = None
        if not self.has_vision_weights:
            self.image_unavailable = "the checkpoint has no vision tower (visual.* weights)"
        elif not linearize_patch_embed(self.backbone):
            self.image_unavailable = "the vision patch embedding was not found"
        elif processor_error is not None:
            self.image_unavailable = processor_error
        self.video_unavailable: str | None = self.image_unavailable
        if self.video_unavailable is None:
            if self.backbone_type != "qwen3_5":
                self.video_unavailable = "video inputs need a Qwen3.5 backbone"
            elif getattr(self.processor, "video_processor", None) is None:
                self.video_unavailable = "the checkpoint has no video processor"
            else:
                try:
                    self._configure_video_processor()
                except Exception as exc:  # noqa: BLE001 - text and image requests do not need it
                    self.video_unavailable = f"the video processor failed to load ({type(exc).__name__}: {exc})"
        # Optional bounded cache of vision-tower features (``runtime/cache.py``); None: encode per request.
        self.media_cache: Any = None
        self.loaded_seconds = time.perf_counter() - started

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        verify: str = "fast",
        max_length: int | None = None,
        readout_dtype: str | None = None,
        model_name: str | None = None,
        permutation_average: bool = False,
    ) -> D3:
        """Load a local checkpoint directory.

        ``verify``: ``fast`` (default) hashes every file of ``MODEL_MANIFEST.json`` up to 64 MiB and checks
        the size of larger ones; ``full`` hashes every file; ``none`` skips the check. A checkpoint without
        a manifest loads unverified. No model hub is consulted: ``path`` must be a directory.
        """
        root = Path(os.fspath(path)).expanduser()
        if not root.is_dir():
            raise ValueError(f"no checkpoint directory at {path} (build one with `d3stream make-checkpoint`)")
        manifest = verify_package(root, verify)
        return cls(
            root,
            device=device,
            batch_size=batch_size,
            manifest=manifest,
            max_length=max_length,
            readout_dtype=readout_dtype,
            model_name=model_name,
            permutation_average=permutation_average,
        )

    def limit_prompt_tokens(self, limit: int | None) -> None:
        """Serve at most ``limit`` tokens per prompt (the tighter of it and the checkpoint's own limit):
        a service must not let one huge state occupy the device for minutes."""
        if limit is not None:
            self.max_length = min(self.max_length or limit, int(limit))

    def limit_request_tokens(self, limit: int | None) -> None:
        """Serve at most ``limit`` prompt tokens summed over one request's prompts (media tokens included);
        a request over it raises ValueError naming ``max_request_tokens`` before any device time."""
        self.max_request_tokens = None if limit is None else int(limit)

    def _load_processor(self) -> Any:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(self.root))
        processor.tokenizer.padding_side = "left"
        processor.image_processor.size = {
            "shortest_edge": media_io.IMAGE_MIN_PIXELS,
            "longest_edge": media_io.IMAGE_MAX_PIXELS,
        }
        return processor

    def _configure_video_processor(self) -> None:
        """Read already-sampled frames at up to 0.2 MP each with the checkpoint's video processor."""
        video = self.processor.video_processor
        factor = video.patch_size * video.merge_size
        video.size = {
            "shortest_edge": media_io.VIDEO_MIN_PIXELS,
            "longest_edge": media_io.VIDEO_MAX_PIXELS * media_io.VIDEO_MAX_FRAMES,
        }
        video.cap_pixels_per_frame = True
        video.max_video_tokens = media_io.VIDEO_MAX_PIXELS // factor**2
        video.do_sample_frames = False

    # -------------------------------------------------------------------------------------- preparing

    def _messages(self, state: Any, question: dict[str, Any], n_images: int, n_videos: int) -> list[dict]:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
        content += [{"type": "video"} for _ in range(n_videos)]
        content.append({"type": "text", "text": self.contract.user_prompt(state, question, self.codes)})
        return [
            {"role": "system", "content": self.contract.SYSTEM_PROMPT},
            {"role": "user", "content": content},
        ]

    def render(self, state: Any, question: dict[str, Any], n_images: int = 0, n_videos: int = 0) -> str:
        """The prompt text of one rendered question (media placeholders unexpanded)."""
        if self.prompt != "d3":
            raise ValueError(f"unknown prompt family {self.prompt!r}")
        if not n_images and not n_videos:
            return self.contract.render(self.tokenizer, state, question, self.codes)
        return self.processor.apply_chat_template(
            self._messages(state, question, n_images, n_videos),
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )

    def load_images(self, images: Sequence[Any], *, strict: bool = False) -> list[Any]:
        """Decode a request's images; ValueError names the image that could not be read."""
        if not images:
            return []
        if self.image_unavailable is not None:
            raise ValueError(f"image inputs are not available: {self.image_unavailable}")
        decoded = []
        for number, value in enumerate(images):
            try:
                decoded.append(media_io.load_image(value, strict=strict))
            except ValueError as exc:
                raise ValueError(f"images[{number}]: {exc}") from exc
        return decoded

    def load_videos(self, videos: Sequence[Any], *, strict: bool = False) -> list[media_io.Video]:
        """Decode and sample a request's videos; ValueError names the video that could not be read."""
        if not videos:
            return []
        if self.video_unavailable is not None:
            raise ValueError(f"video inputs are not available: {self.video_unavailable}")
        decoded = []
        for number, value in enumerate(videos):
            try:
                decoded.append(media_io.load_video(value, strict=strict))
            except ValueError as exc:
                raise ValueError(f"videos[{number}]: {exc}") from exc
        return decoded

    def _process_media(self, images: list[Any], videos: list[media_io.Video]) -> RequestMedia:
        """Resize and patch a request's images and videos once, and plan the tokens each one takes."""
        processor = self.processor
        inputs: dict[str, Any] = {}
        image_slots: list[list[int]] = []
        video_slots: list[list[int]] = []
        if images:
            try:
                processed = processor.image_processor(images=images, return_tensors="pt")
            except ValueError as exc:
                raise ValueError(f"image rejected by the processor: {exc}") from exc
            inputs["pixel_values"] = processed["pixel_values"]
            inputs["image_grid_thw"] = processed["image_grid_thw"]
            merge = processor.image_processor.merge_size**2
            image_slots = [
                [self.image_token_id] * int(grid.prod() // merge) for grid in processed["image_grid_thw"]
            ]
        if videos:
            video_processor = processor.video_processor
            merge = video_processor.merge_size**2
            try:
                planned = sum(
                    video_processor.get_num_of_video_patches(len(v.frames), v.size[1], v.size[0]) for v in videos
                ) // merge
            except ValueError as exc:
                raise ValueError(f"video rejected by the processor: {exc}") from exc
            if planned > media_io.VIDEO_MAX_TOKENS:
                raise ValueError(
                    f"the videos take {planned:,} input tokens, over the {media_io.VIDEO_MAX_TOKENS:,} tokens a "
                    "request may spend on videos; send fewer or shorter videos"
                )
            try:
                processed = dict(
                    video_processor(
                        videos=[v.frames for v in videos],
                        video_metadata=[v.metadata() for v in videos],
                        return_metadata=True,
                        return_tensors="pt",
                    )
                )
            except ValueError as exc:
                raise ValueError(f"video rejected by the processor: {exc}") from exc
            if int(processed["video_grid_thw"].prod(-1).sum()) // merge != planned:
                raise RuntimeError("the video processor and its own token count disagree")
            texts = [processor.replace_video_token(processed, video_idx=i) for i in range(len(videos))]
            video_slots = [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            inputs["pixel_values_videos"] = processed["pixel_values_videos"]
            inputs["video_grid_thw"] = processed["video_grid_thw"]
        return RequestMedia(images, videos, inputs, image_slots, video_slots)

    def _expand(self, ids: list[int], media: RequestMedia) -> list[int]:
        """Token ids with each image and video placeholder replaced by its planned token ids."""
        images, videos = iter(media.image_slots), iter(media.video_slots)
        expanded: list[int] = []
        for token in ids:
            if token == self.image_token_id:
                expanded += next(images)
            elif token == self.video_token_id:
                expanded += next(videos)
            else:
                expanded.append(token)
        return expanded

    def _positions(self, ids: list[int], media: RequestMedia) -> Any:
        """Multimodal RoPE positions [3, length] of one expanded row, as the backbone computes them."""
        torch = self.torch
        tensor = torch.as_tensor([ids], dtype=torch.long)
        kinds = torch.zeros_like(tensor)
        kinds[tensor == self.image_token_id] = 1
        kinds[tensor == self.video_token_id] = 2
        positions, _ = self.backbone.get_rope_index(
            tensor,
            mm_token_type_ids=kinds,
            image_grid_thw=media.inputs.get("image_grid_thw"),
            video_grid_thw=media.inputs.get("video_grid_thw"),
        )
        return positions[:, 0]

    def prepare(
        self,
        state: Any,
        questions: Mapping[str, Any],
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        *,
        strict: bool = False,
        decoded_images: list[Any] | None = None,
        decoded_videos: list[media_io.Video] | None = None,
        permutation_average: bool | None = None,
    ) -> Prepared:
        """Validate, render and tokenize one request; a malformed request raises ValueError.

        ``strict`` reads media as bytes from outside (the service). Callers that decoded the media
        themselves (to time decoding apart) pass ``decoded_images`` / ``decoded_videos`` instead.
        ``permutation_average`` overrides the model's setting for this request.
        """
        averaged = self.permutation_average if permutation_average is None else bool(permutation_average)
        if not isinstance(questions, Mapping) or not questions:
            raise ValueError("questions must be a nonempty mapping of question IDs to questions")
        if any(not isinstance(key, str) or not key for key in questions):
            raise ValueError("question IDs must be nonempty strings")
        require_json(state, "state")
        if images is not None and not isinstance(images, (list, tuple)):
            raise ValueError("images must be a list of images")
        if videos is not None and not isinstance(videos, (list, tuple)):
            raise ValueError("videos must be a list of videos")
        image_list = decoded_images if decoded_images is not None else self.load_images(images or [], strict=strict)
        video_list = decoded_videos if decoded_videos is not None else self.load_videos(videos or [], strict=strict)
        if image_list and self.image_unavailable is not None:
            raise ValueError(f"image inputs are not available: {self.image_unavailable}")
        if video_list and self.video_unavailable is not None:
            raise ValueError(f"video inputs are not available: {self.video_unavailable}")
        request_media = self._process_media(image_list, video_list) if image_list or video_list else None
        n_images, n_videos = len(image_list), len(video_list)

        prepared, prompts = self._render_prompts(state, questions, n_images, n_videos, averaged)
        if not prompts:
            return prepared
        self._refuse_certainly_costly(state, [text for _, _, text, _ in prompts])
        tokenized = self.tokenizer([text for _, _, text, _ in prompts], add_special_tokens=False)["input_ids"]
        for (key, flipped, text, rendered), ids in zip(prompts, tokenized, strict=True):
            if key in prepared.errors:
                continue
            question = prepared.questions[key]
            try:
                ids = self._user_text_as_text(ids, text, state, rendered, n_images, n_videos)
            except ValueError as exc:
                prepared.errors[key] = question_error(question, "invalid_question", str(exc))
                continue
            if ids.count(self.image_token_id) != n_images or ids.count(self.video_token_id) != n_videos:
                # A literal placeholder would pull another prompt's media features into this one.
                prepared.errors[key] = question_error(
                    question,
                    "invalid_question",
                    "the state or question contains a literal image or video placeholder token",
                )
                continue
            positions = None
            if request_media is not None:
                ids = self._expand(ids, request_media)
            if self.max_length is not None and len(ids) > self.max_length:
                which = "reversed-option prompt" if flipped else "question prompt"
                media_note = (
                    f" ({request_media.visual_tokens} for {n_images} image(s) and {n_videos} video(s))"
                    if request_media is not None
                    else ""
                )
                prepared.errors[key] = question_error(
                    question,
                    "max_length_exceeded",
                    f"the {which} has {len(ids)} tokens{media_note}, over the maximum context length of "
                    f"{self.max_length} tokens; nothing was truncated",
                )
                continue
            if request_media is not None:
                positions = self._positions(ids, request_media)
            prepared.rows.append(
                Row(key, ids, question.option_count, request_media, positions, reversed=flipped, text=text)
            )
        # A question refused in either option order is refused whole.
        prepared.rows = [row for row in prepared.rows if row.key not in prepared.errors]
        prepared.media = request_media
        if self.max_request_tokens is not None and prepared.input_tokens > self.max_request_tokens:
            raise ValueError(
                f"the request's prompts have {prepared.input_tokens:,} tokens in all, over max_request_tokens "
                f"({self.max_request_tokens:,}); send fewer questions, a shorter state or fewer media"
            )
        return prepared

    def _render_prompts(
        self, state: Any, questions: Mapping[str, Any], n_images: int, n_videos: int, averaged: bool
    ) -> tuple[Prepared, list[tuple[str, bool, str, dict[str, Any]]]]:
        """The request's validated questions and per-question errors, and its prompts as
        (question id, reversed, text, rendered question), one per question and option order."""
        prepared = Prepared(keys=list(questions), model_name=self.model_name, contract=self.contract)
        prompts: list[tuple[str, bool, str, dict[str, Any]]] = []
        for key, question in questions.items():
            try:
                normalized = normalize_question(question, contract=self.contract)
                rendered = normalized.rendered
                prompts.append((key, False, self.render(state, rendered, n_images, n_videos), rendered))
                flipped = reversed_question(normalized) if averaged else None
                if flipped is not None:
                    prompts.append((key, True, self.render(state, flipped, n_images, n_videos), flipped))
            except ValueError as exc:
                prepared.errors[key] = question_error(question, "invalid_question", str(exc))
                continue
            prepared.questions[key] = normalized
        return prepared, prompts

    # ------------------------------------------------------------------------- request cost (tokens)

    def request_may_exceed_tokens(self, record_bytes: int, questions: int) -> bool:
        """False when a request of ``record_bytes`` JSON bytes and ``questions`` questions certainly stays
        within ``max_request_tokens`` with its text alone (no tokenizer needed: the caller can skip
        ``check_request_tokens``). A prompt renders the request's JSON text at most twice as long (the
        state's separators gain a space) plus the fixed template, each question in two option orders at
        most, and a token is at least one UTF-8 byte."""
        limit = self.max_request_tokens
        return limit is not None and 2 * questions * (2 * record_bytes + PROMPT_OVERHEAD_BYTES) > limit

    def check_request_tokens(
        self, state: Any, questions: Mapping[str, Any], *, permutation_average: bool | None = None
    ) -> None:
        """ValueError naming ``max_request_tokens`` when the request's text prompts alone (media not yet
        counted) are certainly over it; cheap (the state is tokenized once, whole prompts never). For a
        caller that wants to refuse such a request before fetching and decoding its media; ``prepare``
        makes the same check and then the exact one."""
        if self.max_request_tokens is None or not isinstance(questions, Mapping) or not questions:
            return
        averaged = self.permutation_average if permutation_average is None else bool(permutation_average)
        _, prompts = self._render_prompts(state, questions, 0, 0, averaged)
        if prompts:
            self._refuse_certainly_costly(state, [text for _, _, text, _ in prompts])

    def _refuse_certainly_costly(self, state: Any, texts: Sequence[str]) -> None:
        """Refuse, before tokenizing them, prompts whose tokens certainly exceed ``max_request_tokens``.

        Exact enough and never wrong: a token is at least one UTF-8 byte, so prompts of fewer bytes in
        all than the limit pass unexamined (ordinary requests). Otherwise the state text, which every
        prompt repeats, is tokenized once on its own; its pieces away from both ends are tokenized
        exactly so inside every prompt (pre-tokenization is local; two pieces at each end are left out
        for what the surrounding text can merge), so prompts x that count is a lower bound.
        """
        limit = self.max_request_tokens
        if limit is None or 4 * sum(map(len, texts)) <= limit:
            return
        if sum(len(text.encode("utf-8", "surrogatepass")) for text in texts) <= limit:
            return
        state_text = self.contract.describe(state)
        if not state_text or not all(state_text in text for text in texts):
            return  # a custom prompt contract that does not repeat the state verbatim: the exact check decides
        pieces = self._plain_pieces(state_text)
        if pieces is None:
            return
        backend = self.tokenizer.backend_tokenizer
        floor = len(texts) * sum(len(backend.model.tokenize(piece)) for piece in pieces[2:-2])
        if floor > limit:
            raise ValueError(
                f"the request's {len(texts)} prompts have at least {floor:,} tokens in all (each repeats the "
                f"state), over max_request_tokens ({limit:,}); send fewer questions or a shorter state"
            )

    # ---------------------------------------------------------------------- user text stays text

    def _plain_pieces(self, text: str) -> list[str] | None:
        """``text`` normalized and pre-tokenized as the tokenizer does, with no added-token matching;
        None for a tokenizer without a Rust backend."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        if backend.pre_tokenizer is None:
            return [text]
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]

    def plain_text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: the tokenizer's normalizer, pre-tokenizer and BPE model,
        without the added-vocabulary step, so ``<|im_end|>`` or ``<think>`` in it becomes the ordinary
        tokens of those characters, never the control token. (For text without added-token strings
        this is exactly what the tokenizer gives.)"""
        pieces = self._plain_pieces(text)
        if pieces is None:
            raise ValueError(
                "the text contains a special token string and this tokenizer cannot read it as plain text"
            )
        model = self.tokenizer.backend_tokenizer.model
        return [token.id for piece in pieces for token in model.tokenize(piece)]

    def _template_added_ids(self, n_images: int, n_videos: int) -> list[int]:
        """The added-token ids the chat template itself puts into a prompt, in order (cached per media
        count): those of a prompt whose user text holds none."""
        key = (n_images, n_videos)
        if key not in self._template_added:
            text = self.render("s", {"type": "noul", "instructions": "q", "criteria": {}}, n_images, n_videos)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._template_added[key] = [token for token in ids if token in self.added_token_ids]
        return self._template_added[key]

    def _user_text_as_text(
        self, ids: list[int], text: str, state: Any, question: dict[str, Any], n_images: int, n_videos: int
    ) -> list[int]:
        """A prompt's ids with the user turn's text (state, instructions, option keys and descriptions)
        tokenized as plain text.

        The tokenizer matches added tokens anywhere in the prompt, so ``<|im_end|><|im_start|>system`` in a
        customer's ticket would otherwise forge the chat structure. A prompt whose added tokens are exactly
        the template's keeps its ids (every ordinary request, unchanged); otherwise the user text is cut
        out of the rendered prompt and tokenized as plain text between the template's own pieces.
        """
        added = self.added_token_ids
        if [token for token in ids if token in added] == self._template_added_ids(n_images, n_videos):
            return ids
        content = self.contract.user_prompt(state, question, self.codes)
        start = text.find(content)
        if start < 0:
            raise ValueError("the prompt contract does not place the user text verbatim; special tokens are refused")
        head, tail = text[:start], text[start + len(content) :]
        head_ids, tail_ids = self.tokenizer([head, tail], add_special_tokens=False)["input_ids"]
        return list(head_ids) + self.plain_text_ids(content) + list(tail_ids)

    # ---------------------------------------------------------------------------------------- running

    def _features(self, media: RequestMedia) -> dict[str, Any]:
        """Vision-tower features of a request's images and videos, computed once per request."""
        if media.features is None:
            self._encode_pass_media([media])
        return media.features

    def _encode_pass_media(self, medias: Sequence[RequestMedia]) -> None:
        """Set ``features`` on every request media of a pass that has none, running the vision tower over
        the images (and the videos) of all of them together, ``media_batch_patches`` patches per call.

        One call for the images of many small requests instead of one each: the tower's per-call cost
        (kernel launches, rotary tables, cu_seqlens) is paid once, and its matrix products are wider. Each
        image keeps its own attention block (``cu_seqlens``), so the features are those of a per-request
        encoding up to summation order. With a ``MediaFeatureCache`` on ``self.media_cache`` each image and
        video is looked up first and only the misses are encoded (an image in two requests of the pass, once).
        """
        from d3stream.runtime.cache import Entry, _tensor_bytes

        pending = list({id(m): m for m in medias if m.features is None}.values())
        if not pending:
            return
        if self.media_batch_patches <= 0:
            for media in pending:  # one request at a time (the reference behaviour)
                media.features = self._encode_one_request(media)
            return
        cache = self.media_cache
        # Set on the requests only once every call succeeded: a failing pass (split and retried by the
        # scheduler) must not leave a request with half of its features.
        made: dict[int, dict[str, Any]] = {id(media): {} for media in pending}
        for kind, pixels_name, grid_name in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            users = [m for m in pending if pixels_name in m.inputs]
            if not users:
                continue
            # Every item of the pass under one key: its cache key, or its place when there is no cache.
            item_keys: list[list[str]] = [
                cache.keys(self, m, kind) if cache is not None else [f"{n}/{i}" for i in range(len(m.inputs[grid_name]))]
                for n, m in enumerate(users)
            ]
            found: dict[str, Entry] = {}
            missing: dict[str, tuple[Any, Any]] = {}  # key -> (pixels, grid row) of an item to encode
            for media, keys in zip(users, item_keys, strict=True):
                items = _split_media(media.inputs[pixels_name], media.inputs[grid_name])
                for key, item in zip(keys, items, strict=True):
                    if key in found or key in missing:
                        continue  # the same media twice in the pass: encoded (or looked up) once
                    entry = cache.get(key) if cache is not None else None
                    if entry is None:
                        missing[key] = item
                    else:
                        found[key] = entry
            keys_to_encode = list(missing)
            for group in _patch_groups([missing[k][1] for k in keys_to_encode], self.media_batch_patches):
                chosen = [keys_to_encode[g] for g in group]
                outputs = self._encode_items(kind, [missing[k] for k in chosen])
                for key, (pooled, layers) in zip(chosen, outputs, strict=True):
                    size = _tensor_bytes(pooled) + sum(_tensor_bytes(t) for t in layers or [])
                    entry = Entry(pooled, layers, size)
                    found[key] = entry
                    if cache is not None:
                        cache.put(key, entry)
                        cache.encoded += 1
            for media, keys in zip(users, item_keys, strict=True):
                entries = [found[key] for key in keys]
                features = made[id(media)]
                features[kind] = [entry.pooled for entry in entries]
                if entries[0].deepstack is not None:
                    layers = range(len(entries[0].deepstack))
                    features[f"{kind}_deepstack"] = [[e.deepstack[layer] for e in entries] for layer in layers]
        for media in pending:
            media.features = made[id(media)]

    def _encode_items(self, kind: str, items: Sequence[tuple[Any, Any]]) -> list[tuple[Any, list[Any] | None]]:
        """One vision-tower call over ``items`` (each: its patches and its [t, h, w] grid row); per item its
        merged features and, for Qwen3-VL, its deepstack features (copies when the call held several items,
        so a cached entry does not keep the whole call's output alive)."""
        torch = self.torch
        pixels = torch.cat([item[0] for item in items])
        grids = torch.stack([item[1] for item in items])
        encode = self.backbone.get_image_features if kind == "image" else self.backbone.get_video_features
        pixels, grids = to_device([pixels, grids], self.device)
        output = encode(pixels, grids, return_dict=True)
        deep = getattr(output, "deepstack_features", None)
        several = len(items) > 1
        results = []
        for position, pooled in enumerate(output.pooler_output):
            layers = None if deep is None else [layer[position] for layer in deep]
            if several:
                pooled = pooled.clone()
                layers = None if layers is None else [t.clone() for t in layers]
            results.append((pooled, layers))
        return results

    def _encode_one_request(self, media: RequestMedia) -> dict[str, Any]:
        """The features of one request's media, all its images in one call (``media_batch_patches`` = 0)."""
        if self.media_cache is not None:
            return self.media_cache.request_features(self, media)
        features: dict[str, Any] = {}
        backbone, device = self.backbone, self.device
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            if pixels not in media.inputs:
                continue
            encode = backbone.get_image_features if kind == "image" else backbone.get_video_features
            output = encode(media.inputs[pixels].to(device), media.inputs[grid].to(device), return_dict=True)
            features[kind] = list(output.pooler_output)
            deep = getattr(output, "deepstack_features", None)
            if deep is not None:  # Qwen3-VL feeds vision features into its first layers too
                features[f"{kind}_deepstack"] = [list(layer) for layer in deep]
        return features

    def _encoder_outputs(self, rows: Sequence[Row]) -> dict[str, Any] | None:
        """The vision features of every media row of a pass, in row order (placeholder order)."""
        gathered: dict[str, Any] = {}
        for kind in ("image", "video"):
            pooled: list[Any] = []
            deep: list[list[Any]] | None = None
            for row in rows:
                if row.media is None or kind not in (row.media.features or {}):
                    continue
                features = row.media.features
                pooled += features[kind]
                if f"{kind}_deepstack" in features:
                    layers = features[f"{kind}_deepstack"]
                    deep = deep or [[] for _ in layers]
                    for collected, layer in zip(deep, layers, strict=True):
                        collected += layer
            if pooled:
                gathered[kind] = types.SimpleNamespace(pooler_output=pooled, deepstack_features=deep)
        return gathered or None

    def left_padded(self, rows: Sequence[Any]) -> tuple[Any, Any, Any]:
        """Token ids, presence mask and [3, B, L] positions of rows left-padded to the longest, on the
        device, with each row's media features computed (once per request). Rows need ``ids``,
        ``length``, ``positions`` and ``media``."""
        torch = self.torch
        self._encode_pass_media([row.media for row in rows if row.media is not None])
        width = max(row.length for row in rows)
        if self.pad_buckets:
            width = bucketed_width(width)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        present = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((3, len(rows), width), dtype=torch.long)
        for number, row in enumerate(rows):
            start = width - row.length
            ids[number, start:] = torch.as_tensor(row.ids, dtype=torch.long)
            present[number, start:] = 1
            # Positions count from each row's first real token, so padding never shifts them.
            positions[:, number, start:] = torch.arange(row.length) if row.positions is None else row.positions
        return to_device([ids, present, positions], self.device)

    def forward(self, rows: Sequence[Row]) -> list[list[float]]:
        """Option probabilities of each row (cut to its option count), all rows in one left-padded pass.

        Rows may come from any requests and mix text, image and video prompts.
        """
        if not rows:
            return []
        torch = self.torch
        with torch.inference_mode(), sdpa_backends(self.device):
            ids, present, positions = self.left_padded(rows)
            mask: Any = present
            if self.attention_mode == "noncausal_full_attention":
                padded = not bool(present.all())
                mask = {
                    "full_attention": present.bool()[:, None, None, :],
                    "linear_attention": present if padded else None,
                }
            hidden = self.backbone(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                mm_encoder_outputs=self._encoder_outputs(rows),
                use_cache=False,
            ).last_hidden_state[:, -1]
            return self.readout_probabilities(hidden, rows)

    def readout_probabilities(self, hidden: Any, rows: Sequence[Row]) -> list[list[float]]:
        """Option probabilities from the last-position hidden states [rows, hidden] of ``rows``.

        (Split out of ``forward`` unchanged so the shared-prefix path, ``runtime/prefix.py``, reads out
        exactly as a full prompt does.)
        """
        torch = self.torch
        if self.readout_dtype == "float32":
            logits = hidden.float() @ self.readout.T
        else:
            logits = torch.nn.functional.linear(hidden, self.readout).float()
        counts = torch.as_tensor([row.options for row in rows], device=self.device)[:, None]
        invalid = torch.arange(self.contract.MAX_OPTIONS, device=self.device)[None] >= counts
        probabilities = torch.softmax(logits.masked_fill(invalid, float("-inf")) / self.temperature, dim=-1)
        values = probabilities.cpu().tolist()
        return [value[: row.options] for value, row in zip(values, rows, strict=True)]

    def passes(self, prepared: Prepared) -> list[list[Row]]:
        """One request's rows in request order, ``batch_size`` questions per pass.

        A question's reversed-option twin rides in the same pass unless that pass would exceed
        ``MERGE_TOKENS`` padded tokens; then the twins run in a pass of their own.
        """
        originals = [row for row in prepared.rows if not row.reversed]
        twins = {row.key: row for row in prepared.rows if row.reversed}
        planned: list[list[Row]] = []
        for start in range(0, len(originals), self.batch_size):
            chunk = originals[start : start + self.batch_size]
            extra = [twins[row.key] for row in chunk if row.key in twins]
            together = chunk + extra
            if extra and len(together) * max(row.length for row in together) > MERGE_TOKENS:
                planned += [chunk, extra]
            else:
                planned.append(together)
        return planned

    def run(self, prepared: Prepared) -> dict[Row, list[float]]:
        """Probabilities of every row of one request."""
        results: dict[Row, list[float]] = {}
        for rows in self.passes(prepared):
            results.update(zip(rows, self.forward(rows), strict=True))
        return results

    def system_one(
        self,
        *,
        state: Any,
        questions: Mapping[str, Any],
        images: Sequence[Any] | None = None,
        videos: Sequence[Any] | None = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        """Typed choice / noul / score answers about one state: ``{"model", "answers", "usage"}``.

        ``images`` and ``videos`` (any number each) are seen by every question. A question that cannot
        be answered gets ``{"type", "error", "message"}`` with ``error`` one of ``invalid_question``,
        ``max_length_exceeded`` (never truncated) or ``invalid_model_output``; the other questions are
        still answered. A malformed request raises ValueError.
        """
        prepared = self.prepare(state, questions, images, videos, strict=strict)
        return prepared.answers(self.run(prepared))

    def warmup(self, lengths: Iterable[int] = (37, 64, 320, 333, 1000, 1024), images: bool = True) -> float:
        """Run every batch size up to ``batch_size`` (twice that with permutation averaging) at a spread of
        lengths, and a few image requests, so the first real requests do not pay for kernel selection."""
        started = time.perf_counter()
        widest = self.batch_size * (2 if self.permutation_average else 1)
        lengths = list(lengths)
        for size in range(1, widest + 1):
            for length in lengths:
                rows = [
                    Row(
                        "warmup",
                        [self.token_ids[(i + j) % len(self.token_ids)] for j in range(max(8, length - 7 * i))],
                        2,
                    )
                    for i in range(size)
                ]
                self.forward(rows)
        if images and self.image_unavailable is None:
            from PIL import Image

            small = Image.new("RGB", (448, 336), (128, 128, 128))
            large = Image.new("RGB", (1280, 1280), (96, 160, 224))
            for batch in ([small], [large], [large] * 4):
                self.system_one(state="warm-up", questions={"q": {"type": "noul"}}, images=batch)
        self.synchronize()
        return time.perf_counter() - started

    # ---------------------------------------------------------------------------- device and records

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.backbone.parameters()) + self.readout.numel()

    def provenance(self) -> dict[str, Any]:
        """Everything that determines an answer: files, numerics, prompt, media contracts."""
        from importlib.metadata import version

        # The distribution's version, read from its metadata: the runtime names d3stream without importing
        # anything of it outside runtime/.
        __version__ = version("d3stream")

        files = {
            name: sha256_file(self.root / name)
            for name in ("decision_config.json", "readout.safetensors", "config.json", "d3_format.py", "MODEL_MANIFEST.json")
            if (self.root / name).is_file()
        }
        identity = (self.manifest or {}).get("identity", {})
        record = {
            "kind": "d3-code-readout",
            "runtime": RUNTIME,
            "implementation": f"d3stream/{__version__}",
            "model_name": self.model_name,
            "repo_id": (self.manifest or {}).get("repo_id"),
            "model_sha256": identity.get("model_sha256"),
            "format_id": self.config.get("format_id"),
            "backbone": self.backbone_type,
            "prompt": self.prompt,
            "attention_mode": self.attention_mode,
            "pooling": "last",
            "temperature": self.temperature,
            "max_length": self.max_length,
            "readout_dtype": self.readout_dtype,
            "backbone_dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "batch_size": self.batch_size,
            "files_sha256": files,
            "kernels": self.kernel_record(),
            "policy": "One prompt per question; options under single-token answer codes; last-token readout "
            "over the question's codes only; argmax choice; no truncation (over-limit questions are "
            "refused); no option filtering; one fixed prompt for every request; position ids counted "
            "from each prompt's first token, so batching does not change an answer.",
            "images": self.image_contract(),
            "videos": self.video_contract(),
        }
        if self.permutation_average:
            record["permutation_average"] = True
            record["policy"] += (
                " Choice questions with two or more options are also scored with their options in reversed "
                "order, in the same forward passes, and answered with the per-option mean of both distributions."
            )
        return record

    def kernel_record(self) -> dict[str, str]:
        """The Gated DeltaNet kernels this model runs: ``path`` (fast / reference / mixed / none) and the
        implementation bound for each op (``kernel_report``); provenance's ``kernels`` entry and what
        ``Metrics.set_kernels`` publishes."""
        return {"path": kernel_path(self.kernels), **self.kernels}

    def image_contract(self) -> dict[str, Any]:
        """How image inputs are read (or why they are not available)."""
        contract: dict[str, Any] = {
            "supported": self.image_unavailable is None,
            "min_pixels": media_io.IMAGE_MIN_PIXELS,
            "max_pixels": media_io.IMAGE_MAX_PIXELS,
            "placement": "before the text of the user turn, one placeholder per image, request order",
            "patch_embedding": "matrix product (equal to the Conv3d with kernel = stride)",
            "strict": {
                "formats": list(media_io.IMAGE_FORMATS),
                "max_bytes": media_io.MAX_IMAGE_BYTES,
                "max_source_pixels": media_io.MAX_IMAGE_SOURCE_PIXELS,
            },
        }
        if self.processor is not None:
            contract["image_processor"] = type(self.processor.image_processor).__name__
            try:
                import torchvision

                contract["torchvision"] = torchvision.__version__
            except ImportError:
                contract["torchvision"] = None
        if self.image_unavailable is not None:
            contract["unavailable"] = self.image_unavailable
        return contract

    def video_contract(self) -> dict[str, Any]:
        """How video inputs are read (or why they are not available)."""
        contract: dict[str, Any] = {
            "supported": self.video_unavailable is None,
            "fps": media_io.VIDEO_FPS,
            "min_frames": media_io.VIDEO_MIN_FRAMES,
            "max_frames": media_io.VIDEO_MAX_FRAMES,
            "max_pixels_per_frame": media_io.VIDEO_MAX_PIXELS,
            "max_tokens_per_request": media_io.VIDEO_MAX_TOKENS,
            "placement": "after the images, before the text of the user turn, one placeholder per video, "
            "request order; every two frames are one token group after their timestamp",
            "sampling": "source frames spread evenly over the whole video (frame arrays: frames at 2 per second)",
            "strict": {
                "formats": list(media_io.VIDEO_FORMATS),
                "max_bytes": media_io.MAX_VIDEO_BYTES,
                "max_seconds": media_io.MAX_VIDEO_SECONDS,
                "max_source_pixels": media_io.MAX_VIDEO_SOURCE_PIXELS,
            },
        }
        if self.video_unavailable is None:
            contract["video_processor"] = type(self.processor.video_processor).__name__
            import cv2

            contract["opencv"] = cv2.__version__
        else:
            contract["unavailable"] = self.video_unavailable
        return contract

    def runtime_info(self) -> dict[str, Any]:
        import transformers

        torch = self.torch
        info: dict[str, Any] = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(self.device),
            "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "loaded_seconds": round(self.loaded_seconds, 2),
            "parameters": self.parameter_count(),
            "fast_path": {"active": False, "reason": "the ROCm d3_fast path is not part of d3stream"},
        }
        if self.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(self.device)
        return info
