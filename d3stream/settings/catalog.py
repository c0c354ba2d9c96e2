"""``Settings``: the eleven sections together, and the catalogue of every setting by the name an operator writes.

An operator writes settings flat (``--answer-topic``, ``D3STREAM_ANSWER_TOPIC``, ``answer_topic = ...``); the
code reads them by section (``settings.delivery.answer_topic``). ``SETTINGS`` maps each written name to its
section, attribute, type, default and help, in the order the sections list them, and is what the flags,
the environment, the TOML file and docs/SETTINGS.md are made from.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args, get_origin

import msgspec

from d3stream.settings.secret import decode_secret
from d3stream.settings.sections import (
    REBALANCE_MARGIN_S,
    BatchingSettings,
    ConnectionSettings,
    DeliverySettings,
    EvaluationSettings,
    LifecycleSettings,
    LimitSettings,
    MediaSettings,
    ModelSettings,
    ObservabilitySettings,
    RegistrySettings,
    StorageSettings,
)


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of a worker, by section. ``Settings.from_flat(answer_topic=...)`` builds one from written
    names; ``settings.replaced(answer_topic=...)`` changes some."""

    connection: ConnectionSettings = msgspec.field(default_factory=ConnectionSettings)
    registry: RegistrySettings = msgspec.field(default_factory=RegistrySettings)
    delivery: DeliverySettings = msgspec.field(default_factory=DeliverySettings)
    models: ModelSettings = msgspec.field(default_factory=ModelSettings)
    limits: LimitSettings = msgspec.field(default_factory=LimitSettings)
    batching: BatchingSettings = msgspec.field(default_factory=BatchingSettings)
    media: MediaSettings = msgspec.field(default_factory=MediaSettings)
    storage: StorageSettings = msgspec.field(default_factory=StorageSettings)
    observability: ObservabilitySettings = msgspec.field(default_factory=ObservabilitySettings)
    evaluation: EvaluationSettings = msgspec.field(default_factory=EvaluationSettings)
    lifecycle: LifecycleSettings = msgspec.field(default_factory=LifecycleSettings)

    @classmethod
    def from_flat(cls, values: Mapping[str, object] | None = None, /, **named: object) -> Settings:
        """Settings from written names (``answer_topic="a"``); the rest at their defaults. Unchecked, as a
        struct built by hand is: ``check`` (or ``load_settings``) refuses values that cannot work."""
        return _convert({**(values or {}), **named}, strict=True)

    def replaced(self, **named: object) -> Settings:
        """A copy with some settings changed, by written name."""
        return _convert({**self.flat(), **named}, strict=True)

    def flat(self) -> dict[str, object]:
        """Every setting by written name."""
        return {name: getattr(getattr(self, setting.section), setting.attribute) for name, setting in SETTINGS.items()}

    def check(self) -> Settings:
        """Refuse settings that cannot work alone or together, naming them (ValueError)."""
        for section in SECTIONS:
            getattr(self, section).check()
        _check_rebalance_fits(self.lifecycle.rebalance_drain_s, self.delivery.rebalance_timeout_ms)
        if self.models.shadow_topic is not None and self.models.shadow_topic == self.delivery.answer_topic:
            raise ValueError("shadow_topic must not be the answer topic: a shadow's answers never go to the live topic")
        return self


def _check_rebalance_fits(drain_s: float, rebalance_timeout_ms: int) -> None:
    """A rebalance waits ``rebalance_timeout_ms`` for every member to rejoin, and a member rejoins only after
    its revocation callback (drain, final commit) returned. A member slower than that is dropped from the
    group, rejoins as a new member and starts the next rebalance: with drains longer than the timeout the
    group never settles (a rebalance storm). aiokafka would take the timeout from ``session_timeout_ms``."""
    needed_ms = drain_s * 1000 + REBALANCE_MARGIN_S * 1000
    if needed_ms > rebalance_timeout_ms:
        raise ValueError(
            f"rebalance_drain_s ({drain_s:g} s) plus a {REBALANCE_MARGIN_S:g} s margin for the final commit must fit "
            f"in rebalance_timeout_ms ({rebalance_timeout_ms} ms): a worker still draining when the rebalance times "
            f"out is dropped from the group and starts the next rebalance. Lower rebalance_drain_s or raise "
            f"rebalance_timeout_ms to at least {int(needed_ms)}"
        )


@dataclass(frozen=True)
class Setting:
    """One setting as an operator writes it: ``name`` is the flag, variable and TOML key's stem."""

    name: str
    section: str
    attribute: str
    type: object  # the field's type (a type form such as ``int | None``), without its help annotation
    default: object  # None: unset
    help: str

    @property
    def is_list(self) -> bool:
        return get_origin(self.type) is list

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    @property
    def optional(self) -> bool:
        return type(None) in get_args(self.type)

    @property
    def choices(self) -> list[str] | None:
        literal = next((a for a in (self.type, *get_args(self.type)) if get_origin(a) is typing.Literal), None)
        return list(get_args(literal)) if literal is not None else None


SECTIONS: dict[str, type[msgspec.Struct]] = {
    field.name: field.type for field in msgspec.structs.fields(Settings)
}


def _catalogue() -> dict[str, Setting]:
    settings = {}
    for section, struct in SECTIONS.items():
        hints = typing.get_type_hints(struct, include_extras=True)
        for field in msgspec.structs.fields(struct):
            annotated = hints[field.name]
            metas = [m for m in getattr(annotated, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
            if not metas or not metas[0].description:
                raise TypeError(f"{struct.__name__}.{field.name} needs its help: Annotated[..., doc('...')]")
            default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
            settings[field.encode_name] = Setting(
                name=field.encode_name, section=section, attribute=field.name, type=get_args(annotated)[0],
                default=default, help=metas[0].description,
            )
    return settings


SETTINGS: dict[str, Setting] = _catalogue()


def _convert(flat: Mapping[str, object], *, strict: bool) -> Settings:
    """Written names into sections; msgspec checks each value against its field's type."""
    unknown = sorted(set(flat) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown settings {', '.join(unknown)}; see `d3stream serve --help`")
    nested: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    for name, value in flat.items():
        nested[SETTINGS[name].section][name] = value
    return msgspec.convert(nested, Settings, strict=strict, dec_hook=decode_secret)


def settings_from_text(flat: Mapping[str, object]) -> Settings:
    """Settings from the loose values of flags, variables and files (numbers as text, for instance);
    ValueError names the setting that does not fit."""
    try:
        return _convert(flat, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid setting: {_written_path(str(exc))} (flag, D3STREAM_* variable or settings file)") from exc


def _written_path(message: str) -> str:
    """msgspec says ``$.delivery.answer_topic``; an operator wrote ``answer_topic``."""
    for section in SECTIONS:
        message = message.replace(f"$.{section}.", "")
    return message
