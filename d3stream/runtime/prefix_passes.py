"""The passes of shared-prefix reuse: prefixes into cached backbone states, suffixes run on those states.

``prefix.py`` decides which requests share a prefix, groups them into rounds and checks the results; this
module runs the two kinds of pass on a ``D3``. A **prefix pass** runs the prefixes of several requests
left-padded (exactly as ``RowRunner.forward`` pads full prompts) with the backbone's ``DynamicCache`` on,
and keeps each request's slice of it: the key/value cache of every full-attention layer (padding cut off),
the convolution and recurrent states of every Gated DeltaNet layer. A **suffix pass** stacks the cached
states of its rows' prefixes into a new cache (key/value caches left-padded to the longest prefix of the
pass, padding masked out; recurrent states need none), runs the suffixes right-padded after them, and
reads each row's last real position out through the same readout as a full prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from d3stream.runtime.device import sdpa_backends
from d3stream.runtime.forward import token_tensor
from d3stream.runtime.model import D3
from d3stream.runtime.rows import Prepared, RequestMedia, Row

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import DynamicCache


@dataclass(eq=False)
class Plan:
    """One request split into a shared prefix and one suffix per row."""

    prepared: Prepared
    ids: list[int]  # prefix token ids, media placeholders expanded
    positions: torch.Tensor | None  # [3, length] multimodal RoPE positions of the prefix; None: 0..length-1
    media: RequestMedia | None
    rows: list[Row]

    @property
    def length(self) -> int:
        return len(self.ids)

    def suffix_length(self, row: Row) -> int:
        return row.length - self.length


# One layer of a cached prefix: ("kv", keys, values) or ("linear", conv state, recurrent state).
LayerState = tuple[str, "torch.Tensor", "torch.Tensor"]


@dataclass
class PrefixState:
    """The cached state of one plan's prefix, layer by layer."""

    length: int
    layers: list[LayerState]


def pairs(length: int, context: int = 0) -> int:
    """(query, key) pairs a causal pass scores for ``length`` new tokens after ``context`` cached ones."""
    return length * context + length * (length + 1) // 2


def pack_suffixes(
    items: list[tuple[Plan, Row]], max_rows: int, max_tokens: int, max_cache_tokens: int
) -> list[list[tuple[Plan, Row]]]:
    """Suffix passes: rows with similar prefix lengths together, then similar suffix lengths; each pass at
    most ``max_rows`` rows, ``max_tokens`` padded suffix tokens and ``max_cache_tokens`` padded cached-plus-new
    tokens."""

    def bucket(plan: Plan) -> int:
        return int(2 * math.log2(plan.length))  # prefix lengths within a factor of about 1.4

    ordered = sorted(items, key=lambda item: (bucket(item[0]), item[0].suffix_length(item[1])), reverse=True)
    passes: list[list[tuple[Plan, Row]]] = []
    current: list[tuple[Plan, Row]] = []
    longest = context = 0
    for plan, row in ordered:
        size = plan.suffix_length(row)
        grown_longest, grown_context = max(longest, size), max(context, plan.length)
        if current and (
            len(current) >= max_rows
            or (len(current) + 1) * grown_longest > max_tokens
            or (len(current) + 1) * (grown_context + grown_longest) > max_cache_tokens
        ):
            passes.append(current)
            current, grown_longest, grown_context = [], size, plan.length
        current.append((plan, row))
        longest, context = grown_longest, grown_context
    if current:
        passes.append(current)
    return passes


