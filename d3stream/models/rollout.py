"""Rolling out models on a live stream: a watched model source swapped without a stop, and the canary share.

A **model source** (setting ``model_source``; docs/MODELS.md) is a directory or ``s3://`` prefix of
checkpoints, one per folder, with a pointer ``CURRENT.json`` naming the current one and an optional canary.
The worker serves the current checkpoint as its default model, under its folder's name, and ``Rollout``
reads the pointer every ``model_source_poll_ms``. When it names a checkpoint not served yet:

1. the checkpoint is fetched (``s3://``: downloaded and verified file by file) and loaded with every file's
   full SHA-256 checked against its manifest, and its format version, on a thread of its own: the event loop
   and the consumer's poll never wait for it;
2. it is warmed up by one forward pass on the worker's model thread (in turn with the served models'
   passes: one device, passes never side by side); a pass that fails or answers no probability refuses it;
3. its provenance record is published, then, between two fetches, routing switches in one step on the
   event loop: requests admitted from then on go to the new model; requests already routed to the old one
   are answered by it (its rows are in its own scheduler), and it is dropped once they are.

The consumer is never touched: no rebalance, no pause. A checkpoint refused (a manifest mismatch, a
tampered file, another format version, a failed warm-up) is logged naming it and why and counted
(``d3stream_model_swaps_total{outcome=...}``); the old model keeps serving, and the same pointer is not
tried again until it changes.

**Canary** (``--canary NAME=SHARE``, or the pointer's ``canary``, which replaces it): a request that names
no model goes to the candidate when a hash of its id falls under the share, else to the default. The split
depends only on the id, so a retried request meets the same model, and every worker of a group splits alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog
from d3stream_client.contract import Request

from d3stream.core.pipeline import RequestPipeline
from d3stream.core.routing import Hosted
from d3stream.core.storage import S3Client
from d3stream.models.checkpoints import (
    MODEL_NAME,
    CheckpointError,
    ObjectStoreAccess,
    SourcePointer,
    check_models_fit,
    checkpoint_memory_bytes,
    fetch_checkpoint,
    resolve_source,
)
from d3stream.ops.collector import collect_released
from d3stream.ops.metrics import Metrics
from d3stream.runtime import D3
from d3stream.settings import ModelSettings, StorageSettings

log = structlog.get_logger(__name__)

# How often a retired model is looked at until the requests routed to it are answered.
DRAIN_CHECK_S = 0.05
# The question a new checkpoint answers once before it serves (one forward pass).
WARMUP_QUESTIONS = {"warm-up": {"type": "noul", "question": "Is this a warm-up?"}}


class RefusedCheckpoint(Exception):  # a refusal, with the outcome the metric counts
    """A checkpoint the pointer names that will not serve: ``outcome`` is the metric's label."""

    def __init__(self, location: str, outcome: str, why: str):
        self.location, self.outcome, self.why = location, outcome, why
        super().__init__(f"{location}: {why}")


# ------------------------------------------------------------------------------------------------ canary


def share_point(request_id: str) -> float:
    """Where a request id falls in [0, 1): the first 8 bytes of its SHA-256, so every worker agrees."""
    return int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big") / 2.0**64


def parse_canary(text: str) -> tuple[str, float]:
    """``NAME=SHARE`` (setting ``canary``) -> (name, share); ValueError naming the setting otherwise."""
    name, equals, share_text = text.strip().partition("=")
    try:
        share = float(share_text)
    except ValueError:
        share = math.nan
    if not equals or not MODEL_NAME.fullmatch(name) or not 0.0 <= share <= 1.0:
        raise ValueError(f"canary must be NAME=SHARE, a served model's name and a share from 0 to 1 "
                         f"(e.g. --canary d3-v5=0.05), got {text!r}")
    return name, share


@dataclass(frozen=True)
class CanaryRoute:
    """A served candidate and the share of the requests naming no model that it answers."""

    hosted: Hosted
    share: float

    def takes(self, request: Request) -> bool:
        return share_point(request.id) < self.share


# ---------------------------------------------------------------------------------------- checkpoints


def checkpoint_folder(location: str) -> str:
    """A source checkpoint's name: its folder's (``/srv/models/d3-v5`` and ``s3://b/models/d3-v5`` -> d3-v5)."""
    return location.rstrip("/").rsplit("/", 1)[-1]


