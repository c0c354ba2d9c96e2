"""Where checkpoints come from: a local directory, or an ``s3://bucket/prefix/`` downloaded to a local cache.

``--model`` takes ``PATH`` or ``NAME=PATH`` (``parse_model_spec``; several of them for a worker serving
several models, the first the default), where PATH is a checkpoint directory or an ``s3://`` prefix. A checkpoint in
object storage is fetched once into ``model_cache_dir`` and loaded from there like any local one:

* the location is checked against ``model_allowlist`` before any network call (the same rule as
  ``media_allowlist``: ``bucket`` or ``bucket/prefix``, whole path segments). It is a setting of its own
  because the two guard different things: media references come from untrusted producers, checkpoints
  from the operator (and later from a watched pointer file). Allowing a bucket for one must not allow it
  for the other: a model bucket in the media allowlist would let any producer make workers read weights.
* the checkpoint must carry ``MODEL_MANIFEST.json``; it is read first, and the cache entry is named by its
  SHA-256, so a second start finds the copy after one small GET, and a changed manifest means a new copy.
* every file the manifest lists is streamed to a staging folder and hashed as it arrives (full SHA-256,
  whatever ``verify`` says for local checkpoints); a missing, short, long or altered file refuses the
  whole checkpoint with a ``CheckpointError`` naming the file, and nothing is left in the cache. Only a
  complete, verified copy is renamed into place, so a killed download is never mistaken for a copy.

Credentials, endpoint, region, timeouts and retries are the media settings' (``s3_*``, the AWS chain).

A watched **model source** (docs/MODELS.md) is a directory or ``s3://`` prefix holding checkpoints, one
per sub-folder, and a pointer file ``CURRENT.json`` naming the current one and an optional canary with its
share; ``resolve_source`` reads it. ``rollout.py`` watches it and swaps models without a stop.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import structlog

from d3stream.core.storage import (
    Allowlist,
    GetObjectResponse,
    MediaError,
    S3Client,
    S3Location,
    parse_s3_reference,
    s3_client,
)
from d3stream.runtime.package import MANIFEST, MANIFEST_SCHEMA
from d3stream.settings import StorageSettings, cache_root

log = structlog.get_logger(__name__)

# A model's name in NAME=PATH, and a checkpoint's name inside a model source: one path segment.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# The pointer file of a model source and its schema.
POINTER = "CURRENT.json"
POINTER_SCHEMA = "d3-model-pointer/1"
# Manifests and pointers are small JSON files; a larger object is not one.
MAX_SMALL_OBJECT_BYTES = 16 << 20
# Bytes read from the store per chunk while a checkpoint file is written and hashed.
CHUNK_BYTES = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint (or model source) that cannot be used; the message names the file or setting."""


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` value: an optional name (what requests route by and answers carry) and a location."""

    name: str | None
    location: str

    @property
    def in_object_store(self) -> bool:
        return self.location.startswith("s3://")


def parse_model_spec(text: str) -> ModelSpec:
    """``PATH`` or ``NAME=PATH`` -> ModelSpec. NAME is one segment of letters, digits, ``.``, ``_``, ``-``;
    anything else before a ``=`` (a ``/``, a ``:``) makes the whole text a path (write ``./a=b`` for a
    directory whose name holds ``=``)."""
    text = text.strip()
    name, equals, location = text.partition("=")
    if equals and MODEL_NAME.fullmatch(name):
        if not location:
            raise CheckpointError(f"--model {text!r}: NAME= needs a checkpoint directory or s3:// prefix after it")
        return ModelSpec(name, location)
    if not text:
        raise CheckpointError("--model is empty: give a checkpoint directory or an s3://bucket/prefix/")
    return ModelSpec(None, text)


def parse_model_specs(texts: Iterable[str]) -> list[ModelSpec]:
    """Several ``--model`` values (the first is the default model); a name given twice is refused."""
    specs = [parse_model_spec(text) for text in texts]
    names = [spec.name for spec in specs if spec.name is not None]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise CheckpointError(f"--model names {', '.join(repeated)} more than once")
    return specs


@dataclass(frozen=True)
class ObjectStoreAccess:
    """What reading checkpoints from object storage needs: the allowlist, the cache and the client settings."""

    allowlist: tuple[str, ...]
    cache_dir: Path
    endpoint_url: str | None = None
    region: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    max_attempts: int = 4

    @classmethod
    def from_settings(cls, storage: StorageSettings) -> ObjectStoreAccess:
        return cls(
            allowlist=tuple(storage.model_allowlist),
            cache_dir=Path(storage.model_cache_dir).expanduser() if storage.model_cache_dir else default_cache_dir(),
            endpoint_url=storage.s3_endpoint_url,
            region=storage.s3_region,
            connect_timeout=storage.s3_connect_timeout,
            read_timeout=storage.s3_read_timeout,
            max_attempts=storage.s3_max_attempts,
        )

    def client(self) -> S3Client:
        return s3_client(
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            max_attempts=self.max_attempts,
        )


def default_cache_dir() -> Path:
    """``$D3STREAM_CACHE/models``, by default ``~/.cache/d3stream/models``."""
    return cache_root() / "models"


@dataclass(frozen=True)
class ResolvedModel:
    """A ``--model`` value made local: the directory to load and the name it was given (None: the manifest's)."""

    path: Path
    name: str | None


def resolve_model(text: str, storage: StorageSettings | None, *, client: S3Client | None = None) -> ResolvedModel:
    """The local directory of one ``--model`` value: a directory as given, an ``s3://`` prefix fetched
    into the cache first (``fetch_checkpoint``)."""
    spec = parse_model_spec(text)
    if not spec.in_object_store:
        return ResolvedModel(Path(spec.location).expanduser(), spec.name)
    if storage is None:
        raise CheckpointError(f"{text}: an s3:// checkpoint needs the object store settings")
    return ResolvedModel(fetch_checkpoint(spec.location, ObjectStoreAccess.from_settings(storage), client=client),
                         spec.name)


def model_name_for(resolved: ResolvedModel, model_name: str | None) -> str | None:
    """The name answers carry: ``model_name`` or the NAME of ``NAME=PATH``; both and different is refused."""
    if model_name and resolved.name and model_name != resolved.name:
        raise CheckpointError(
            f"--model names the model {resolved.name!r} but model_name says {model_name!r}: give one of them"
        )
    return model_name or resolved.name


# ------------------------------------------------------------------------------------------ object storage


def checkpoint_location(uri: str, allowlist: Iterable[str]) -> S3Location:
    """``s3://bucket/prefix[/]`` -> the prefix's location (key without a trailing slash), refused before any
    network call when it is malformed or outside ``model_allowlist``."""
    trimmed = uri.rstrip("/")
    try:
        location = parse_s3_reference(trimmed)
    except MediaError as exc:
        raise CheckpointError(f"--model {uri!r}: {exc.message.replace('media', 'checkpoints')}") from exc
    if location.version_id:
        raise CheckpointError(f"--model {uri!r}: a checkpoint is a prefix; versionId applies to single objects")
    if not Allowlist(list(allowlist)).allows(S3Location(location.bucket, f"{location.key}/{MANIFEST}")):
        raise CheckpointError(
            f"{location.uri}/ is outside the buckets and prefixes checkpoints may come from "
            f"(setting: model_allowlist, e.g. --model-allowlist {location.bucket}/{location.key})"
        )
    return location


def fetch_checkpoint(uri: str, access: ObjectStoreAccess, *, client: S3Client | None = None) -> Path:
    """The local, verified copy of the checkpoint at ``uri`` (``s3://bucket/prefix/``), downloaded when the
    cache holds no copy of its current manifest. CheckpointError names what is wrong."""
    location = checkpoint_location(uri, access.allowlist)
    client = client if client is not None else access.client()
    manifest_bytes = _read_small(client, location, MANIFEST, "a checkpoint in object storage must carry "
                                 f"{MANIFEST} (d3stream make-checkpoint writes one)")
    files, sizes = _listed_files(manifest_bytes, f"{location.uri}/{MANIFEST}")
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    target = access.cache_dir / "s3" / location.bucket / location.key / digest
    if (target / MANIFEST).is_file():
        log.info("checkpoint cached", uri=f"{location.uri}/", path=str(target))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.partial-", dir=target.parent))
    try:
        total = _download_files(client, location, files, sizes, staging)
        (staging / MANIFEST).write_bytes(manifest_bytes)
        try:
            staging.rename(target)
        except OSError:
            if not (target / MANIFEST).is_file():  # another process renamed its copy first: use that one
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("checkpoint downloaded", uri=f"{location.uri}/", path=str(target), files=len(files), bytes=total)
    return target


def _json_object(data: bytes, where: str, schema: str, refusal: str) -> dict[str, object]:
    """A JSON object whose ``schema`` field is ``schema``; CheckpointError naming ``where`` otherwise."""
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("schema") != schema:
        raise CheckpointError(f"{where} {refusal}")
    return document


def _listed_files(data: bytes, where: str) -> tuple[dict[str, str], dict[str, object]]:
    """What the manifest of a checkpoint to download lists: each file's SHA-256 by name (every name checked to
    stay inside the checkpoint) and the sizes it gives (``files_bytes``, by name)."""
    manifest = _json_object(data, where, MANIFEST_SCHEMA, f"is not a {MANIFEST_SCHEMA} manifest")
    files = manifest.get("files_sha256")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{where} lists no files (files_sha256): there is nothing to verify a download with")
    for name, value in files.items():
        if not _inside(name) or not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            raise CheckpointError(f"{where}: {name!r} is not a file name inside the checkpoint with a SHA-256")
    sizes = manifest.get("files_bytes") or {}
    if not isinstance(sizes, dict):
        raise CheckpointError(f"{where}: files_bytes must map file names to sizes")
    return files, sizes


def _inside(name: str) -> bool:
    """A relative POSIX name that cannot leave the checkpoint folder (nor write the manifest itself)."""
    segments = name.split("/")
    return (name != MANIFEST and "\\" not in name and "\x00" not in name
            and all(segment not in ("", ".", "..") and not segment.startswith(".") for segment in segments))


def _download_files(
    client: S3Client, location: S3Location, files: Mapping[str, str], sizes: Mapping[str, object], staging: Path
) -> int:
    """Every listed file into ``staging``, hashed as it arrives; the first problem raises, naming the file."""
    total = 0
    for name, expected in sorted(files.items()):
        uri = f"{location.uri}/{name}"
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        limit = sizes.get(name)
        digest, size = _stream_to_file(client, location.bucket, f"{location.key}/{name}", path, uri, limit)
        if isinstance(limit, int) and size != limit:
            raise CheckpointError(f"{uri}: {size} bytes, {MANIFEST} says {limit} (a partial or altered upload); "
                                  "the checkpoint is refused")
        if digest != expected:
            raise CheckpointError(f"{uri}: SHA-256 differs from {MANIFEST} (altered or corrupted); "
                                  "the checkpoint is refused")
        total += size
    return total


def _stream_to_file(
    client: S3Client, bucket: str, key: str, path: Path, uri: str, limit: object
) -> tuple[str, int]:
    """Write an object to ``path`` in chunks and return its SHA-256 and size; stops one byte past ``limit`` (the
    manifest's size, when it gives a whole number)."""
    body = _get(client, bucket, key, uri, "it is listed in the manifest")["Body"]
    digest = hashlib.sha256()
    size = 0
    cap = limit + 1 if isinstance(limit, int) else None
    try:
        with open(path, "wb") as stream:
            while cap is None or size < cap:
                chunk = body.read(CHUNK_BYTES if cap is None else min(CHUNK_BYTES, cap - size))
                if not chunk:
                    break
                digest.update(chunk)
                stream.write(chunk)
                size += len(chunk)
    except OSError as exc:
        raise CheckpointError(f"{uri}: could not be written to the model cache ({exc}; setting: model_cache_dir)") \
            from exc
    finally:
        body.close()
    return digest.hexdigest(), size


def _get(client: S3Client, bucket: str, key: str, uri: str, missing_hint: str) -> GetObjectResponse:
    """``get_object``, its failures as CheckpointError naming the object and the settings to check."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NoSuchBucket", "NotFound") or status == 404:
            raise CheckpointError(f"{uri} is missing from the object store; {missing_hint}") from exc
        if code in ("403", "AccessDenied") or status == 403:
            raise CheckpointError(f"{uri}: access denied with this worker's credentials (AWS credential chain)") \
                from exc
        raise CheckpointError(f"{uri}: object store error {code or status}") from exc
    except BotoCoreError as exc:
        raise CheckpointError(f"{uri}: the object store did not answer ({type(exc).__name__}); settings: "
                              "s3_endpoint_url, s3_read_timeout, s3_max_attempts") from exc


def _read_small(client: S3Client, location: S3Location, name: str, missing_hint: str) -> bytes:
    """A manifest or pointer object's bytes (at most ``MAX_SMALL_OBJECT_BYTES``)."""
    uri = f"{location.uri}/{name}"
    body = _get(client, location.bucket, f"{location.key}/{name}", uri, missing_hint)["Body"]
    try:
        data = body.read(MAX_SMALL_OBJECT_BYTES + 1)
    finally:
        body.close()
    if len(data) > MAX_SMALL_OBJECT_BYTES:
        raise CheckpointError(f"{uri} is larger than {MAX_SMALL_OBJECT_BYTES:,} bytes; it is not a {name}")
    return data


# ------------------------------------------------------------------------------------------ model sources


@dataclass(frozen=True)
class Canary:
    """A candidate checkpoint and the share of requests routed to it (0 to 1)."""

    location: str
    share: float


@dataclass(frozen=True)
class SourcePointer:
    """What a model source's pointer says now: the current checkpoint's location and an optional canary."""

    current: str
    canary: Canary | None = None


def resolve_source(
    source: str, access: ObjectStoreAccess | None = None, *, client: S3Client | None = None
) -> SourcePointer:
    """Read the pointer of a model source (a directory or an ``s3://`` prefix, docs/MODELS.md) and return
    the locations of its current checkpoint and canary, as ``--model`` takes them."""
    if source.startswith("s3://"):
        if access is None:
            raise CheckpointError(f"{source}: reading a model source in object storage needs its settings")
        location = checkpoint_location(source, access.allowlist)
        client = client if client is not None else access.client()
        data = _read_small(client, location, POINTER, f"a model source names its current checkpoint in {POINTER}")
        return parse_pointer(data, f"{location.uri}/")
    root = Path(source).expanduser()
    try:
        data = (root / POINTER).read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointError(f"{root / POINTER} is missing: a model source names its current checkpoint "
                              "there") from exc
    return parse_pointer(data, f"{root}{os.sep}")


def parse_pointer(data: bytes, source: str) -> SourcePointer:
    """A pointer document -> the checkpoints' locations under ``source`` (which ends with its separator).

    ``{"schema": "d3-model-pointer/1", "current": NAME, "canary": {"checkpoint": NAME, "share": 0.05}}``;
    a NAME is one path segment, so a pointer can only name checkpoints inside its own source."""
    where = f"{source}{POINTER}"
    document = _json_object(data, where, POINTER_SCHEMA,
                            f"is not a {POINTER_SCHEMA} pointer (its \"schema\" must say so)")
    unknown = sorted(set(document) - {"schema", "current", "canary"})
    if unknown:
        raise CheckpointError(f"{where}: unknown fields {', '.join(unknown)}")
    current = _checkpoint_name(document.get("current"), where, "current")
    canary = None
    if document.get("canary") is not None:
        canary = _parse_canary(document["canary"], where, source)
        if canary.location == source + current:
            raise CheckpointError(f"{where}: the canary is the current checkpoint {current!r}")
    return SourcePointer(current=source + current, canary=canary)


def _parse_canary(value: object, where: str, source: str) -> Canary:
    if not isinstance(value, dict) or set(value) != {"checkpoint", "share"}:
        raise CheckpointError(f"{where}: canary must be {{\"checkpoint\": NAME, \"share\": 0..1}}")
    name = _checkpoint_name(value["checkpoint"], where, "canary.checkpoint")
    share = value["share"]
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= float(share) <= 1.0:
        raise CheckpointError(f"{where}: canary.share must be a number from 0 to 1, got {share!r}")
    return Canary(location=source + name, share=float(share))


def _checkpoint_name(value: object, where: str, field: str) -> str:
    if not isinstance(value, str) or not MODEL_NAME.fullmatch(value) or value in (".", ".."):
        raise CheckpointError(f"{where}: {field} must name a checkpoint folder of the source (one path segment "
                              f"of letters, digits, '.', '_', '-'), got {value!r}")
    return value


# ------------------------------------------------------------------------------------------ memory at start

# Bytes per parameter of each safetensors dtype. The backbone (model*.safetensors) always loads in BF16
# (runtime/model.py), whatever it is stored in; other files (the readout) load as stored.
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
BACKBONE_BYTES = 2


def checkpoint_memory_bytes(path: Path) -> int:
    """The memory a checkpoint's weights take once loaded: parameter count x dtype size, read from the
    safetensors headers (a few KiB each) before anything is loaded."""
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        backbone = file.name.startswith("model")
        for tensor in _safetensors_header(file).values():
            count = 1
            for size in tensor["shape"]:
                count *= int(size)
            total += count * (BACKBONE_BYTES if backbone else DTYPE_BYTES.get(tensor["dtype"], 4))
    return total


class TensorHeader(TypedDict):
    """One tensor's entry in a safetensors header."""

    dtype: str  # F32, BF16, ... (``DTYPE_BYTES``)
    shape: list[int]
    data_offsets: list[int]


def _safetensors_header(file: Path) -> dict[str, TensorHeader]:
    """The tensors' dtypes and shapes: an 8-byte little-endian length, then that much JSON."""
    with file.open("rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if not 0 < length <= MAX_SMALL_OBJECT_BYTES:
            raise CheckpointError(f"{file}: not a safetensors file (header of {length} bytes)")
        header = json.loads(stream.read(length))
    return {name: value for name, value in header.items() if name != "__metadata__"}


def available_memory_bytes(device: str) -> int:
    """Free memory where the weights will live: the GPU's free memory (``torch.cuda.mem_get_info``), or the
    host's available memory for a CPU device."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def check_models_fit(needs: Mapping[str, int], device: str, bound: int | None = None) -> None:
    """Refuse, before any model is loaded, models whose weights together exceed ``bound`` (setting
    ``model_memory_bytes``) or, without one, the device's free memory. The message names every model and
    what it needs. Only weights are counted: passes need activations on top (``max_batch_tokens``)."""
    total = sum(needs.values())
    available = bound if bound is not None else available_memory_bytes(device)
    if total <= available:
        return
    each = ", ".join(f"{name} {_mib(size)}" for name, size in needs.items())
    where = f"model_memory_bytes ({_mib(available)})" if bound is not None else f"free memory on {device} ({_mib(available)})"
    raise CheckpointError(
        f"the models do not fit: their weights need {_mib(total)} ({each}), more than {where}. "
        "Serve fewer models per worker (--model), or raise model_memory_bytes if the bound is too tight"
    )


def _mib(size: int) -> str:
    return f"{size / (1 << 20):,.1f} MiB"
