"""What determines an answer, written down: the provenance record and the image and video contracts.

Every answer the service writes can be traced to this record (files by hash, numerics, prompt, policy,
media contracts, kernels), so two answers with the same record came from the same computation. It reads
the loaded checkpoint and the settings of the parts that serve it (prompt limits, batch size, permutation
averaging); ``runtime_info`` adds what describes the process rather than the answers (library versions,
device, load time).
"""

from __future__ import annotations

from d3stream.runtime import media as media_io
from d3stream.runtime.device import kernel_path
from d3stream.runtime.forward import RowRunner
from d3stream.runtime.loading import Checkpoint
from d3stream.runtime.package import sha256_file
from d3stream.runtime.prompts import PromptPreparer

RUNTIME = "d3-runtime/1"
# The checkpoint files whose hashes the record carries (those present).
RECORDED_FILES = ("decision_config.json", "readout.safetensors", "config.json", "d3_format.py", "MODEL_MANIFEST.json")
POLICY = (
    "One prompt per question; options under single-token answer codes; last-token readout "
    "over the question's codes only; argmax choice; no truncation (over-limit questions are "
    "refused); no option filtering; one fixed prompt for every request; position ids counted "
    "from each prompt's first token, so batching does not change an answer."
)
PERMUTATION_POLICY = (
    " Choice questions with two or more options are also scored with their options in reversed "
    "order, in the same forward passes, and answered with the per-option mean of both distributions."
)


class Provenance:
    """The records of one loaded model: provenance, kernels, media contracts, runtime information."""

    def __init__(self, checkpoint: Checkpoint, prompts: PromptPreparer, runner: RowRunner):
        self.checkpoint = checkpoint
        self.prompts = prompts
        self.runner = runner

    def record(self) -> dict[str, object]:
        """Everything that determines an answer: files, numerics, prompt, media contracts."""
        from importlib.metadata import version

        # The distribution's version, read from its metadata: the runtime names d3stream without importing
        # anything of it outside runtime/.
        __version__ = version("d3stream")

        checkpoint, config = self.checkpoint, self.checkpoint.config
        root = checkpoint.root
        files = {name: sha256_file(root / name) for name in RECORDED_FILES if (root / name).is_file()}
        manifest = checkpoint.manifest or {}
        record: dict[str, object] = {
            "kind": "d3-code-readout",
            "runtime": RUNTIME,
            "implementation": f"d3stream/{__version__}",
            "model_name": self.prompts.model_name,
            "repo_id": manifest.get("repo_id"),
            "model_sha256": manifest.get("identity", {}).get("model_sha256"),
            "format_id": config.raw.get("format_id"),
            "backbone": config.backbone_type,
            "prompt": config.prompt,
            "attention_mode": config.attention_mode,
            "pooling": "last",
            "temperature": config.temperature,
            "max_length": self.prompts.max_length,
            "readout_dtype": config.readout_dtype,
            "backbone_dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "batch_size": self.runner.batch_size,
            "files_sha256": files,
            "kernels": self.kernel_record(),
            "policy": POLICY + (PERMUTATION_POLICY if self.prompts.permutation_average else ""),
            "images": self.image_contract(),
            "videos": self.video_contract(),
        }
        if self.prompts.permutation_average:
            record["permutation_average"] = True
        return record

    def kernel_record(self) -> dict[str, str]:
        """The Gated DeltaNet kernels this model runs: ``path`` (fast / reference / mixed / none) and the
        implementation bound for each op (``device.kernel_report``); provenance's ``kernels`` entry and what
        ``Metrics.set_kernels`` publishes."""
        kernels = self.checkpoint.kernels
        return {"path": kernel_path(kernels), **kernels}

    def image_contract(self) -> dict[str, object]:
        """How image inputs are read (or why they are not available)."""
        checkpoint = self.checkpoint
        contract: dict[str, object] = {
            "supported": checkpoint.image_unavailable is None,
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
        if checkpoint.processor is not None:
            contract["image_processor"] = type(checkpoint.processor.image_processor).__name__
            try:
                import torchvision

                contract["torchvision"] = torchvision.__version__
            except ImportError:
                contract["torchvision"] = None
        if checkpoint.image_unavailable is not None:
            contract["unavailable"] = checkpoint.image_unavailable
        return contract

    def video_contract(self) -> dict[str, object]:
        """How video inputs are read (or why they are not available)."""
        checkpoint = self.checkpoint
        contract: dict[str, object] = {
            "supported": checkpoint.video_unavailable is None,
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
        if checkpoint.video_unavailable is None:
            contract["video_processor"] = type(checkpoint.media_processor().video_processor).__name__
            import cv2

            contract["opencv"] = cv2.__version__
        else:
            contract["unavailable"] = checkpoint.video_unavailable
        return contract

    def parameter_count(self) -> int:
        """Parameters of the backbone and the readout."""
        checkpoint = self.checkpoint
        return sum(p.numel() for p in checkpoint.backbone.parameters()) + checkpoint.readout.numel()

    def runtime_info(self) -> dict[str, object]:
        """Library versions, device, load time and size of the loaded model."""
        import torch
        import transformers

        checkpoint = self.checkpoint
        info: dict[str, object] = {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(checkpoint.device),
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
            "loaded_seconds": round(checkpoint.loaded_seconds, 2),
            "parameters": self.parameter_count(),
            "fast_path": {"active": False, "reason": "the ROCm d3_fast path is not part of d3stream"},
        }
        if checkpoint.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(checkpoint.device)
        return info
