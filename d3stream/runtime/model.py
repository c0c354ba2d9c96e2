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
reference runtime does.

``D3`` is the front a library user holds; the work is done by its parts, one module each, along the
threads that run them:

* ``loading.Checkpoint`` (``checkpoint``): the checkpoint as loaded, its config, tokenizer, processor,
  device, backbone and readout (``device.py``: SDPA backends, kernels, host copies);
* ``prompts.PromptPreparer`` (``prompts``) with ``multimodal.MediaPlanner`` (``media``): the prepare
  thread's work, request -> rows, and the request token limits;
* ``vision.VisionEncoder`` (``vision``): the vision tower over a pass's media, the feature cache;
* ``forward.RowRunner`` (``runner``): the model thread's work, rows -> probabilities;
* ``provenance.Provenance`` (``records``): provenance, kernels, media contracts, runtime information.

The values passed between them (``Row``, ``Prepared``, ``RequestMedia``) are in ``rows.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from d3stream.runtime import media as media_io
from d3stream.runtime.cache import MediaFeatureCache
from d3stream.runtime.device import (
    GATED_DELTANET_FUNCTIONS,
    REFERENCE_KERNEL,
    host_transfer,
    kernel_path,
    kernel_report,
    linearize_patch_embed,
    reference_kernels,
    sdpa_backends,
    to_device,
)
from d3stream.runtime.forward import DEFAULT_BATCH_SIZE, MERGE_TOKENS, Padded, RowRunner, bucketed_width
from d3stream.runtime.kinds import PromptContract
from d3stream.runtime.loading import (
    ATTENTION_MODES,
    BACKBONES,
    FORMAT_VERSION,
    IMAGE_TOKEN,
    PROMPTS,
    VIDEO_TOKEN,
    Checkpoint,
    DecisionConfig,
    backbone_type,
    load_checkpoint,
    load_file_module,
    prompt_contract,
    vision_weights_present,
)
from d3stream.runtime.multimodal import MediaPlanner
from d3stream.runtime.package import Manifest, verify_package
from d3stream.runtime.prompts import PROMPT_OVERHEAD_BYTES, PromptPreparer
from d3stream.runtime.provenance import RUNTIME, Provenance
from d3stream.runtime.rows import Prepared, RequestMedia, Row
from d3stream.runtime.vision import DEFAULT_MEDIA_BATCH_PATCHES, VisionEncoder

if TYPE_CHECKING:
    from PIL import Image
    from torch import Tensor
    from torch import device as Device
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

# Names this module has always offered; each now lives in the module of its part.
__all__ = [
    "ATTENTION_MODES", "BACKBONES", "D3", "DEFAULT_BATCH_SIZE", "DEFAULT_MEDIA_BATCH_PATCHES", "FORMAT_VERSION",
    "GATED_DELTANET_FUNCTIONS", "IMAGE_TOKEN", "MERGE_TOKENS", "PROMPTS", "PROMPT_OVERHEAD_BYTES",
    "REFERENCE_KERNEL", "RUNTIME", "VIDEO_TOKEN", "Prepared", "RequestMedia", "Row", "backbone_type",
    "bucketed_width", "host_transfer", "kernel_path", "kernel_report", "linearize_patch_embed", "load_file_module",
    "prompt_contract", "reference_kernels", "sdpa_backends", "to_device", "vision_weights_present",
]


