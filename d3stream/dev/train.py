"""Fit a freshly built tiny checkpoint on the synthetic demo task (``d3stream.dev.tasks``), offline, on a CPU.

``train_demo(root, steps=..., seed=...)`` turns the random-weight checkpoint in ``root`` (written by
``build_checkpoint``) into one whose answers follow the requests: route a ticket to its team, say whether
it asks for a refund, how urgent it is, and whether a picture holds a red square.

What is trained: the last decoder layer, the final norm, the readout, and the input embeddings of the words
the training tickets use. The last layer's attention is what learns to look back at the words (and image
patches) that decide: in a random tiny model the last position's state hardly depends on the earlier tokens,
so a readout alone could not tell tickets apart. The embeddings are what lets it learn *which* words decide:
with random 64-wide embeddings a linear look-up singles out a few dozen tokens, not the hundreds of words a
ticket says "refund", "crash" or "urgent" with (fitted on tickets of many wordings with the last layer alone,
the model got 72 % of its own training rows right; with the embeddings, all of them). The tokens of the
prompt around the state (the system turn, each question and its options) keep their random embeddings: the
last position tells the questions apart by them, and a word a ticket shares with a question ("urgent" in
"How urgent is the ticket?") would otherwise be learned twice over, as a sign of the question and of the
answer.

How it stays cheap (about a minute on one CPU thread). The frozen layers below are run once per training
batch, through the runtime's own ``prepare`` (so the prompts are exactly what serving uses), and the input of
the last layer is kept; every step then runs the last layer for the last position only (``last_position``:
its output is read there alone), forward and backward. In these random layers the residual stream is the
embedding plus a small change (the input of the last layer is 0.95 cosine-similar to the embedding at every
position), so an embedding offset reaches the last layer through the residual path almost unchanged:
training adds each token's offset to the kept input of the last layer, and the saved checkpoint adds it to
the token's embedding, where the frozen layers see it too. The answers of the saved checkpoint, run exactly
as served, agreed with the shortcut's on every one of 66 rows checked; the held-out figures (docs/DEMO.md)
are the saved checkpoint's.

Training is FP32 on one thread (deterministic for a seed, and polite on a shared CPU); the trained layer and
embeddings are stored in BF16 like the rest of the backbone, the readout in FP32, and the manifest is
rewritten, so the result is an ordinary checkpoint that any D3 runtime loads and verifies.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from d3stream.dev import tasks
from d3stream.runtime import D3, Row
from d3stream.runtime.kinds import Question, canonical_text, label_option
from d3stream.runtime.package import read_manifest, write_manifest

if TYPE_CHECKING:
    import torch

DEFAULT_STEPS = 3000
# Bump when the task or the training changes what the same arguments produce (the demo's cache key).
TRAIN_BUILD = 2
# Tickets each asking all three questions (three rows each): wordings seen together with every question.
TRAIN_TICKETS = 2400
TRAIN_PICTURES = 160
BATCH_ROWS = 32
LEARNING_RATE = 5e-4
# The embedding offsets start at zero and grow past the size of an embedding (about 0.16): a rate of their own.
EMBEDDING_LEARNING_RATE = 5e-2
# The first steps at a rising rate (Adam's moments are young), then a cosine decay to zero.
WARMUP_FRACTION = 0.05
# Targets a little short of certainty: answers to wordings never seen stay calibrated (Brier, ECE).
LABEL_SMOOTHING = 0.1


@dataclass
class _Batch:
    hidden: torch.Tensor  # [rows, width, hidden] FP32 input of the last layer
    layer_kwargs: dict[str, object]  # its keyword arguments (positions, mask), floats in FP32
    targets: torch.Tensor  # [rows] index of the labelled option
    invalid: torch.Tensor  # [rows, MAX_OPTIONS] True past each row's option count
    slots: torch.Tensor  # [rows, width] each position's row of the embedding offsets (the last row: none)


@dataclass
class _Captured:
    """The inputs of the last layer's most recent call (a forward pre-hook fills it)."""

    hidden: torch.Tensor | None = None
    kwargs: dict[str, object] = field(default_factory=dict)


