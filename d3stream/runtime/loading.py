"""Loading a D3 checkpoint: its decision config, prompt contract, tokenizer and processor, backbone and readout.

A checkpoint directory is read in a fixed order, each step refusing what it cannot serve before the next,
costlier one runs: the prompt contract (the checkpoint's own ``d3_format.py`` or the built-in one), the
decision config (``decision_config.json``: format version, prompt family, attention mode, temperature,
readout dtype, context length), the tokenizer (from the processor when the checkpoint has a vision tower)
and its answer codes, the device, the BF16 backbone with SDPA attention, the readout matrix, and whether
images and videos can be read. The result is one ``Checkpoint``: what every other part of the model
(``prompts``, ``multimodal``, ``vision``, ``forward``, ``provenance``) reads, and nothing they change but
the tokenizer a caller may swap.

The tokenizer and processor are read once per process for the same files: a second model whose files are
the same (the next version in a rollout, a shadow, a copy of the checkpoint) shares the ones a loaded model
still holds (``SharedTextSides``), instead of parsing 33 MB of BPE again (about 1.7 CPU-seconds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from d3stream.runtime import format as builtin_format
from d3stream.runtime import media as media_io
from d3stream.runtime.device import gpu_only_kernels, kernel_report, linearize_patch_embed
from d3stream.runtime.kinds import PromptContract
from d3stream.runtime.package import Manifest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase, ProcessorMixin
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    # The backbone of a checkpoint, as ``backbone_class`` names it.
    Backbone = Qwen3_5Model | Qwen3VLModel

FORMAT_VERSION = 1
PROMPTS = ("d3",)
ATTENTION_MODES = ("causal", "noncausal_full_attention")
BACKBONES = ("qwen3_5", "qwen3_vl")
READOUT_DTYPES = ("float32", "bfloat16")
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
CONFIG_FILE = "decision_config.json"
SEED = 20260919


# ------------------------------------------------------------------------------------------ files


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


def prompt_contract(root: Path) -> PromptContract:
    """The checkpoint's own ``d3_format.py`` when it ships one, else the built-in contract."""
    path = Path(root) / "d3_format.py"
    return load_file_module(path) if path.is_file() else builtin_format


def backbone_type(root: Path) -> str:
    """``model_type`` of the checkpoint's ``config.json``: ``qwen3_5`` or ``qwen3_vl``."""
    kind = json.loads((Path(root) / "config.json").read_text(encoding="utf-8")).get("model_type")
    if kind not in BACKBONES:
        raise ValueError(f"unsupported backbone model_type {kind!r}; expected one of {', '.join(BACKBONES)}")
    return str(kind)


def backbone_class(kind: str) -> type[Qwen3_5Model] | type[Qwen3VLModel]:
    """The transformers model class of a backbone type (its ``from_pretrained`` loads the weights)."""
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
def quiet_transformers() -> Iterator[None]:
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


# ------------------------------------------------------------------------------------ decision config


@dataclass(frozen=True)
class DecisionConfig:
    """``decision_config.json``, validated, with the load options (readout dtype, context length) applied."""

    raw: dict[str, object]  # the file as read: its codes, token ids and format_id
    backbone_type: str
    prompt: str
    attention_mode: str
    temperature: float
    readout_dtype: str
    max_length: int | None

    @classmethod
    def read(cls, root: Path, *, readout_dtype: str | None = None, max_length: int | None = None) -> DecisionConfig:
        """Read and check a checkpoint's decision config; ValueError names what is wrong."""
        config_file = root / CONFIG_FILE
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{CONFIG_FILE} has format_version {config.get('format_version')!r}; "
                f"this runtime reads version {FORMAT_VERSION}"
            )
        kind = backbone_type(root)
        for key, default, allowed in (
            ("prompt", "d3", PROMPTS),
            ("attention_mode", "causal", ATTENTION_MODES),
            ("pooling", "last", ("last",)),
        ):
            if config.get(key, default) not in allowed:
                raise ValueError(f"{CONFIG_FILE}: {key} must be one of {', '.join(allowed)}, got {config.get(key)!r}")
        attention_mode = config.get("attention_mode", "causal")
        if attention_mode == "noncausal_full_attention" and kind != "qwen3_5":
            raise ValueError(f"{attention_mode} needs a qwen3_5 backbone; this checkpoint is {kind}")
        temperature = float(config.get("temperature", 1.0))
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"{CONFIG_FILE}: temperature must be finite and positive, got {temperature}")
        dtype = readout_dtype or config.get("readout_dtype", "float32")
        if dtype not in READOUT_DTYPES:
            raise ValueError(f"readout_dtype must be float32 or bfloat16, got {dtype!r}")
        limit = config.get("max_length") if max_length is None else max_length
        return cls(config, kind, config.get("prompt", "d3"), attention_mode, temperature, dtype,
                   int(limit) if limit else None)


