"""The models a worker serves, each given its own parts (``core.routing.Hosted``) over what they share.

Every model a worker serves, whether given at start (``--model``, the model source's current checkpoint and
canary), loaded later by a swap (``models/rollout.py``) or a shadow checkpoint of its own (``--shadow
NAME=PATH``), gets the same parts here: the token limits, its ``Passes`` on the worker's one model thread (one
device: passes never run side by side), its provenance record (the model's, and how its passes reuse
prefixes, which answers depend on too) and that record's digest, and the answer builder that names it. What
they share is the worker's: the model thread, the metrics, the worker record, the answer topic's fit and the
record writer (JSON, or the registry's format once chosen at start).

Why a module of its own: the parts a model gets must not depend on when it was loaded, so one place makes
them. The hosted models are then owned by the pipeline's router (``core/routing.py``), not kept here.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from d3stream_client.contract import ModelRecord, Worker

from d3stream.core.answers import AnswerBuilder, provenance_digest
from d3stream.core.outgoing import RecordFit, RecordWriter
from d3stream.core.passes import Passes, RowScheduler
from d3stream.core.routing import Hosted
from d3stream.core.seams import DecisionModel
from d3stream.models.shadow import shadow_hosted
from d3stream.ops.metrics import Metrics
from d3stream.runtime.cache import MediaFeatureCache
from d3stream.settings import BatchingSettings, DeliverySettings, LimitSettings, MediaSettings, ModelSettings

__all__ = ["ModelHosting", "served_models"]


def served_models(model: DecisionModel | Sequence[DecisionModel], models: ModelSettings,
                  scheduler: RowScheduler | None) -> list[DecisionModel]:
    """The models a worker serves (the first is the default). A row scheduler of one's own (a deterministic
    replay) serves one fixed model; ValueError names the setting that asks for more."""
    served = list(model) if isinstance(model, Sequence) else [model]
    if not served:
        raise ValueError("a worker needs a model to serve (setting: model)")
    if scheduler is not None and len(served) > 1:
        raise ValueError("a row scheduler of one's own (a deterministic replay) serves one model: give one --model")
    if scheduler is not None and (models.model_source or models.canary):
        raise ValueError("a deterministic replay serves one fixed model: model_source and canary do not apply")
    return served


class ModelHosting:
    """Gives each model a worker serves its own parts, the same whenever it was loaded (see the module)."""

    def __init__(self, limits: LimitSettings, batching: BatchingSettings, delivery: DeliverySettings,
                 media: MediaSettings, *, metrics: Metrics, model_thread: ThreadPoolExecutor, worker: Worker,
                 fit: RecordFit, write: RecordWriter):
        self.limits = limits
        self.batching = batching
        self.delivery = delivery
        self.media = media
        self.metrics = metrics
        self.model_thread = model_thread
        self.worker = worker
        self.fit = fit
        self.write = write

    def host(self, model: DecisionModel, *, scheduler: RowScheduler | None = None,
             replay_id: str | None = None) -> Hosted:
        """A served model's own parts, with the token limits every served model gets: passes on the shared
        model thread, its provenance (answers depend on prefix reuse too) and the answer builder that names it."""
        model.limit_prompt_tokens(self.limits.max_prompt_tokens)
        model.limit_request_tokens(self.limits.max_request_tokens)
        passes = Passes(self.batching, model, self.metrics, scheduler, executor=self.model_thread)
        provenance = {**model.provenance(), **passes.provenance()}
        digest = provenance_digest(provenance)
        answers = AnswerBuilder(
            self.delivery,
            model_record=ModelRecord(name=model.model_name, runtime=str(provenance.get("runtime", "")),
                                     provenance_sha256=digest),
            worker=self.worker, fit=self.fit, metrics=self.metrics, replay_id=replay_id, write=self.write,
        )
        return Hosted(model, passes, answers, provenance, digest)

    def host_served(self, models: Sequence[DecisionModel], settings: ModelSettings, *,
                    scheduler: RowScheduler | None, replay_id: str | None,
                    shadow: DecisionModel | None) -> tuple[list[Hosted], Hosted | None]:
        """Every served model's parts, and the shadow's (live serving only: a replay has none): ``shadow``, a
        checkpoint of its own, hosted here, or the served model the ``shadow`` setting names."""
        hosted = [self.host(each, scheduler=scheduler, replay_id=replay_id) for each in models]
        if replay_id is not None or scheduler is not None:
            return hosted, None
        own = self.host(shadow, replay_id=replay_id) if shadow is not None else None
        return hosted, shadow_hosted(settings, hosted, own)

    def host_loaded(self, model: DecisionModel) -> Hosted:
        """A model loaded while serving (a swap's new checkpoint): the parts every served model gets, and a
        media-feature cache of its own when the worker keeps one (a swap's model is loaded for this worker
        alone, so its cache is set here rather than lent for the run)."""
        if self.media.media_cache_bytes > 0 and hasattr(model, "media_cache"):
            model.media_cache = MediaFeatureCache(self.media.media_cache_bytes,
                                                  on_lookup=self.metrics.count_media_cache)
        return self.host(model)