@dataclass
class _Trainable:
    """What training changes: FP32 copies of the last decoder layer and the final norm, the readout, and an
    offset to the input embedding of each token in ``token_ids`` (zero at the start)."""

    layer: torch.nn.Module
    norm: torch.nn.Module
    readout: torch.nn.Parameter
    token_ids: list[int]
    offsets: torch.nn.Parameter  # [len(token_ids), hidden]

    @classmethod
    def of(cls, model: D3, last: int, token_ids: list[int]) -> _Trainable:
        import torch

        language = model.backbone.language_model
        layer = copy.deepcopy(language.layers[last]).float().train().requires_grad_(True)
        norm = copy.deepcopy(language.norm).float().requires_grad_(True)
        offsets = torch.nn.Parameter(torch.zeros(len(token_ids), language.embed_tokens.embedding_dim))
        return cls(layer, norm, torch.nn.Parameter(model.readout.detach().clone().float()), token_ids, offsets)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.layer.parameters(), *self.norm.parameters(), self.readout]

    def input_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """[rows, width, hidden]: each position's embedding offset (zero for a token not trained)."""
        import torch

        table = torch.cat([self.offsets, self.offsets.new_zeros(1, self.offsets.shape[1])])
        return table[slots]


def _option_index(question: Question, label: object) -> int:
    """The code index of a label (the choice key, true/false, the score level), read as ``compare --labels``
    reads labels."""
    legend = list(zip(question.keys, map(canonical_text, question.descriptions), strict=True)) \
        if question.kind == "score" else []
    key = label_option(question.kind, label, legend)
    if key is None:
        raise ValueError(f"the label {label!r} names no option of a {question.kind} question")
    return question.keys.index(key)


def _labelled_rows(model: D3, examples: Sequence[tasks.Example]) -> list[tuple[Row, int]]:
    rows = []
    for example in examples:
        request = example.request
        prepared = model.prepare(request["state"], request["questions"], request.get("images"))
        if prepared.errors:
            raise RuntimeError(f"training request {example.id} has question errors: {prepared.errors}")
        for row in prepared.rows:
            rows.append((row, _option_index(prepared.questions[row.key], example.labels[row.key])))
    return rows


def _frame_tokens(model: D3) -> set[int]:
    """The tokens of the task's prompts around the state: the system turn, the questions and their options
    (a ticket's and a picture's prompts with an empty state)."""
    frame: set[int] = set()
    for questions in (tasks.TICKET_QUESTIONS, tasks.PICTURE_QUESTIONS):
        prepared = model.prepare({"ticket": 0, "text": ""}, questions, None)
        frame |= {token for row in prepared.rows for token in row.ids}
    return frame


def _trained_tokens(model: D3, rows: list[tuple[Row, int]]) -> list[int]:
    """The tokens whose embeddings are trained: those of the training prompts but the frame's (``_frame_tokens``)
    and the added ones (the chat markers, image and video placeholders, whose embeddings vision replaces)."""
    kept = set(model.added_token_ids) | _frame_tokens(model)
    return sorted({token for row, _ in rows for token in row.ids if token not in kept})


def _to_fp32(value: object) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() else value.detach()
    if isinstance(value, tuple):
        return tuple(_to_fp32(item) for item in value)
    return value


def _slots(rows: Sequence[Row], width: int, slot_of: dict[int, int], none: int) -> torch.Tensor:
    """[rows, width]: the offset row of each position's token, left-padded as the runtime pads; positions
    of padding and of untrained tokens get ``none`` (the zero row)."""
    import torch

    slots = torch.full((len(rows), width), none, dtype=torch.long)
    for number, row in enumerate(rows):
        slots[number, width - row.length :] = torch.as_tensor([slot_of.get(token, none) for token in row.ids])
    return slots


def _cache_batches(model: D3, rows: list[tuple[Row, int]], layer: torch.nn.Module,
                   slot_of: dict[int, int], none: int) -> list[_Batch]:
    """Run the frozen backbone over every batch once, keeping the last layer's inputs."""
    import torch

    captured = _Captured()

    def capture(_module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"the last layer's hidden states are a {type(hidden).__name__}, not a tensor")
        captured.hidden = hidden
        captured.kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    handle = layer.register_forward_pre_hook(capture, with_kwargs=True)
    batches = []
    try:
        for start in range(0, len(rows), BATCH_ROWS):
            chunk = rows[start : start + BATCH_ROWS]
            with torch.inference_mode():
                model.forward([row for row, _ in chunk])
            if captured.hidden is None:
                raise RuntimeError("the forward pass did not run the last decoder layer")
            options = torch.as_tensor([row.options for row, _ in chunk])[:, None]
            batches.append(
                _Batch(
                    hidden=captured.hidden.clone().float(),
                    layer_kwargs={k: _to_fp32(v) for k, v in captured.kwargs.items()},
                    targets=torch.as_tensor([target for _, target in chunk]),
                    invalid=torch.arange(model.contract.MAX_OPTIONS)[None] >= options,
                    slots=_slots([row for row, _ in chunk], captured.hidden.shape[1], slot_of, none),
                )
            )
    finally:
        handle.remove()
    return batches