def _layer_state(layer: object, number: int, pad: int) -> LayerState:
    """Row ``number``'s slice of one layer of a prefix pass's cache (its ``pad`` left-padding cut off)."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    linear = isinstance(layer, LinearAttentionCacheLayerMixin)
    if linear and isinstance(layer, CacheLayerMixin):
        raise NotImplementedError(f"cache layers of type {type(layer).__name__} are not supported")
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        if layer.number_of_states != 1:
            raise NotImplementedError("linear-attention layers with several states are not supported")
        conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
        if conv is None or recurrent is None:
            raise RuntimeError("the prefix pass left a linear-attention layer without its states")
        return ("linear", conv[number], recurrent[number])
    if not isinstance(layer, CacheLayerMixin):
        raise NotImplementedError(f"cache layers of type {type(layer).__name__} are not supported")
    if layer.keys is None or layer.values is None:
        raise RuntimeError("the prefix pass left an attention layer without its keys and values")
    return ("kv", layer.keys[number, :, pad:], layer.values[number, :, pad:])


class PrefixPasses:
    """Runs prefix and suffix passes on one model."""

    def __init__(self, model: D3):
        self.model = model

    def prefixes(self, group: list[Plan]) -> tuple[dict[Plan, PrefixState], int]:
        """Run the prefixes of ``group`` (left-padded) and keep each one's cached states; also the padded
        width of the pass."""
        import torch
        from transformers.cache_utils import DynamicCache

        model = self.model
        with torch.inference_mode(), sdpa_backends(model.device):
            ids, present, positions = model.runner.left_padded(group)
            width = ids.shape[1]
            carriers = [Row("prefix", plan.ids, 1, plan.media, plan.positions) for plan in group]
            cache = DynamicCache(config=model.backbone.config)
            model.backbone(
                input_ids=ids,
                attention_mask=present,
                position_ids=positions,
                mm_encoder_outputs=model.vision.encoder_outputs(carriers),
                cache=cache,
                use_cache=True,
            )
            states: dict[Plan, PrefixState] = {}
            for number, plan in enumerate(group):
                pad = width - plan.length
                states[plan] = PrefixState(plan.length, [_layer_state(layer, number, pad) for layer in cache.layers])
            model.synchronize()
        return states, width

    def suffixes(
        self, group: list[tuple[Plan, Row]], states: dict[Plan, PrefixState]
    ) -> tuple[list[Row], list[list[float]], list[int]]:
        """Answer the rows of ``group`` from their plans' cached prefixes (right-padded suffixes): the rows,
        their probabilities and their suffix lengths."""
        import torch

        model = self.model
        device = model.device
        with torch.inference_mode(), sdpa_backends(device):
            unique: list[Plan] = []
            slot: dict[Plan, int] = {}
            for plan, _ in group:
                if plan not in slot:
                    slot[plan] = len(unique)
                    unique.append(plan)
            index = torch.as_tensor([slot[plan] for plan, _ in group], dtype=torch.long, device=device)
            context = max(plan.length for plan in unique)
            cache = self._stacked_cache([states[plan] for plan in unique], index, context)
            lengths = [plan.suffix_length(row) for plan, row in group]
            ids, mask, positions = self._suffix_inputs(group, lengths, context)
            hidden = model.backbone(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            ).last_hidden_state
            last = torch.as_tensor(lengths, device=device) - 1
            hidden = hidden[torch.arange(len(group), device=device), last]
            rows = [row for _, row in group]
            return rows, model.runner.readout_probabilities(hidden, rows), lengths

    def _stacked_cache(self, prefixes: list[PrefixState], index: torch.Tensor, context: int) -> DynamicCache:
        """A ``DynamicCache`` holding, for each row (``index``: its prefix among ``prefixes``), its prefix's
        states: key/value caches left-padded to ``context`` tokens, recurrent states as they are."""
        import torch
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.backbone.config)
        for number, (kind, *_) in enumerate(prefixes[0].layers):
            if kind == "kv":
                keys = [prefix.layers[number][1] for prefix in prefixes]
                values = [prefix.layers[number][2] for prefix in prefixes]
                heads, _, width = keys[0].shape
                stacked_k = keys[0].new_zeros((len(prefixes), heads, context, width))
                stacked_v = values[0].new_zeros((len(prefixes), heads, context, values[0].shape[-1]))
                for u, prefix in enumerate(prefixes):
                    stacked_k[u, :, context - prefix.length :] = keys[u]
                    stacked_v[u, :, context - prefix.length :] = values[u]
                cache.update(stacked_k.index_select(0, index), stacked_v.index_select(0, index), number)
            else:
                conv = torch.stack([prefix.layers[number][1] for prefix in prefixes]).index_select(0, index)
                recurrent = torch.stack([prefix.layers[number][2] for prefix in prefixes]).index_select(0, index)
                # A fresh layer takes the first conv state as a prefill (no concatenation): exactly ours.
                cache.update_conv_state(conv, number, conv_kernel_size=conv.shape[-1])
                cache.update_recurrent_state(recurrent, number)
        return cache

    def _suffix_inputs(
        self, group: Sequence[tuple[Plan, Row]], lengths: list[int], context: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, mask (cached prefix and new tokens) and positions of right-padded suffixes, on the device."""
        import torch

        longest = max(lengths)
        # The whole group at once, as ``RowRunner.left_padded`` does: each suffix first on its line, in order.
        shared = torch.tensor([plan.length for plan, _ in group])[:, None]
        ends = torch.tensor(lengths)[:, None]
        columns = torch.arange(longest)
        real = columns < ends
        ids = torch.full((len(group), longest), self.model.checkpoint.vocabulary.pad_id, dtype=torch.long)
        ids[real] = token_tensor([row.ids[plan.length :] for plan, row in group])
        # The cached prefix (its last ``plan.length`` columns of ``context``) and the new tokens are attended to.
        every = torch.arange(context + longest)
        mask = ((every >= context - shared) & (every < context + ends)).long()
        # A suffix's positions go on from its prefix's (padding is at 0).
        positions = ((columns + shared) * real).expand(3, -1, -1).clone()
        for number, ((plan, row), length) in enumerate(zip(group, lengths, strict=True)):
            if row.positions is not None:  # a row with media: its own multimodal positions
                positions[:, number, :length] = row.positions[:, plan.length :]
        device = self.model.device
        return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), positions.to(
            device, non_blocking=True
        )