class SourceModel(D3):
    """A checkpoint of the model source, as ``load_checkpoint`` loads it: it knows where the pointer named it,
    so a later pointer may retire it (models given with --model stay)."""

    model_source_location: str


def load_checkpoint(location: str, models: ModelSettings, storage: StorageSettings,
                    served: Sequence[Path] = ()) -> SourceModel:
    """Load a checkpoint of a model source under its folder's name, every file's full SHA-256 checked
    against its manifest (a pointer can be changed by anyone who can write to the source), its format
    version checked by the runtime; first, its weights and those of the ``served`` checkpoints must fit
    together (``model_memory_bytes``, else the device's free memory), since the old model stays loaded
    until its requests are answered. Blocking: run it off the event loop. RefusedCheckpoint says why not."""
    try:
        if location.startswith("s3://"):
            path = fetch_checkpoint(location, ObjectStoreAccess.from_settings(storage))
        else:
            path = Path(location).expanduser()
        _check_fit(location, path, served, models)
        with collector_paused():
            model = SourceModel.from_pretrained(path, device=models.device, verify="full",
                                                model_name=checkpoint_folder(location),
                                                permutation_average=models.permutation_average)
    except (CheckpointError, ValueError, OSError) as exc:
        raise RefusedCheckpoint(location, "refused_verification", str(exc)) from exc
    model.model_source_location = location
    return model