class ModelAttributes:
    """The attributes ``D3`` offers, each read from (and written to) the part that owns it: the loaded
    checkpoint's facts, and the settings of the prompt, vision and forward parts. Those nothing outside the
    runtime read are left to their parts: ``checkpoint.vocabulary`` (``codes``, ``pad_id``, the image and
    video token ids), ``checkpoint.config`` (``prompt``, ``temperature``, ``readout_dtype``,
    ``backbone_type``), ``checkpoint.loaded_seconds``."""

    checkpoint: Checkpoint
    prompts: PromptPreparer
    vision: VisionEncoder
    runner: RowRunner

    # ------------------------------------------------------------------- the checkpoint, as loaded

    @property
    def root(self) -> Path:
        return self.checkpoint.root

    @property
    def manifest(self) -> Manifest | None:
        return self.checkpoint.manifest

    @property
    def config(self) -> dict[str, object]:
        """``decision_config.json`` as read (``checkpoint.config`` has it validated)."""
        return self.checkpoint.config.raw

    @property
    def contract(self) -> PromptContract:
        return self.checkpoint.contract

    @property
    def backbone(self) -> Any:
        # Any, not ``Backbone`` (``checkpoint.backbone`` has that type): the benchmark's FLOP count reads its
        # embeddings' weight through ``nn.Module`` attributes, which torch types as ``Tensor | Module``.
        return self.checkpoint.backbone

    @property
    def readout(self) -> Tensor:
        return self.checkpoint.readout

    @property
    def processor(self) -> ProcessorMixin | None:
        return self.checkpoint.processor

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.checkpoint.tokenizer

    @tokenizer.setter
    def tokenizer(self, value: PreTrainedTokenizerBase) -> None:
        self.checkpoint.tokenizer = value

    @property
    def token_ids(self) -> list[int]:
        return self.checkpoint.vocabulary.token_ids

    @property
    def added_token_ids(self) -> frozenset[int]:
        return self.checkpoint.vocabulary.added_token_ids

    @property
    def torch(self) -> types.ModuleType:
        import torch

        return torch

    # device, attention_mode and the media availability are settable as ``DecisionModel`` declares them;
    # they are facts of the loaded checkpoint, and a write goes to it.

    @property
    def device(self) -> Device:
        return self.checkpoint.device

    @device.setter
    def device(self, value: Device) -> None:
        self.checkpoint.device = value

    @property
    def attention_mode(self) -> str:
        return self.checkpoint.config.attention_mode

    @attention_mode.setter
    def attention_mode(self, value: str) -> None:
        self.checkpoint.config = dataclasses.replace(self.checkpoint.config, attention_mode=value)

    @property
    def kernels(self) -> dict[str, str]:
        return self.checkpoint.kernels

    @property
    def image_unavailable(self) -> str | None:
        return self.checkpoint.image_unavailable

    @image_unavailable.setter
    def image_unavailable(self, value: str | None) -> None:
        self.checkpoint.image_unavailable = value

    @property
    def video_unavailable(self) -> str | None:
        return self.checkpoint.video_unavailable

    @video_unavailable.setter
    def video_unavailable(self, value: str | None) -> None:
        self.checkpoint.video_unavailable = value

    # ------------------------------------------------------------------------ the parts' settings

    @property
    def model_name(self) -> str:
        return self.prompts.model_name

    @model_name.setter
    def model_name(self, value: str) -> None:
        self.prompts.model_name = value

    @property
    def permutation_average(self) -> bool:
        return self.prompts.permutation_average

    @property
    def max_length(self) -> int | None:
        return self.prompts.max_length

    @max_length.setter
    def max_length(self, value: int | None) -> None:
        self.prompts.max_length = value

    @property
    def max_request_tokens(self) -> int | None:
        return self.prompts.max_request_tokens

    @max_request_tokens.setter
    def max_request_tokens(self, value: int | None) -> None:
        self.prompts.max_request_tokens = value

    @property
    def batch_size(self) -> int:
        return self.runner.batch_size

    @property
    def pad_buckets(self) -> bool:
        return self.runner.pad_buckets

    @pad_buckets.setter
    def pad_buckets(self, value: bool) -> None:
        self.runner.pad_buckets = value

    @property
    def media_batch_patches(self) -> int:
        return self.vision.media_batch_patches

    @media_batch_patches.setter
    def media_batch_patches(self, value: int) -> None:
        self.vision.media_batch_patches = value

    @property
    def media_cache(self) -> MediaFeatureCache | None:
        return self.vision.media_cache

    @media_cache.setter
    def media_cache(self, value: MediaFeatureCache | None) -> None:
        self.vision.media_cache = value
        self.prompts.media.digest_contents = value is not None  # the cache's keys are taken while preparing

    def limit_prompt_tokens(self, limit: int | None) -> None:
        """Serve at most ``limit`` tokens per prompt (the tighter of it and the checkpoint's own limit):
        a service must not let one huge state occupy the device for minutes."""
        if limit is not None:
            self.max_length = min(self.max_length or limit, int(limit))

    def limit_request_tokens(self, limit: int | None) -> None:
        """Serve at most ``limit`` prompt tokens summed over one request's prompts (media tokens included);
        a request over it raises ValueError naming ``max_request_tokens`` before any device time."""
        self.max_request_tokens = None if limit is None else int(limit)


