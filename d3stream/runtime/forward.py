"""The model thread's work: rows of any requests through the backbone, the readout into probabilities.

``RowRunner.forward`` runs any list of rows, **from any requests**, as one left-padded pass and returns each
row's option probabilities. Every row runs with position ids counted from its own first real token, so a
question gives the same probabilities alone or inside a mixed, padded batch (within bf16 tolerance). Media
features are computed the first time one of a request's rows runs (``vision.py``).

Numerics follow the specification: BF16 backbone with SDPA attention, the last position's hidden state
through the readout (FP32 by default) restricted to the row's option codes, softmax in FP32 at the
checkpoint's temperature. ``noncausal_full_attention`` (Qwen3.5 only) lets the full-attention layers read
the whole prompt of their row while the Gated DeltaNet layers keep their causal scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Protocol

from d3stream.runtime.device import sdpa_backends, to_device
from d3stream.runtime.loading import Checkpoint
from d3stream.runtime.rows import Prepared, RequestMedia, Row
from d3stream.runtime.vision import VisionEncoder

if TYPE_CHECKING:
    import torch

DEFAULT_BATCH_SIZE = 8
# A pass carrying both option orders (permutation_average) above this many padded tokens is split in two,
# so peak memory stays that of the original order.
MERGE_TOKENS = 8192


class Padded(Protocol):
    """What ``left_padded`` needs of a row (a ``Row``, or a shared prefix of ``prefix.py``)."""

    @property
    def ids(self) -> list[int]: ...
    @property
    def length(self) -> int: ...
    @property
    def positions(self) -> torch.Tensor | None: ...
    @property
    def media(self) -> RequestMedia | None: ...


def token_tensor(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """The token ids of ``sequences`` one after the other as one int64 tensor, converted in one step (a tensor per
    row cost more than the rows' tokens). All of them, never cut to a count: a row whose ids outnumber its length
    makes the assignment of the pass fail, instead of shifting the tokens of the rows after it."""
    import numpy as np
    import torch

    return torch.from_numpy(np.fromiter(chain.from_iterable(sequences), dtype=np.int64))


def bucketed_width(width: int) -> int:
    """``width`` rounded up to a length bucket: the next multiple of an eighth of the power of two at or
    below it, at least 16 (so 300 -> 320, 1000 -> 1024, 2100 -> 2304): at most 1/8 more padding, and a few
    dozen distinct widths up to 8k instead of every length."""
    if width <= 16:
        return 16
    step = max(16, (1 << (width.bit_length() - 1)) // 8)
    return -(-width // step) * step


class RowRunner:
    """Runs rows through the backbone and reads their option probabilities out."""

    def __init__(
        self, checkpoint: Checkpoint, vision: VisionEncoder, *, batch_size: int = DEFAULT_BATCH_SIZE,
        pad_buckets: bool = False,
    ):
        self.checkpoint = checkpoint
        self.vision = vision
        self.batch_size = int(batch_size)
        # Round each pass's padded width up to a length bucket (``bucketed_width``); off by default: on the
        # CPU it did not pay (bench/README.md, "Shape buckets").
        self.pad_buckets = bool(pad_buckets)

    def left_padded(self, rows: Sequence[Padded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, presence mask and [3, B, L] positions of rows left-padded to the longest, on the
        device, with each row's media features computed (once per request)."""
        import torch

        self.vision.encode([row.media for row in rows if row.media is not None])
        lengths = [row.length for row in rows]
        width = max(lengths)
        if self.pad_buckets:
            width = bucketed_width(width)
        # The whole pass at once, not row by row (a row's own tensor ops cost about 25 µs, a pass's rows 1 ms):
        # each row's tokens are the last of its line, in row order, as a mask of the pass reads them.
        starts = torch.tensor([width - length for length in lengths])
        real = torch.arange(width) >= starts[:, None]
        ids = torch.full((len(rows), width), self.checkpoint.vocabulary.pad_id, dtype=torch.long)
        ids[real] = token_tensor([row.ids for row in rows])
        present = real.long()
        # Positions count from each row's first real token, so padding never shifts them (padding is at 0).
        positions = (present.cumsum(1) - 1).clamp_(min=0).expand(3, -1, -1).clone()
        for number, row in enumerate(rows):
            if row.positions is not None:  # a row with media: its own multimodal positions
                positions[:, number, width - row.length:] = row.positions
        ids, present, positions = to_device([ids, present, positions], self.checkpoint.device)
        return ids, present, positions

    def forward(self, rows: Sequence[Row]) -> list[list[float]]:
        """Option probabilities of each row (cut to its option count), all rows in one left-padded pass.

        Rows may come from any requests and mix text, image and video prompts.
        """
        if not rows:
            return []
        import torch

        checkpoint = self.checkpoint
        with torch.inference_mode(), sdpa_backends(checkpoint.device):
            ids, present, positions = self.left_padded(rows)
            mask: torch.Tensor | dict[str, torch.Tensor | None] = present
            if checkpoint.config.attention_mode == "noncausal_full_attention":
                padded = not bool(present.all())
                mask = {
                    "full_attention": present.bool()[:, None, None, :],
                    "linear_attention": present if padded else None,
                }
            hidden = checkpoint.backbone(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                mm_encoder_outputs=self.vision.encoder_outputs(rows),
                use_cache=False,
            ).last_hidden_state[:, -1]
            return self.readout_probabilities(hidden, rows)

    def readout_probabilities(self, hidden: torch.Tensor, rows: Sequence[Row]) -> list[list[float]]:
        """Option probabilities from the last-position hidden states [rows, hidden] of ``rows``.

        (Split out of ``forward`` unchanged so the shared-prefix path, ``runtime/prefix.py``, reads out
        exactly as a full prompt does.)
        """
        import torch

        checkpoint = self.checkpoint
        readout, device = checkpoint.readout, checkpoint.device
        if checkpoint.config.readout_dtype == "float32":
            logits = hidden.float() @ readout.T
        else:
            logits = torch.nn.functional.linear(hidden, readout).float()
        counts = torch.as_tensor([row.options for row in rows], device=device)[:, None]
        invalid = torch.arange(checkpoint.max_options, device=device)[None] >= counts
        temperature = checkpoint.config.temperature
        probabilities = torch.softmax(logits.masked_fill(invalid, float("-inf")) / temperature, dim=-1)
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

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
        import torch

        device = self.checkpoint.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