# ------------------------------------------------------------------------------------------ tokenizer


@dataclass(frozen=True)
class Vocabulary:
    """The token ids the runtime relies on, read from the tokenizer once at load."""

    codes: list[str]  # the answer codes, option by option
    token_ids: list[int]  # their single token ids
    pad_id: int
    image_token_id: int | None
    video_token_id: int | None
    # Every added token (special or not: <|im_start|>, <|im_end|>, <think>, the vision tokens, ...). In text
    # from a request they are plain text, never control tokens (``prompts.UserText``).
    added_token_ids: frozenset[int]

    @classmethod
    def of(
        cls, tokenizer: PreTrainedTokenizerBase, contract: PromptContract, config: Mapping[str, object]
    ) -> Vocabulary:
        """Check ``tokenizer`` against the decision config's answer codes and read its special ids."""
        codes, token_ids = contract.answer_codes(tokenizer)
        if config.get("codes") != codes or config.get("token_ids") != token_ids:
            raise ValueError(
                f"the answer codes or token ids in {CONFIG_FILE} differ from the ones this tokenizer gives"
            )
        probe = "State:\nA"
        if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
            raise ValueError("the tokenizer adds special tokens; prompts must be tokenized exactly as rendered")
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError("the tokenizer has no pad token")
        added_vocabulary = tokenizer.get_added_vocab()
        added = frozenset(int(i) for i in added_vocabulary.values())
        vision = {token: added_vocabulary.get(token) for token in (IMAGE_TOKEN, VIDEO_TOKEN)}
        if None in vision.values():  # not added tokens here: the whole vocabulary (a dict of 250,000: 0.2 s) says
            vocabulary = tokenizer.get_vocab()
            vision = {token: vocabulary.get(token) for token in vision}
        return cls(codes, token_ids, pad_id, vision[IMAGE_TOKEN], vision[VIDEO_TOKEN], added)


def load_processor(root: Path) -> ProcessorMixin:
    """The checkpoint's processor (tokenizer, image and video processors), images sized to the runtime's
    pixel budget."""
    from transformers import AutoProcessor

    processor: ProcessorMixin = AutoProcessor.from_pretrained(str(root))  # the class the checkpoint names
    processor.tokenizer.padding_side = "left"
    processor.image_processor.size = {
        "shortest_edge": media_io.IMAGE_MIN_PIXELS,
        "longest_edge": media_io.IMAGE_MAX_PIXELS,
    }
    return processor


class VideoSettings(Protocol):
    """The settings of a checkpoint's video processor (transformers' ``Qwen3VLVideoProcessor``, for both
    backbones) that the runtime reads and sets. (transformers declares ``cap_pixels_per_frame`` as always
    None, though it takes a bool: the processor itself cannot be the annotation.)"""

    patch_size: int
    merge_size: int
    size: dict[str, int]
    cap_pixels_per_frame: bool | None
    max_video_tokens: int
    do_sample_frames: bool


def configure_video_processor(video: VideoSettings) -> None:
    """Read already-sampled frames at up to 0.2 MP each with the checkpoint's video processor."""
    factor = video.patch_size * video.merge_size
    video.size = {
        "shortest_edge": media_io.VIDEO_MIN_PIXELS,
        "longest_edge": media_io.VIDEO_MAX_PIXELS * media_io.VIDEO_MAX_FRAMES,
    }
    video.cap_pixels_per_frame = True
    video.max_video_tokens = media_io.VIDEO_MAX_PIXELS // factor**2
    video.do_sample_frames = False


# ----------------------------------------------------------------------------------------- checkpoint


