"""Pytest plugin: tiny D3 checkpoints and loaded models, built once per test session.

Enable with ``pytest_plugins = ["tests.support.model_fixtures"]`` (``tests/conftest.py`` does). Everything is lazy:
a checkpoint is built (``d3stream.dev.build_checkpoint.build_checkpoint``, ``size="tiny"``, seed 0) the
first time a test asks for it, a model is loaded the first time a test asks for that, and both live for
the rest of the session. Loaded models are shared: a test that changes one must undo it (use
``monkeypatch``), or load its own copy with ``load_model``.

Checkpoints
    ``qwen35_checkpoint``            qwen3_5, causal, with the vision tower (images and videos)
    ``qwen35_text_checkpoint``       qwen3_5, causal, no vision tower (text only)
    ``qwen35_noncausal_checkpoint``  qwen3_5, ``noncausal_full_attention``, vision
    ``qwen3vl_checkpoint``           qwen3_vl, causal, vision (images only)
    ``demo_trained_checkpoint``      the demo's own trained checkpoint (``make-checkpoint --train demo``; not
                                     sharpened: training makes its answers depend on the input), from the
                                     machine's cache (``dev.demo.trained_checkpoint``): trained once per
                                     machine and ``train.TRAIN_BUILD``, by the first suite or ``make demo``,
                                     and reused by every later one
    ``demo_random_checkpoint``       what it was trained from: the builder's random weights, not sharpened
                                     (``dev.demo.demo_checkpoint``, cached likewise)

Models: ``qwen35_model``, ``qwen35_text_model``, ``qwen35_noncausal_model``, ``qwen3vl_model``,
``demo_trained_model``, ``demo_random_model``.

Sharpened weights. The builder draws every weight with transformers' default initialisation (standard
deviation 0.02). In a 64-wide model that makes the last position's hidden state almost a function of the
last prompt token alone: different states, images or questions move the option probabilities by only
about 5e-3, less than the bf16 tolerance the batching tests allow, so a row answered with another
request's image would still "match". ``sharpen_checkpoint`` scales the value/output/MLP projections of
the text layers, gives the query/key norms a larger gain and scales the vision merger's output, then
rewrites the manifest; the checkpoints below are sharpened, so answers really depend on the input
(different images, videos, states or option orders move probabilities by about 0.09 to 0.4), while the BF16
rounding differences between a row answered alone and inside a padded batch stay below about 3e-3 (in FP32
about 3e-6). Stronger sharpening amplifies BF16 rounding too (scale 4 with vision 10 gave 1.1e-2). The
architecture, files and loading path are exactly the builder's.

Helpers usable without pytest: ``build``, ``sharpen_checkpoint``, ``copy_checkpoint``, ``load_model``,
``reference_runtime`` (the reference implementation ``d3_runtime.py.txt`` as a module, or None).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Text-layer weights scaled by SHARPEN_SCALE, query/key norm weights set to SHARPEN_QK_GAIN (the norms
# multiply by 1 + weight), vision merger outputs scaled by SHARPEN_VISION.
SHARPEN_SCALE = 3.0
SHARPEN_QK_GAIN = 1.0
SHARPEN_VISION = 5.0
_SCALED = (
    "v_proj.weight",
    "o_proj.weight",
    "out_proj.weight",
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)
# Files a checkpoint copy links instead of copying (large, and no test edits them in place).
LINKED = ("model.safetensors", "tokenizer.json")

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_RUNTIME = REPO_ROOT.parent / "shared" / "reference" / "d3_runtime.py.txt"


def device_for_tests() -> str | None:
    """``D3STREAM_TEST_DEVICE`` (e.g. ``cuda:0``), else None: the runtime's default (CUDA when present)."""
    return os.environ.get("D3STREAM_TEST_DEVICE") or None


def sharpen_checkpoint(root: str | os.PathLike) -> Path:
    """Scale a tiny checkpoint's weights in place (see the module docstring) and rewrite its manifest."""
    import torch
    from safetensors.torch import load_file, save_file

    from d3stream.runtime.package import read_manifest, write_manifest

    root = Path(root)
    path = root / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if name.startswith("language_model.") and name.endswith(_SCALED):
            tensors[name] = (tensor.float() * SHARPEN_SCALE).to(tensor.dtype)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = torch.full_like(tensor, SHARPEN_QK_GAIN)
        elif name.startswith("visual.") and "merger" in name and name.endswith("linear_fc2.weight"):
            tensors[name] = (tensor.float() * SHARPEN_VISION).to(tensor.dtype)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = read_manifest(root) or {}
    identity = {k: v for k, v in (manifest.get("identity") or {}).items() if k != "model_sha256"}
    identity["sharpened"] = {"scale": SHARPEN_SCALE, "qk_gain": SHARPEN_QK_GAIN, "vision": SHARPEN_VISION}
    write_manifest(
        root, model_name=manifest.get("model_name"), repo_id=manifest.get("repo_id"), identity=identity
    )
    return root