def last_position(layer: Any, hidden: torch.Tensor, kwargs: dict[str, object]) -> torch.Tensor:
    """[rows, hidden]: what the full-attention decoder ``layer`` (a transformers ``Qwen3_5DecoderLayer``, typed
    ``Any``: its submodules are looked up by name) gives at
    the last position for ``hidden`` [rows, width, hidden] and its keyword arguments (``position_embeddings``,
    ``attention_mask``), computing the query, the attention output and the MLP of that position only.

    The last layer's output is read at the last position alone, so the other positions' queries and MLP, most
    of a step's work, are not needed: a training step takes a sixth of the time. The computation is the
    layer's own, step by step, with its modules and transformers' rotary and attention functions;
    ``_check_last_position`` compares it with the layer's forward before training relies on it.
    """
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    attention = layer.self_attn
    rows, width, _ = hidden.shape
    head_dim = attention.head_dim
    normed = layer.input_layernorm(hidden)
    query, gate = torch.chunk(attention.q_proj(normed[:, -1:]).view(rows, 1, -1, head_dim * 2), 2, dim=-1)
    query = attention.q_norm(query).transpose(1, 2)
    key = attention.k_norm(attention.k_proj(normed).view(rows, width, -1, head_dim)).transpose(1, 2)
    value = attention.v_proj(normed).view(rows, width, -1, head_dim).transpose(1, 2)
    cos, sin = cast("tuple[torch.Tensor, torch.Tensor]", kwargs["position_embeddings"])  # as the layer takes them
    query, _ = apply_rotary_pos_emb(query, query, cos[:, -1:], sin[:, -1:])
    key, _ = apply_rotary_pos_emb(key, key, cos, sin)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        mask = mask[..., -1:, :]
    attend = ALL_ATTENTION_FUNCTIONS[attention.config._attn_implementation]  # noqa: SLF001 - how the layer attends
    output, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling)
    output = attention.o_proj(output.reshape(rows, 1, -1) * torch.sigmoid(gate.reshape(rows, 1, -1)))
    state = hidden[:, -1:] + output
    state = state + layer.mlp(layer.post_attention_layernorm(state))
    return state[:, 0]


def _check_last_position(layer: torch.nn.Module, batch: _Batch) -> None:
    """``last_position`` must be what the layer's own forward gives at the last position: refuse to train on a
    transformers whose layer computes something else."""
    import torch

    with torch.no_grad():
        full = layer(batch.hidden, **batch.layer_kwargs)
        full = (full[0] if isinstance(full, tuple) else full)[:, -1]
        shortcut = last_position(layer, batch.hidden, batch.layer_kwargs)
    difference = float((full - shortcut).abs().max())
    if difference > 1e-4 * max(1.0, float(full.abs().max())):
        raise RuntimeError(f"the last layer's last position computed alone differs from its forward by {difference}: "
                           "transformers' Qwen3.5 decoder layer changed, and training would not fit the model served")


