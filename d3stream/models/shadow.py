"""Which model is a worker's shadow (``--shadow``): a checkpoint of its own (``NAME=PATH``) or one of the
served models (``NAME``). The shadow's answers themselves are built by the core (``core/shadow.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from d3stream.core.routing import Hosted
from d3stream.models.checkpoints import MODEL_NAME, CheckpointError, parse_model_spec
from d3stream.settings import ModelSettings


@dataclass(frozen=True)
class ShadowSpec:
    """A ``--shadow`` value: the name its answers carry and where its checkpoint is (None: a served model)."""

    name: str
    location: str | None


def parse_shadow(text: str) -> ShadowSpec:
    """``NAME=PATH`` (a checkpoint directory or s3:// prefix) or ``NAME`` (a served model)."""
    spec = parse_model_spec(text)
    if spec.name is not None:
        return ShadowSpec(spec.name, spec.location)
    if MODEL_NAME.fullmatch(spec.location):
        return ShadowSpec(spec.location, None)
    raise CheckpointError(f"--shadow {text!r}: give NAME=PATH for a checkpoint of its own, or the NAME of a "
                          "served model (setting: shadow)")


def shadow_hosted(models: ModelSettings, served: Sequence[Hosted], own: Hosted | None) -> Hosted | None:
    """The served model that is the shadow: ``own`` (a shadow checkpoint of its own,
    hosted by the caller), or the served model ``shadow`` names; None without a shadow. ValueError names the
    setting when ``shadow`` names neither."""
    if own is not None:
        if any(each.name == own.name for each in served):
            raise ValueError(f"--shadow {models.shadow!r}: a served model has the name {own.name!r}; give the "
                             "shadow another NAME, or --shadow NAME alone to shadow with the served model")
        return own
    if not models.shadow:
        return None
    spec = parse_shadow(models.shadow)
    if spec.location is not None:
        raise ValueError(f"--shadow {models.shadow!r}: its checkpoint was not loaded (d3stream serve loads it)")
    for each in served:
        if each.name == spec.name:
            return each
    names = ", ".join(repr(each.name) for each in served)
    raise ValueError(f"--shadow {spec.name!r}: not a served model (this worker serves {names}); give NAME=PATH "
                     "for a checkpoint of its own (setting: shadow)")