class D3(ModelAttributes):
    """A loaded code-readout checkpoint answering System One requests."""

    def __init__(
        self,
        root: Path,
        *,
        device: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        manifest: Manifest | None = None,
        max_length: int | None = None,
        readout_dtype: str | None = None,
        model_name: str | None = None,
        permutation_average: bool = False,
        media_batch_patches: int = DEFAULT_MEDIA_BATCH_PATCHES,
        pad_buckets: bool = False,
    ):
        started = time.perf_counter()
        root = Path(root)
        contract = prompt_contract(root)
        config = DecisionConfig.read(root, readout_dtype=readout_dtype, max_length=max_length)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {int(batch_size)}")
        name = model_name or (manifest or {}).get("model_name") or root.name
        self.checkpoint = load_checkpoint(
            root, contract, config, manifest=manifest, device=device, started=started
        )
        self.media = MediaPlanner(self.checkpoint)
        self.prompts = PromptPreparer(
            self.checkpoint, self.media, model_name=name, permutation_average=bool(permutation_average)
        )
        self.vision = VisionEncoder(self.checkpoint, media_batch_patches=media_batch_patches)
        self.runner = RowRunner(self.checkpoint, self.vision, batch_size=batch_size, pad_buckets=pad_buckets)
        self.records = Provenance(self.checkpoint, self.prompts, self.runner)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        verify: str = "fast",
        max_length: int | None = None,
        readout_dtype: str | None = None,
        model_name: str | None = None,
        permutation_average: bool = False,
    ) -> Self:
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

    # ------------------------------------------------------------------------------------ preparing

    def prepare(
        self,
        state: object,
        questions: Mapping[str, object],
        images: Sequence[object] | None = None,
        videos: Sequence[object] | None = None,
        *,
        strict: bool = False,
        decoded_images: list[Image.Image] | None = None,
        decoded_videos: list[media_io.Video] | None = None,
        permutation_average: bool | None = None,
    ) -> Prepared:
        """Validate, render and tokenize one request; a malformed request raises ValueError.

        ``strict`` reads media as bytes from outside (the service). Callers that decoded the media
        themselves (to time decoding apart) pass ``decoded_images`` / ``decoded_videos`` instead.
        ``permutation_average`` overrides the model's setting for this request.
        """
        return self.prompts.prepare(
            state, questions, images, videos, strict=strict, decoded_images=decoded_images,
            decoded_videos=decoded_videos, permutation_average=permutation_average,
        )

    def load_images(self, images: Sequence[object], *, strict: bool = False) -> list[Image.Image]:
        """Decode a request's images; ValueError names the image that could not be read."""
        return self.media.load_images(images, strict=strict)

    def load_videos(self, videos: Sequence[object], *, strict: bool = False) -> list[media_io.Video]:
        """Decode and sample a request's videos; ValueError names the video that could not be read."""
        return self.media.load_videos(videos, strict=strict)

    def plain_text_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text (added-token strings in it stay text: ``prompts.UserText``)."""
        return self.prompts.user_text.plain_text_ids(text)

    def request_may_exceed_tokens(self, record_bytes: int, questions: int) -> bool:
        """False when a request of ``record_bytes`` JSON bytes and ``questions`` questions certainly stays
        within ``max_request_tokens`` with its text alone (no tokenizer needed: the caller can skip
        ``check_request_tokens``). A prompt renders the request's JSON text at most twice as long (the
        state's separators gain a space) plus the fixed template, each question in two option orders at
        most, and a token is at least one UTF-8 byte."""
        return self.prompts.request_may_exceed_tokens(record_bytes, questions)

    def check_request_tokens(
        self, state: object, questions: Mapping[str, object], *, permutation_average: bool | None = None
    ) -> None:
        """ValueError naming ``max_request_tokens`` when the request's text prompts alone (media not yet
        counted) are certainly over it; cheap (the state is tokenized once, whole prompts never). For a
        caller that wants to refuse such a request before fetching and decoding its media; ``prepare``
        makes the same check and then the exact one."""
        self.prompts.check_request_tokens(state, questions, permutation_average=permutation_average)

    # -------------------------------------------------------------------------------------- running

    def left_padded(self, rows: Sequence[Padded]) -> tuple[Tensor, Tensor, Tensor]:
        """Token ids, presence mask and [3, B, L] positions of rows left-padded to the longest, on the
        device, with each row's media features computed (once per request)."""
        return self.runner.left_padded(rows)

    def forward(self, rows: Sequence[Row]) -> list[list[float]]:
        """Option probabilities of each row (cut to its option count), all rows in one left-padded pass.

        Rows may come from any requests and mix text, image and video prompts.
        """
        return self.runner.forward(rows)

    def passes(self, prepared: Prepared) -> list[list[Row]]:
        """One request's rows in request order, ``batch_size`` questions per pass (``RowRunner.passes``)."""
        return self.runner.passes(prepared)

    def run(self, prepared: Prepared) -> dict[Row, list[float]]:
        """Probabilities of every row of one request."""
        results: dict[Row, list[float]] = {}
        for rows in self.passes(prepared):
            results.update(zip(rows, self.forward(rows), strict=True))
        return results

    def system_one(
        self,
        *,
        state: object,
        questions: Mapping[str, object],
        images: Sequence[object] | None = None,
        videos: Sequence[object] | None = None,
        strict: bool = False,
    ) -> dict[str, object]:
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
        token_ids = self.token_ids
        lengths = list(lengths)
        for size in range(1, widest + 1):
            for length in lengths:
                rows = [
                    Row("warmup", [token_ids[(i + j) % len(token_ids)] for j in range(max(8, length - 7 * i))], 2)
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

    def synchronize(self) -> None:
        self.runner.synchronize()

    # -------------------------------------------------------------------------------------- records

    def provenance(self) -> dict[str, object]:
        """Everything that determines an answer: files, numerics, prompt, media contracts."""
        return self.records.record()

    def kernel_record(self) -> dict[str, str]:
        """The Gated DeltaNet kernels this model runs: ``path`` (fast / reference / mixed / none) and the
        implementation bound for each op; provenance's ``kernels`` entry and what ``Metrics.set_kernels``
        publishes."""
        return self.records.kernel_record()

    def image_contract(self) -> dict[str, object]:
        """How image inputs are read (or why they are not available)."""
        return self.records.image_contract()

    def video_contract(self) -> dict[str, object]:
        """How video inputs are read (or why they are not available)."""
        return self.records.video_contract()

    def parameter_count(self) -> int:
        return self.records.parameter_count()

    def runtime_info(self) -> dict[str, object]:
        return self.records.runtime_info()