def _loss(trainable: _Trainable, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    output = last_position(trainable.layer, batch.hidden + trainable.input_offsets(batch.slots), batch.layer_kwargs)
    logits = trainable.norm(output) @ trainable.readout.T
    log_p = torch.log_softmax(logits.masked_fill(batch.invalid, float("-inf")), dim=-1)
    right = -log_p.gather(1, batch.targets[:, None])[:, 0]
    # Label smoothing over each row's own options (the codes past them can never be answered).
    spread = -log_p.masked_fill(batch.invalid, 0.0).sum(-1) / (~batch.invalid).sum(-1)
    loss = ((1 - LABEL_SMOOTHING) * right + LABEL_SMOOTHING * spread).mean()
    return loss, (log_p.argmax(-1) == batch.targets).float().mean()


def _rate(step: int, steps: int) -> float:
    """The learning rate's factor at ``step``: a linear warm-up over ``WARMUP_FRACTION`` of the steps, then a
    cosine decay to zero."""
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _fit(trainable: _Trainable, batches: list[_Batch], steps: int, seed: int,
         on_step: Callable[[int, float], None] | None) -> list[float]:
    """``steps`` AdamW steps (``_rate``'s schedule), the batches shuffled each epoch; the accuracy of each
    batch of the last (partial) epoch."""
    import torch

    optimizer = torch.optim.AdamW([
        {"params": trainable.parameters(), "lr": LEARNING_RATE},
        {"params": [trainable.offsets], "lr": EMBEDDING_LEARNING_RATE},
    ], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _rate(step, steps))
    order = random.Random(seed + 1)
    sequence: list[int] = []
    correct: list[float] = []
    for step in range(steps):
        if not sequence:
            sequence = list(range(len(batches)))
            order.shuffle(sequence)
            correct = []
        loss, accuracy = _loss(trainable, batches[sequence.pop()])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        correct.append(float(accuracy))
        if on_step is not None:
            on_step(step, float(loss.detach()))
    return correct


def _save_trained(root: Path, trainable: _Trainable, last: int) -> None:
    """The trained layer, norm and embeddings into ``model.safetensors`` (in its BF16), the readout (FP32)
    beside it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(root / "model.safetensors"))
    layer, norm = trainable.layer.state_dict(), trainable.norm.state_dict()
    trained = {f"language_model.layers.{last}.{name}": tensor for name, tensor in layer.items()}
    trained |= {f"language_model.norm.{name}": tensor for name, tensor in norm.items()}
    embeddings = "language_model.embed_tokens.weight"
    # A tensor the file does not hold would be ignored at load time (with only a warning): refuse instead.
    unknown = sorted(set(trained) - set(weights)) + ([embeddings] if embeddings not in weights else [])
    if unknown:
        raise RuntimeError(f"model.safetensors has no tensors named {', '.join(unknown)} to replace")
    for name, tensor in trained.items():
        weights[name] = tensor.detach().to(weights[name].dtype).contiguous()
    table = weights[embeddings].float()
    table[trainable.token_ids] += trainable.offsets.detach()
    weights[embeddings] = table.to(weights[embeddings].dtype).contiguous()
    (root / "model.safetensors").unlink()
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    save_file({"weight": trainable.readout.detach().float().contiguous()}, str(root / "readout.safetensors"))


class Trained(TypedDict):
    """What was trained and how: the manifest's ``identity.trained``."""

    task: str
    steps: int
    seed: int
    tickets: int
    pictures: int
    rows: int
    embedded_tokens: int  # how many tokens' input embeddings were trained
    trained: list[str]  # the modules changed


class Training(Trained):
    """``train_demo``'s report: also the last epoch's accuracy (None: no step run) and the time taken."""

    train_accuracy: float | None
    seconds: float


def _reseal(root: Path, report: Trained, model_name: str | None) -> None:
    """Rewrite the manifest over the new weights, its identity saying what was trained and how."""
    manifest = read_manifest(root) or {}
    identity: dict[str, object] = {k: v for k, v in (manifest.get("identity") or {}).items() if k != "model_sha256"}
    identity["trained"] = report
    write_manifest(root, model_name=model_name or manifest.get("model_name"), repo_id=manifest.get("repo_id"),
                   identity=identity)


def train_demo(
    root: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    tickets: int = TRAIN_TICKETS,
    pictures: int | None = None,
    model_name: str | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> Training:
    """Train the checkpoint in ``root`` in place on ``tasks.draw(tasks.TRAIN_SEED, ...)`` and reseal it.

    Returns what was done (``steps``, ``rows``, ``train_accuracy`` of the last epoch, ``seconds``);
    ``on_step(step, loss)`` reports progress. ``pictures`` defaults to ``TRAIN_PICTURES`` (0 for a
    checkpoint without a vision tower).
    """
    import torch

    if steps < 0:
        raise ValueError(f"steps must be 0 or more, got {steps}")
    root = Path(root)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism for a seed, and a fair share of a shared CPU
    try:
        model = D3(root, device="cpu")
        if pictures is None:
            pictures = TRAIN_PICTURES if model.image_unavailable is None else 0
        layers = model.backbone.language_model.layers
        last = len(layers) - 1
        rows = _labelled_rows(model, tasks.draw(tasks.TRAIN_SEED, tickets, pictures, prefix="train"))
        random.Random(seed).shuffle(rows)
        token_ids = _trained_tokens(model, rows)
        slot_of = {token: slot for slot, token in enumerate(token_ids)}
        batches = _cache_batches(model, rows, layers[last], slot_of, len(token_ids))
        torch.manual_seed(seed)
        trainable = _Trainable.of(model, last, token_ids)
        if batches:
            _check_last_position(trainable.layer, batches[0])
        correct = _fit(trainable, batches, steps, seed, on_step)
        _save_trained(root, trainable, last)
    finally:
        torch.set_num_threads(threads)

    report: Trained = {
        "task": "demo",
        "steps": steps,
        "seed": seed,
        "tickets": tickets,
        "pictures": pictures,
        "rows": len(rows),
        "embedded_tokens": len(token_ids),
        "trained": ["language_model.embed_tokens", f"language_model.layers.{last}", "language_model.norm", "readout"],
    }
    _reseal(root, report, model_name)
    return {**report, "train_accuracy": sum(correct) / len(correct) if correct else None,
            "seconds": round(time.perf_counter() - started, 1)}