def build(out: str | os.PathLike, *, sharpen: bool = True, **options: Any) -> Path:
    """``build_checkpoint(out, size="tiny", seed=0, **options)``, sharpened unless ``sharpen=False``.

    Built once however many test processes ask (the workers of ``pytest -n``, which share
    ``checkpoint_root``): the first takes a file lock and builds, the others wait and reuse it. The build
    itself is kept between runs (``built_once``): a run on the same machine, CI's fresh clone after a
    session's run included, copies it instead of building and training again."""
    from filelock import FileLock

    out = Path(out)
    built = out.parent / f".{out.name}.built"
    with FileLock(out.parent / f".{out.name}.lock"):
        if built.is_file():
            return Path(built.read_text(encoding="utf-8"))
        options.setdefault("size", "tiny")
        options.setdefault("seed", 0)
        kept, inside = built_once(out.name, sharpen, options)
        shutil.copytree(kept, out, symlinks=True)  # a copy: a test may change its checkpoint's files
        root = out / inside
        built.write_text(str(root), encoding="utf-8")
    return root


# What a kept build depends on besides its options: the code that builds, trains and sharpens it.
_BUILD_SOURCES = ("d3stream/dev/build_checkpoint.py", "d3stream/dev/train.py", "d3stream/dev/tasks.py",
                  "d3stream/runtime/package.py", "d3stream/runtime/format.py", "tests/support/model_fixtures.py")
_KEPT_BUILDS = 16  # the newest kept; older ones (code since changed) are removed


def built_once(name: str, sharpen: bool, options: dict[str, Any]) -> tuple[Path, Path]:
    """A checkpoint built with these options by this code, kept under ``$D3STREAM_CACHE/test-checkpoints``
    (default ~/.cache/d3stream) and built there on first use: its folder, and its root inside it. The key
    hashes the options, the build's sources and the torch and transformers versions, so a change to any of
    them builds anew."""
    import hashlib

    import torch
    import transformers
    from filelock import FileLock

    from d3stream.dev.build_checkpoint import build_checkpoint

    digest = hashlib.sha256(repr((name, sharpen, sorted(options.items()), torch.__version__,
                                  transformers.__version__)).encode())
    for source in _BUILD_SOURCES:
        digest.update((REPO_ROOT / source).read_bytes())
    cache = Path(os.environ.get("D3STREAM_CACHE") or Path.home() / ".cache" / "d3stream") / "test-checkpoints"
    folder = cache / f"{name}-{digest.hexdigest()[:20]}"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / f".{folder.name}.lock"):
        marker = folder / ".root"
        if not marker.is_file():
            staging = cache / f".{folder.name}.staging"
            shutil.rmtree(staging, ignore_errors=True)
            root = build_checkpoint(staging / name, **options)
            root = sharpen_checkpoint(root) if sharpen else Path(root)
            (staging / ".root").write_text(str(Path(root).relative_to(staging)), encoding="utf-8")
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            _forget_old_builds(cache)
        inside = Path(marker.read_text(encoding="utf-8"))
    return folder, inside


def _forget_old_builds(cache: Path) -> None:
    builds = sorted((path for path in cache.iterdir() if path.is_dir() and not path.name.startswith(".")),
                    key=lambda path: path.stat().st_mtime, reverse=True)
    for old in builds[_KEPT_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


def copy_checkpoint(source: str | os.PathLike, destination: str | os.PathLike) -> Path:
    """A copy of a checkpoint directory whose large files (``LINKED``) are symlinks to the source's.

    Edit only the copied files; to replace a linked one, unlink it first.
    """
    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True)
    for path in source.iterdir():
        if path.name.startswith(".") or path.name == "__pycache__":
            continue
        if path.name in LINKED:
            (destination / path.name).symlink_to(path.resolve())
        else:
            shutil.copy2(path, destination / path.name)
    return destination


def load_model(path: str | os.PathLike, **options: Any):
    """``D3.from_pretrained(path, device=device_for_tests(), **options)``."""
    from d3stream.runtime import D3

    options.setdefault("device", device_for_tests())
    return D3.from_pretrained(path, **options)


