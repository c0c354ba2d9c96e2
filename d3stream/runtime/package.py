"""Checkpoint package files: ``MODEL_MANIFEST.json`` (schema ``d3-package-manifest/1``) and its check.

A D3 checkpoint directory may carry a manifest listing the SHA-256 and size of every other file in it::

    {"schema": "d3-package-manifest/1", "model_name": ..., "repo_id": ...,
     "identity": {"model_sha256": ..., ...}, "files_sha256": {name: hex}, "files_bytes": {name: n}}

``write_manifest`` writes it for a finished directory; ``verify_package`` checks a directory against it
before a runtime loads it (``fast``: hash every file up to 64 MiB and size-check larger ones; ``full``: hash
everything; ``none``: only read the manifest). A directory without a manifest loads unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

MANIFEST = "MODEL_MANIFEST.json"
MANIFEST_SCHEMA = "d3-package-manifest/1"
VERIFY_MODES = ("fast", "full", "none")
# "fast" verification hashes every file up to this size and checks the size of larger ones.
FAST_HASH_BYTES = 64 << 20
# Names never listed in a manifest: bytecode caches appear when a runtime imports a package's .py files.
_SKIPPED_PARTS = ("__pycache__",)


class Manifest(TypedDict, total=False):
    """``MODEL_MANIFEST.json``: ``write_manifest`` writes every field; a manifest read back is only checked for
    its ``schema``, so a field may be missing."""

    schema: str
    model_name: str
    repo_id: str | None
    identity: dict[str, object]  # model_sha256, then the fields the writer added (seed, backbone, ...)
    files_sha256: dict[str, str]  # file name -> hex SHA-256
    files_bytes: dict[str, int]  # file name -> size


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def package_files(root: str | os.PathLike[str]) -> list[str]:
    """The files a manifest lists: every regular file under ``root`` (POSIX relative names, sorted), except
    the manifest itself, hidden files and folders, and ``__pycache__`` folders."""
    root = Path(root)
    names = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if any(part.startswith(".") or part in _SKIPPED_PARTS for part in relative.parts):
            continue
        if not path.is_file() or relative.as_posix() == MANIFEST:
            continue
        names.append(relative.as_posix())
    return sorted(names)


def model_sha256(root: str | os.PathLike[str]) -> str | None:
    """The checkpoint's weight identity: SHA-256 of ``model.safetensors``, or of the shard index for sharded
    weights (the index names the shards, whose own hashes are in ``files_sha256``)."""
    root = Path(root)
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (root / name).is_file():
            return sha256_file(root / name)
    return None


def write_manifest(
    root: str | os.PathLike[str],
    *,
    model_name: str | None = None,
    repo_id: str | None = None,
    identity: Mapping[str, object] | None = None,
) -> Manifest:
    """Write ``MODEL_MANIFEST.json`` for the files now in ``root`` and return it.

    ``identity`` adds fields (seed, backbone, ...) after ``model_sha256``; ``model_name`` defaults to the
    directory name. The file is deterministic: the same files give the same bytes.
    """
    root = Path(root)
    names = package_files(root)
    if not names:
        raise ValueError(f"{root} holds no files to list in {MANIFEST}")
    manifest: Manifest = {
        "schema": MANIFEST_SCHEMA,
        "model_name": model_name or root.resolve().name,
        "repo_id": repo_id,
        "identity": {"model_sha256": model_sha256(root), **dict(identity or {})},
        "files_sha256": {name: sha256_file(root / name) for name in names},
        "files_bytes": {name: (root / name).stat().st_size for name in names},
    }
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    temporary = root / f".{MANIFEST}.tmp"
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, root / MANIFEST)
    return manifest


def read_manifest(root: str | os.PathLike[str]) -> Manifest | None:
    """The parsed manifest of ``root`` (None without one); ValueError when it is not a d3 manifest."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest: Manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise ValueError(f"{MANIFEST} is not a {MANIFEST_SCHEMA} manifest")
    return manifest


def verify_package(root: str | os.PathLike[str], mode: str = "fast") -> Manifest | None:
    """Check the files of ``root`` against ``MODEL_MANIFEST.json``; returns the manifest (None without one).

    ``fast`` hashes every listed file up to ``FAST_HASH_BYTES`` and checks the size of larger ones, ``full``
    hashes every listed file, ``none`` only reads the manifest. A problem raises ValueError naming the files
    (``package verification failed: readout.safetensors: SHA-256 differs from MODEL_MANIFEST.json``).
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    root = Path(root)
    manifest = read_manifest(root)
    if manifest is None or mode == "none":
        return manifest
    sizes = manifest.get("files_bytes") or {}
    problems = []
    for name, digest in sorted((manifest.get("files_sha256") or {}).items()):
        target = root / name
        if not target.is_file():
            problems.append(f"missing {name}")
            continue
        size = target.stat().st_size
        if name in sizes and size != sizes[name]:
            problems.append(f"{name}: {size} bytes, manifest says {sizes[name]}")
            continue
        if mode == "full" or size <= FAST_HASH_BYTES:
            if sha256_file(target) != digest:
                problems.append(f"{name}: SHA-256 differs from {MANIFEST}")
    if problems:
        raise ValueError("package verification failed: " + "; ".join(problems[:8]))
    return manifest