def _check_fit(location: str, path: Path, served: Sequence[Path], models: ModelSettings) -> None:
    import torch

    device = models.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    needs = {str(root): checkpoint_memory_bytes(root) for root in served}
    needs[checkpoint_folder(location)] = checkpoint_memory_bytes(path)
    try:
        check_models_fit(needs, device, models.model_memory_bytes)
    except CheckpointError as exc:
        raise RefusedCheckpoint(location, "refused_memory", str(exc)) from exc


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a checkpoint loads beside a serving event loop. Loading a
    tokenizer builds ~150k small tuples (its BPE merges) in Python; the allocations trigger full collections,
    which walk every object of a process holding models and keep the GIL throughout: measured on a busy
    2-core machine, the event loop stalled for 9 s, long enough to miss the consumer's heartbeats and be
    dropped from the group (a rebalance, the very thing a swap must not cause). Off, the longest stall was
    about 2 s (single C calls: JSON parsing, the tokenizer's construction). The collector is on again after,
    and collects what it skipped then."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def warm_up(model: D3, location: str) -> None:
    """One forward pass through the model's own prepare; RefusedCheckpoint when it fails or answers no
    probability (NaN weights load and verify, but cannot answer)."""
    try:
        answers = model.system_one(state="warm-up", questions=WARMUP_QUESTIONS)["answers"]
        answer = answers["warm-up"] if isinstance(answers, Mapping) else None  # system_one's answers: a mapping
    except Exception as exc:  # noqa: BLE001 - whatever the pass raised refuses the checkpoint
        raise RefusedCheckpoint(location, "refused_warmup", f"the warm-up pass failed: {exc}") from exc
    p = answer.get("noul") if isinstance(answer, Mapping) else None
    if not isinstance(answer, Mapping) or "error" in answer or not isinstance(p, float) or not 0.0 <= p <= 1.0:
        raise RefusedCheckpoint(location, "refused_warmup", f"the warm-up pass answered no probability: {answer}")


def load_source_models(models: ModelSettings, storage: StorageSettings,
                       beside: Sequence[Path] = ()) -> list[D3]:
    """At start: the pointer's current checkpoint (the default) and its canary, loaded and verified as a
    swap would load them, each checked to fit beside the checkpoints ``beside`` (the --model and --shadow
    ones) and the ones loaded before it. CheckpointError names what is wrong."""
    assert models.model_source is not None
    pointer = resolve_source(models.model_source, ObjectStoreAccess.from_settings(storage))
    locations = [pointer.current, *([pointer.canary.location] if pointer.canary else [])]
    served: list[Path] = list(beside)
    loaded: list[D3] = []
    try:
        for location in locations:
            model = load_checkpoint(location, models, storage, served)
            served.append(model.root)
            loaded.append(model)
    except RefusedCheckpoint as exc:
        raise CheckpointError(f"model_source {models.model_source}: {exc}") from exc
    return loaded


# ---------------------------------------------------------------------------------------------- rollout


class RolloutHost(Protocol):
    """What a rollout needs of its worker (``service.Service`` is one)."""

    @property
    def pipeline(self) -> RequestPipeline: ...

    @property
    def model_thread(self) -> Executor:
        """The one thread every pass of the device runs on (the warm-up pass takes its turn there)."""
        ...

    def host_model(self, model: D3) -> Hosted:
        """The model's own parts (passes on the shared model thread, answer builder, provenance)."""
        ...

    async def publish_model_provenance(self, hosted: Hosted) -> None: ...

    async def unhost_model(self, hosted: Hosted) -> None:
        """Close a dropped model's passes and forget it."""
        ...


class Rollout:
    """Watches ``model_source`` and swaps the default model without a stop; routes the canary share."""

    def __init__(self, models: ModelSettings, storage: StorageSettings, host: RolloutHost, metrics: Metrics):
        self.models = models  # the source, its poll, the canary; how a checkpoint loads (device, memory)
        self.storage = storage  # how an s3:// source is read
        self.host = host
        self.metrics = metrics
        self.pipeline = host.pipeline
        self.router = host.pipeline.router  # the models served, and the canary it routes (core/routing.py)
        self.source = models.model_source
        self.static_canary = parse_canary(models.canary) if models.canary else None
        if self.static_canary is not None and self.static_canary[0] not in self.router.routes:
            served = ", ".join(repr(name) for name in self.router.routes)
            raise ValueError(f"canary names {self.static_canary[0]!r}, which is not served (this worker serves "
                             f"{served}): give it with --model NAME=PATH")
        # Models given with --model (not loaded from the source) other than the default: never retired.
        self.pinned = {name for name, hosted in self.router.routes.items()
                       if hosted is not self.router.default
                       and not isinstance(hosted.model, SourceModel)}
        self.canary: CanaryRoute | None = None
        self._set_canary(None)
        self.router.route_default = self._route
        self._access = ObjectStoreAccess.from_settings(storage) if self.source else None
        self._client: S3Client | None = None
        self._applied: SourcePointer | None = None
        self._refused: SourcePointer | None = None
        self._problem: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._drains: set[asyncio.Task[None]] = set()
        self._pending: set[str] = set()

    # -------------------------------------------------------------------------------------- routing

    def _route(self, request: Request) -> Hosted:
        canary = self.canary
        return canary.hosted if canary is not None and canary.takes(request) else self.router.default

    def _set_canary(self, pointed: tuple[str, float] | None) -> None:
        """The pointer's canary (name, share), else ``--canary``'s; none when its model is the default."""
        chosen = pointed or self.static_canary
        hosted = self.router.routes.get(chosen[0]) if chosen else None
        self.canary = CanaryRoute(hosted, chosen[1]) if chosen and hosted and hosted is not self.router.default \
            else None

    # ------------------------------------------------------------------------------------- watching

    def start(self) -> None:
        if self.source and self._task is None:
            self._task = asyncio.create_task(self._watch(), name="d3stream-rollout")
            self.metrics.watch(self._task, "the model source watch")  # dead, it would swap nothing ever again

    async def stop(self) -> None:
        tasks = [task for task in (self._task, *self._drains) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _watch(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watch must outlive any one bad poll
                log.exception("model source check failed", source=self.source)
            await asyncio.sleep(self.models.model_source_poll_ms / 1000.0)

    async def check(self) -> None:
        """Read the pointer once; act on it when it changed since the last one applied or refused."""
        try:
            pointer = await asyncio.to_thread(self._read_pointer)
        except CheckpointError as exc:
            self._refuse_pointer(str(exc))
            return
        self._problem = None
        if pointer in (self._applied, self._refused):
            return
        try:
            await self._apply(pointer)
        except RefusedCheckpoint as exc:
            self._refused = pointer
            log.error("model swap refused; the served models keep serving", checkpoint=exc.location,
                      reason=exc.why, outcome=exc.outcome, serving=self.router.default.name)
            self.metrics.count_model_swap(exc.outcome)
            return
        self._applied, self._refused = pointer, None

    def _read_pointer(self) -> SourcePointer:
        assert self.source is not None
        if self.source.startswith("s3://") and self._client is None:
            assert self._access is not None
            self._client = self._access.client()
        return resolve_source(self.source, self._access, client=self._client)

    def _refuse_pointer(self, problem: str) -> None:
        """An unreadable or invalid pointer: logged and counted once per distinct problem, read again next poll."""
        if problem != self._problem:
            self._problem = problem
            log.error("model source pointer unusable; the served models keep serving", source=self.source,
                      reason=problem)
            self.metrics.count_model_swap("refused_pointer")

    # ------------------------------------------------------------------------------------- swapping

    async def _apply(self, pointer: SourcePointer) -> None:
        """Load what the pointer names and is not served, then switch routing in one step."""
        wanted = [pointer.current, *([pointer.canary.location] if pointer.canary else [])]
        loaded: dict[str, Hosted] = {}
        # A retired model the pointer names again is kept while this runs (its drain waits), not reloaded.
        self._pending = {checkpoint_folder(location) for location in wanted}
        try:
            try:
                for location in wanted:
                    name = checkpoint_folder(location)
                    if name not in self.router.hosted and name not in loaded:
                        loaded[name] = await self._load(location)
            except RefusedCheckpoint:  # all or nothing: what did load for this pointer goes again
                for hosted in loaded.values():
                    await self.host.unhost_model(hosted)
                raise
            for hosted in loaded.values():  # its provenance is on the topic before any answer names it
                await self.host.publish_model_provenance(hosted)
            self._switch(pointer, loaded)
        finally:
            self._pending = set()

    async def _load(self, location: str) -> Hosted:
        log.info("loading a checkpoint in the background", checkpoint=location)
        started = time.perf_counter()
        served = [root for root in (getattr(hosted.model, "root", None) for hosted in self.router.hosted.values())
                  if isinstance(root, Path)]
        model = await asyncio.to_thread(load_checkpoint, location, self.models, self.storage, served)
        loaded = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self.host.model_thread, warm_up, model, location)
        log.info("checkpoint verified and warmed up", checkpoint=location, load_s=round(loaded - started, 2),
                 warmup_s=round(time.perf_counter() - loaded, 2))
        return self.host.host_model(model)

    def _switch(self, pointer: SourcePointer, loaded: dict[str, Hosted]) -> None:
        """No await in here: every request admitted after it goes to the new routing, none before."""
        previous, canary_before = self.router.default, self._canary_state()
        current = checkpoint_folder(pointer.current)
        for name in (current, *([checkpoint_folder(pointer.canary.location)] if pointer.canary else [])):
            self.router.add(loaded.get(name) or self.router.hosted[name], default=name == current)
        self._set_canary((checkpoint_folder(pointer.canary.location), pointer.canary.share) if pointer.canary
                         else None)
        keep = {current, *self.pinned, *([self.canary.hosted.name] if self.canary else [])}
        for name in [name for name in self.router.routes if name not in keep]:
            self.router.retire(name)
            task = asyncio.create_task(self._drop_when_drained(name))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
            self.metrics.watch(task, f"dropping the retired model {name}")
        default = self.router.default
        if default is not previous:
            self.metrics.count_model_swap("swapped")
            self.metrics.set_model(default.name, default.provenance_sha256, str(default.model.device))
            log.info("model swapped", previous=previous.name, current=default.name,
                     previous_in_flight=self.pipeline.ledger.routed[previous.name],
                     canary=self.canary.hosted.name if self.canary else None,
                     canary_share=self.canary.share if self.canary else None)
        elif self._canary_state() != canary_before:
            self.metrics.count_model_swap("canary")
            log.info("canary changed", current=default.name, canary=self.canary.hosted.name if self.canary else None,
                     canary_share=self.canary.share if self.canary else None)

    def _canary_state(self) -> tuple[str, float] | None:
        return (self.canary.hosted.name, self.canary.share) if self.canary else None

    async def _drop_when_drained(self, name: str) -> None:
        """Close a retired model once every request routed to it is answered (unless it was named again)."""
        while True:
            if name in self.router.routes:
                return
            hosted = None if name in self._pending else self.router.drop(name)
            if hosted is not None:
                await self.host.unhost_model(hosted)
                hosted = None
                collect_released()  # its weights, if held in cycles the frozen start-up heap hides
                log.info("retired model dropped", model=name)
                return
            await asyncio.sleep(DRAIN_CHECK_S)


def rollout_for(models: ModelSettings, storage: StorageSettings, host: RolloutHost,
                metrics: Metrics) -> Rollout | None:
    """The worker's rollout when it watches a model source or routes a canary share; else None."""
    if not models.model_source and not models.canary:
        return None
    return Rollout(models, storage, host, metrics)


__all__ = ["CanaryRoute", "RefusedCheckpoint", "Rollout", "RolloutHost", "checkpoint_folder", "load_checkpoint",
           "load_source_models", "parse_canary", "rollout_for", "share_point", "warm_up"]
