"""What runs on the device, and how: SDPA backends, host-to-device copies, the Gated DeltaNet kernels, the
vision patch embedding.

These are the choices below the model's numerics that a checkpoint does not make: which attention kernels
SDPA may pick, whether host tensors go through pinned memory, which implementation transformers bound for
each Gated DeltaNet op (provenance's ``kernels``), and the vision patch embedding run as the matrix product
it equals. Loading (``loading.py``) applies them once; the forward and vision parts use the copies and the
SDPA choice on every pass.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

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
# Module prefixes of the kernel packages a Gated DeltaNet op may be bound to (hub ``kernels`` too).
KERNEL_PACKAGES = ("fla", "causal_conv1d", "kernels")


def sdpa_backends(device: torch.device | str) -> contextlib.AbstractContextManager[object]:
    """On CUDA, keep SDPA off the cuDNN backend (``D3_CUDNN_SDPA=1`` restores PyTorch's choice)."""
    import torch

    if torch.device(device).type != "cuda" or not torch.version.cuda or os.environ.get("D3_CUDNN_SDPA") == "1":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def host_transfer(device: torch.device | str) -> tuple[bool, bool]:
    """(pin, non_blocking) for copying host tensors to ``device``: on CUDA the batch is built in pinned
    (page-locked) memory and copied without blocking the host, so the next pass's preparation overlaps the
    copy; elsewhere both are pointless (a CPU "copy" is a no-op, and pinning needs a CUDA driver)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return cuda, cuda


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device``, through pinned memory with non-blocking copies where that pays
    (``host_transfer``). PyTorch's caching host allocator keeps a pinned buffer alive until its copy is done."""
    pin, non_blocking = host_transfer(device)
    return tuple((t.pin_memory() if pin else t).to(device, non_blocking=non_blocking) for t in tensors)


# ------------------------------------------------------------------------------ Gated DeltaNet kernels


def _bound(function: object) -> str:
    """``module.function`` of the kernel package ``function`` (a transformers wrapper) closes over, else
    ``torch-reference``."""
    seen: set[int] = set()
    stack = [function]
    while stack:
        current = stack.pop()
        if id(current) in seen or not callable(current):
            continue
        seen.add(id(current))
        module = getattr(current, "__module__", "") or ""  # any callable: a function, a class, a partial
        if module.startswith(KERNEL_PACKAGES):
            return f"{module}.{getattr(current, '__name__', '?')}"
        for cell in getattr(current, "__closure__", None) or ():  # functions and bound methods have one
            with contextlib.suppress(ValueError):  # an empty cell
                stack.append(cell.cell_contents)
    return REFERENCE_KERNEL


def _gated_deltanet_functions() -> dict[str, Callable[..., object]]:
    """The Gated DeltaNet functions transformers' qwen3_5 modeling defines, by name, as bound now."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    found = vars(qwen)
    return {name: found[name] for name in GATED_DELTANET_FUNCTIONS if name in found}


def kernel_report() -> dict[str, str]:
    """Which implementation transformers bound for each Gated DeltaNet op: ``module.function`` of a kernel
    package (``fla...``, ``causal_conv1d...``, hub ``kernels...``) or ``torch-reference``.

    transformers wraps each function in a closure over the implementation it picked; the closures are
    walked rather than the packages imported here, so the report says what really runs, not what is installed.
    """
    return {name: _bound(function) for name, function in _gated_deltanet_functions().items()}


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Run transformers' reference PyTorch code for every Gated DeltaNet op for the duration, whatever kernel
    package it bound: the fast kernels' check (``bench.kernel_check``) answers the same requests both ways
    with the same weights in one process. The model code calls these functions by their module-level
    names, and ``functools.wraps`` leaves the reference under each wrapper's ``__wrapped__``."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    saved = _gated_deltanet_functions()
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


def gpu_only_kernels(kernels: Mapping[str, str]) -> bool:
    """True when a bound kernel runs on GPUs only (flash-linear-attention, causal-conv1d)."""
    return any(implementation.startswith(("fla", "causal_conv1d")) for implementation in kernels.values())


# ------------------------------------------------------------------------------ vision patch embedding


class PatchEmbed(Protocol):
    """A vision patch embedding as ``linearize_patch_embed`` finds it: a Conv3d ``proj`` and its width."""

    proj: torch.nn.Conv3d
    embed_dim: int


def _patch_embed_as_matmul(self: PatchEmbed, hidden_states: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    weight = self.proj.weight
    flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(flat, weight.reshape(weight.shape[0], -1), self.proj.bias).view(-1, self.embed_dim)


def linearize_patch_embed(model: torch.nn.Module) -> int:
    """Run each vision patch embedding as the matrix product it equals; returns how many were found.

    The embedding is a Conv3d whose kernel equals its stride over inputs already cut into patches: a
    linear map of each flattened patch. Some convolution backends search a new kernel for every new
    patch count, which would stall on each new image size; the product has no such cost.
    """
    import torch

    count = 0
    for module in model.modules():
        # Whichever module has a Conv3d ``proj`` and an ``embed_dim`` is a patch embedding (``PatchEmbed``).
        proj = getattr(module, "proj", None)
        if (
            isinstance(proj, torch.nn.Conv3d)
            and tuple(proj.kernel_size) == tuple(proj.stride)
            and hasattr(module, "embed_dim")
        ):
            module.forward = types.MethodType(_patch_embed_as_matmul, module)
            count += 1
    return count