@dataclass(eq=False)
class Checkpoint:
    """A checkpoint directory loaded onto a device, as every part of the model reads it."""

    root: Path
    manifest: Manifest | None
    contract: PromptContract  # the prompt contract (d3_format)
    config: DecisionConfig
    processor: ProcessorMixin | None  # vision checkpoints whose processor loaded, else None
    tokenizer: PreTrainedTokenizerBase  # a caller may swap it (tests count its calls)
    vocabulary: Vocabulary
    device: torch.device
    kernels: dict[str, str]  # Gated DeltaNet op -> implementation (``device.kernel_report``)
    backbone: Backbone  # BF16, SDPA, eval mode
    readout: torch.Tensor  # [MAX_OPTIONS, hidden] in the readout dtype, on the device
    # Why image or video inputs cannot be read (None: they can).
    image_unavailable: str | None
    video_unavailable: str | None
    loaded_seconds: float

    @property
    def max_options(self) -> int:
        return int(self.contract.MAX_OPTIONS)

    def media_processor(self) -> ProcessorMixin:
        """The processor, for reading images and videos (only asked for where they are available)."""
        if self.processor is None:
            raise ValueError(f"image inputs are not available: {self.image_unavailable}")
        return self.processor


# Files of a checkpoint that neither the tokenizer nor the processor reads: its weights (in any format), and
# d3stream's own files (a new version's manifest differs while its tokenizer does not).
_NOT_TEXT_SIDE_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack",
                                     ".ckpt", ".pyc"})
_NOT_TEXT_SIDE_FILES = frozenset({"MODEL_MANIFEST.json", CONFIG_FILE, "d3_format.py"})


def text_side_digest(root: Path) -> str:
    """A digest of every file the tokenizer and processor of ``root`` may read (its files, in subfolders too, such
    as ``additional_chat_templates/``, but the weights and d3stream's own), read in blocks: two checkpoints with
    the same digest tokenize and process alike."""
    digest = hashlib.blake2b(digest_size=20)
    for path in sorted(root.rglob("*")):
        if (not path.is_file() or path.suffix in _NOT_TEXT_SIDE_SUFFIXES
                or (path.parent == root and path.name in _NOT_TEXT_SIDE_FILES)):
            continue
        with path.open("rb") as file:
            content = hashlib.file_digest(file, "blake2b").digest()
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + content)
    return digest.hexdigest()


class SharedTextSides:
    """The tokenizers and processors of this process's loaded models, by the digest of their files, held weakly:
    a load whose files match a live model's shares its objects, and one goes with the last model holding it. A
    processor that failed to load is not kept: the next load tries again.

    Sharing relies on nothing changing them per model: the runtime only reads them (a tokenizer called without
    padding or truncation changes nothing of its backend), a load sets the same padding side, image sizes and
    video settings on each, and a prompt contract (``d3_format.py``, left out of the digest) must not change
    the tokenizer it is given. A rollout loads its next version on another thread while the first serves: the
    same rule makes that safe."""

    def __init__(self) -> None:
        self._processors: weakref.WeakValueDictionary[str, ProcessorMixin] = weakref.WeakValueDictionary()
        self._tokenizers: weakref.WeakValueDictionary[str, PreTrainedTokenizerBase] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, root: Path, has_vision: bool) -> tuple[ProcessorMixin | None, str | None, PreTrainedTokenizerBase]:
        """(processor, why it failed to load, tokenizer) of ``root``, shared with a live model's where the
        files are the same."""
        key = text_side_digest(root)
        with self._lock:
            if has_vision and (shared_processor := self._processors.get(key)) is not None:
                return shared_processor, None, shared_processor.tokenizer
            if not has_vision and (shared_tokenizer := self._tokenizers.get(key)) is not None:
                return None, None, shared_tokenizer
        processor, processor_error, tokenizer = _text_side(root, has_vision)
        with self._lock:
            if processor is not None:
                self._processors[key] = processor
            self._tokenizers[key] = tokenizer
        return processor, processor_error, tokenizer


TEXT_SIDES = SharedTextSides()


def _text_side(
    root: Path, has_vision: bool
) -> tuple[ProcessorMixin | None, str | None, PreTrainedTokenizerBase]:
    """(processor, why it failed to load, tokenizer). A vision checkpoint's processor carries the same
    tokenizer: it is loaded once (it is 33 MB of BPE)."""
    from transformers import AutoTokenizer

    processor: ProcessorMixin | None = None
    processor_error: str | None = None
    if has_vision:
        try:
            processor = load_processor(root)
        except Exception as exc:  # noqa: BLE001 - text requests do not need the processor
            processor_error = f"the image processor failed to load ({type(exc).__name__}: {exc})"
    tokenizer: PreTrainedTokenizerBase = (
        processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(str(root))
    )
    tokenizer.padding_side = "left"
    return processor, processor_error, tokenizer


