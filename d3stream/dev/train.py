"""Fit a freshly built tiny checkpoint on the synthetic demo task (``d3stream.dev.tasks``), offline, on a CPU.

``train_demo(root, steps=..., seed=...)`` turns the random-weight checkpoint in ``root`` (written by
``build_checkpoint``) into one whose answers follow the requests: route a ticket to its team, say whether
it asks for a refund, how urgent it is, and whether a picture holds a red square.

Only what must change is trained: the last decoder layer, the final norm and the readout. The frozen
layers below are run once per training batch, through the runtime's own ``prepare`` and ``left_padded``
(so the prompts, padding and positions are exactly what serving uses), and the input of the last layer
is kept; every step then runs one layer forward and backward. In a random tiny model the last position's
state hardly depends on the earlier tokens, so a readout alone could not tell tickets apart: the last
layer's attention is what learns to look back at the words (and image patches) that decide.

Training is FP32 on one thread (deterministic for a seed, and polite on a shared CPU); the trained layer
is stored in BF16 like the rest of the backbone, the readout in FP32, and the manifest is rewritten, so
the result is an ordinary checkpoint that any D3 runtime loads and verifies.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream.dev import tasks
from d3stream.runtime import D3, Row
from d3stream.runtime.kinds import Question, canonical_text, label_option
from d3stream.runtime.package import read_manifest, write_manifest

if TYPE_CHECKING:
    import torch

DEFAULT_STEPS = 1000
# Bump when the task or the training changes what the same arguments produce (the demo's cache key).
TRAIN_BUILD = 1
TRAIN_TICKETS = 800
TRAIN_PICTURES = 160
BATCH_ROWS = 32
LEARNING_RATE = 3e-3


@dataclass
class _Batch:
    hidden: torch.Tensor  # [rows, width, hidden] FP32 input of the last layer
    layer_kwargs: dict[str, object]  # its keyword arguments (positions, mask), floats in FP32
    targets: torch.Tensor  # [rows] index of the labelled option
    invalid: torch.Tensor  # [rows, MAX_OPTIONS] True past each row's option count


@dataclass
class _Captured:
    """The inputs of the last layer's most recent call (a forward pre-hook fills it)."""

    hidden: torch.Tensor | None = None
    kwargs: dict[str, object] = field(default_factory=dict)


@dataclass
class _Trainable:
    """What training changes: FP32 copies of the last decoder layer and the final norm, and the readout."""

    layer: torch.nn.Module
    norm: torch.nn.Module
    readout: torch.nn.Parameter

    @classmethod
    def of(cls, model: D3, last: int) -> _Trainable:
        import torch

        language = model.backbone.language_model
        layer = copy.deepcopy(language.layers[last]).float().train().requires_grad_(True)
        norm = copy.deepcopy(language.norm).float().requires_grad_(True)
        return cls(layer, norm, torch.nn.Parameter(model.readout.detach().clone().float()))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.layer.parameters(), *self.norm.parameters(), self.readout]


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


def _to_fp32(value: object) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() else value.detach()
    if isinstance(value, tuple):
        return tuple(_to_fp32(item) for item in value)
    return value


def _cache_batches(model: D3, rows: list[tuple[Row, int]], layer: torch.nn.Module) -> list[_Batch]:
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
                )
            )
    finally:
        handle.remove()
    return batches


def _loss(trainable: _Trainable, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    output = trainable.layer(batch.hidden, **batch.layer_kwargs)
    output = output[0] if isinstance(output, tuple) else output
    logits = trainable.norm(output)[:, -1] @ trainable.readout.T
    logits = logits.masked_fill(batch.invalid, float("-inf"))
    loss = torch.nn.functional.cross_entropy(logits, batch.targets)
    return loss, (logits.argmax(-1) == batch.targets).float().mean()


def _fit(trainable: _Trainable, batches: list[_Batch], steps: int, seed: int,
         on_step: Callable[[int, float], None] | None) -> list[float]:
    """``steps`` AdamW steps with a linearly decaying rate, the batches shuffled each epoch; the accuracy of
    each batch of the last (partial) epoch."""
    import torch

    optimizer = torch.optim.AdamW(trainable.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / max(steps, 1))
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
    """The trained layer and norm into ``model.safetensors`` (in its BF16), the readout (FP32) beside it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(root / "model.safetensors"))
    layer, norm = trainable.layer.state_dict(), trainable.norm.state_dict()
    trained = {f"language_model.layers.{last}.{name}": tensor for name, tensor in layer.items()}
    trained |= {f"language_model.norm.{name}": tensor for name, tensor in norm.items()}
    # A tensor the file does not hold would be ignored at load time (with only a warning): refuse instead.
    unknown = sorted(set(trained) - set(weights))
    if unknown:
        raise RuntimeError(f"model.safetensors has no tensors named {', '.join(unknown)} to replace")
    for name, tensor in trained.items():
        weights[name] = tensor.detach().to(weights[name].dtype).contiguous()
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
        batches = _cache_batches(model, rows, layers[last])
        torch.manual_seed(seed)
        trainable = _Trainable.of(model, last)
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
        "trained": [f"language_model.layers.{last}", "language_model.norm", "readout"],
    }
    _reseal(root, report, model_name)
    return {**report, "train_accuracy": sum(correct) / len(correct) if correct else None,
            "seconds": round(time.perf_counter() - started, 1)}