@lru_cache(maxsize=1)
def reference_runtime() -> ModuleType | None:
    """The reference runtime (``shared/reference/d3_runtime.py.txt`` next to the repository) as a module.

    Its ``from d3_format import ...`` is served by :mod:`d3stream.runtime.format` (the same contract the
    checkpoints ship as ``d3_format.py``). None when the file is absent.
    """
    if not REFERENCE_RUNTIME.is_file():
        return None
    from d3stream.runtime import format as d3_format

    sys.modules.setdefault("d3_format", d3_format)
    name = "d3_reference_runtime"
    loader = importlib.machinery.SourceFileLoader(name, str(REFERENCE_RUNTIME))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while the class body runs
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory, worker_id) -> Path:
    """Where the session's checkpoints are built. The workers of one ``pytest -n`` run share it (the parent of
    their temporary folders is the run's), so a checkpoint, the trained one above all, is built once."""
    if worker_id == "master":  # not under xdist
        return tmp_path_factory.mktemp("d3-checkpoints")
    root = tmp_path_factory.getbasetemp().parent / "d3-checkpoints"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def qwen35_checkpoint(checkpoint_root) -> Path:
    return build(checkpoint_root / "qwen35", backbone="qwen3_5", vision=True)


@pytest.fixture(scope="session")
def qwen35_text_checkpoint(checkpoint_root) -> Path:
    return build(checkpoint_root / "qwen35-text", backbone="qwen3_5", vision=False)


@pytest.fixture(scope="session")
def qwen35_noncausal_checkpoint(checkpoint_root) -> Path:
    return build(
        checkpoint_root / "qwen35-noncausal",
        backbone="qwen3_5",
        vision=True,
        attention_mode="noncausal_full_attention",
    )


@pytest.fixture(scope="session")
def qwen3vl_checkpoint(checkpoint_root) -> Path:
    return build(checkpoint_root / "qwen3vl", backbone="qwen3_vl", vision=True)


@pytest.fixture(scope="session")
def demo_trained_checkpoint() -> Path:
    """The checkpoint ``make demo`` serves, the same files: what the held-out tests judge is what a newcomer
    sees. Trained on the first use on a machine (about a minute; the workers of ``pytest -n`` wait for the
    first), then read from the cache; tests must not change it."""
    from d3stream.dev.demo import trained_checkpoint

    return trained_checkpoint()


@pytest.fixture(scope="session")
def demo_random_checkpoint() -> Path:
    from d3stream.dev.demo import demo_checkpoint

    return demo_checkpoint()


@pytest.fixture(scope="session")
def demo_trained_model(demo_trained_checkpoint):
    return load_model(demo_trained_checkpoint)


@pytest.fixture(scope="session")
def demo_random_model(demo_random_checkpoint):
    return load_model(demo_random_checkpoint)


@pytest.fixture(scope="session")
def qwen35_model(qwen35_checkpoint):
    return load_model(qwen35_checkpoint)


@pytest.fixture(scope="session")
def qwen35_text_model(qwen35_text_checkpoint):
    return load_model(qwen35_text_checkpoint)


@pytest.fixture(scope="session")
def qwen35_noncausal_model(qwen35_noncausal_checkpoint):
    return load_model(qwen35_noncausal_checkpoint)


@pytest.fixture(scope="session")
def qwen3vl_model(qwen3vl_checkpoint):
    return load_model(qwen3vl_checkpoint)


@pytest.fixture(scope="session")
def reference():
    """The reference runtime module; skips the test when ``d3_runtime.py.txt`` is not next to the repo."""
    module = reference_runtime()
    if module is None:
        pytest.skip(f"reference runtime not found at {REFERENCE_RUNTIME}")
    return module


@contextlib.contextmanager
def float32(model):
    """The model's backbone in FP32 for the duration; afterwards every parameter and buffer has its old dtype
    again (BF16 -> FP32 -> BF16 is exact; FP32 buffers such as RoPE frequencies are left FP32)."""
    modules = dict(model.backbone.named_modules())
    dtypes = {
        (name, kind, key): tensor.dtype
        for name, module in modules.items()
        for kind in ("_parameters", "_buffers")
        for key, tensor in getattr(module, kind).items()
        if tensor is not None
    }
    model.backbone.float()
    try:
        yield model
    finally:
        for (name, kind, key), dtype in dtypes.items():
            tensor = getattr(modules[name], kind)[key]
            if tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