def _device(requested: str | None, kind: str) -> tuple[torch.device, dict[str, str]]:
    """The device to load onto (CUDA when present) and the Gated DeltaNet kernels bound for it."""
    import torch

    if requested is None:
        requested = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kernels = kernel_report() if kind == "qwen3_5" else {}
    if device.type == "cpu" and gpu_only_kernels(kernels):
        raise RuntimeError(
            "flash-linear-attention / causal-conv1d kernels are GPU-only; run on a GPU or use an "
            "environment without them for CPU inference"
        )
    return device, kernels


def _weights(
    root: Path, kind: str, max_options: int, device: torch.device, dtype: str
) -> tuple[Backbone, torch.Tensor]:
    """The BF16 backbone (eval mode, no gradients) and the readout matrix, on ``device``."""
    import torch
    from safetensors.torch import load_file
    from transformers import PreTrainedConfig

    torch.manual_seed(SEED)
    with quiet_transformers():
        backbone = backbone_class(kind).from_pretrained(
            str(root),
            dtype=torch.bfloat16,
            attn_implementation="sdpa",
            device_map={"": str(device)},
        )
    backbone.eval().requires_grad_(False)
    weight = load_file(str(root / "readout.safetensors")).get("weight")
    # transformers types the text config as optional (or a dict before it is read); these backbones always
    # have one, read at load.
    text_config = backbone.config.text_config
    if not isinstance(text_config, PreTrainedConfig):
        raise ValueError(f"config.json of this {kind} checkpoint has no text_config")
    hidden = text_config.hidden_size
    if weight is None or tuple(weight.shape) != (max_options, hidden):
        shape = None if weight is None else tuple(weight.shape)
        raise ValueError(f"readout.safetensors: weight has shape {shape}, expected {(max_options, hidden)}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # READOUT_DTYPES
    return backbone, weight.to(device, dtypes[dtype])


def _media_availability(
    has_vision: bool,
    backbone: Backbone,
    processor: ProcessorMixin | None,
    processor_error: str | None,
    kind: str,
) -> tuple[str | None, str | None]:
    """Why images, and why videos, cannot be read (None: they can). Linearizes the patch embedding and
    configures the video processor on the way."""
    image: str | None = None
    if not has_vision:
        image = "the checkpoint has no vision tower (visual.* weights)"
    elif not linearize_patch_embed(backbone):
        image = "the vision patch embedding was not found"
    elif processor_error is not None:
        image = processor_error
    if image is not None:
        return image, image
    video: str | None = None
    video_processor = getattr(processor, "video_processor", None)  # a processor may have none
    if kind != "qwen3_5":
        video = "video inputs need a Qwen3.5 backbone"
    elif video_processor is None:
        video = "the checkpoint has no video processor"
    else:
        try:
            configure_video_processor(video_processor)
        except Exception as exc:  # noqa: BLE001 - text and image requests do not need it
            video = f"the video processor failed to load ({type(exc).__name__}: {exc})"
    return image, video


def load_checkpoint(
    root: Path,
    contract: PromptContract,
    config: DecisionConfig,
    *,
    manifest: Manifest | None,
    device: str | None,
    started: float,
) -> Checkpoint:
    """Load the tokenizer and processor, choose the device, load the weights and settle which media can be
    read. ``started``: when loading began (``time.perf_counter()``), for ``loaded_seconds``."""
    has_vision = vision_weights_present(root)
    processor, processor_error, tokenizer = TEXT_SIDES.get(root, has_vision)
    vocabulary = Vocabulary.of(tokenizer, contract, config.raw)
    chosen, kernels = _device(device, config.backbone_type)
    backbone, readout = _weights(root, config.backbone_type, int(contract.MAX_OPTIONS), chosen, config.readout_dtype)
    image, video = _media_availability(has_vision, backbone, processor, processor_error, config.backbone_type)
    return Checkpoint(
        root, manifest, contract, config, processor, tokenizer, vocabulary, chosen, kernels, backbone, readout,
        image, video, time.perf_counter() - started,
    )
