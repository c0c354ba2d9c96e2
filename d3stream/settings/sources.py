"""Settings from flags, ``D3STREAM_*`` environment variables and a TOML file; precedence flag > environment >
file > default.

    d3stream serve --model ckpt --bootstrap-servers kafka:9092      # flag
    D3STREAM_BOOTSTRAP_SERVERS=kafka:9092 d3stream serve ...         # environment
    d3stream serve --config d3stream.toml                            # file: bootstrap_servers = "..."

The three are made from one catalogue (catalog.SETTINGS), so they cannot disagree: a setting's flag is its
name with dashes, its variable the name upper-cased after ``D3STREAM_``, its TOML key the name, at top level
or under ``[d3stream]``. These names are a deployment's interface and do not follow the code's sections.
List values take a comma-separated string in flags and the environment, a TOML array in the file.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from d3stream.settings.catalog import SECTIONS, SETTINGS, Setting, Settings, settings_from_text

ENV_PREFIX = "D3STREAM_"
CONFIG_ENV = "D3STREAM_CONFIG"

# The settings of a connection to Kafka: every command that talks to Kafka takes these (and only serve and
# replay take the rest). d3stream/kafka/connection.py turns them into aiokafka keyword arguments.
CONNECTION_FIELDS = tuple(name for name, setting in SETTINGS.items() if setting.section == "connection")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_text(default: object) -> str:
    """A setting's default as it is written in a flag or the environment (nothing when it has none: unset)."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return "; default: " + ("true" if default else "false")
    if isinstance(default, list):
        return "; default: " + (",".join(default) if default else "empty")
    return f"; default: {default}"


def help_text(setting: Setting, description: str | None = None, default: object = ...) -> str:
    """The help a flag shows: the field's description (or a command's own), its variable and its default (the
    setting's, or ``default``: a command's own)."""
    shown = setting.default if default is ... else default
    return f"{description or setting.help} (env {env_name(setting.name)}{default_text(shown)})"


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                  described: Mapping[str, str] | None = None, defaults: Mapping[str, object] | None = None) -> None:
    """One flag per setting (or per setting in ``only``), grouped by section; unset flags stay None so the
    environment and file can fill them. A list setting's flag may be repeated, each value comma-separated
    or not. ``described`` gives a command's own description of a setting where the worker's would mislead
    (a client's ``schema_auto_register`` registers the request schema, not the answers'); ``defaults`` the
    command's own defaults (shown in the help; ``load_settings`` takes the same mapping)."""
    parser.add_argument("--config", default=None, help=f"TOML settings file (or ${CONFIG_ENV})")
    for section, struct in SECTIONS.items():
        names = [name for name, s in SETTINGS.items() if s.section == section and (only is None or name in only)]
        if not names:
            continue
        title = f"{section} settings (flag > environment > TOML file > default)"
        group = parser.add_argument_group(title, (struct.__doc__ or "").strip())
        for name in names:
            _add_flag(group, SETTINGS[name], (described or {}).get(name), (defaults or {}).get(name, ...))


def _add_flag(group: argparse._ArgumentGroup, setting: Setting, description: str | None = None,
              default: object = ...) -> None:
    text = help_text(setting, description, default).replace("%", "%%")
    if setting.is_bool:
        group.add_argument(flag_name(setting.name), dest=setting.name, default=None,
                           action=argparse.BooleanOptionalAction, help=text)
        return
    action = "append" if setting.is_list else "store"
    # -X key=value, as kcat spells its client options
    names = (flag_name(setting.name), "-X") if setting.name == "kafka_options" else (flag_name(setting.name),)
    group.add_argument(*names, dest=setting.name, default=None, choices=setting.choices, action=action, help=text)


def _coerce_text(setting: Setting, text: str) -> object:
    """Environment and flag strings into the shape msgspec converts: lists split on commas, an empty
    string for an optional setting means unset."""
    if setting.optional and text.strip().lower() in ("", "none"):
        return None
    if setting.is_list:
        return [part.strip() for part in text.split(",") if part.strip()]
    if setting.is_bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{env_name(setting.name)} must be true or false, got {text!r}")
    return text


def _from_file(path: str | os.PathLike[str]) -> dict[str, object]:
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the settings file {path}: {exc}") from exc
    table = document.get("d3stream", document)
    unknown = sorted(set(table) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{path}: unknown settings {', '.join(unknown)}; see `d3stream serve --help`")
    if isinstance(table.get("model"), str):  # model = "ckpt", as written before a worker served several
        table["model"] = [table["model"]]
    return dict(table)


def _split(value: object) -> list[object]:
    """A list setting's text coerced: its items."""
    return list(value) if isinstance(value, list) else [value]


def load_settings(
    flags: argparse.Namespace | dict[str, object] | None = None,
    *,
    environ: dict[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> Settings:
    """Settings from the three sources, checked; ValueError names the offending setting and source.
    ``defaults``: a command's own defaults, in place of the settings' where no source gives a value
    (``d3stream evaluate`` listens for metrics on a port of its own, beside a worker's)."""
    environ = dict(os.environ if environ is None else environ)
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    merged: dict[str, object] = dict(defaults or {})
    named = given.get("config")
    path = config_file or (named if isinstance(named, str) else None) or environ.get(CONFIG_ENV)
    if path:
        merged.update(_from_file(path))
    for name, setting in SETTINGS.items():
        if env_name(name) in environ:
            merged[name] = _coerce_text(setting, environ[env_name(name)])
    for name, setting in SETTINGS.items():
        value = given.get(name)
        if isinstance(value, list) and setting.is_list:  # a repeated flag: each may hold a, b
            value = [part for item in value
                     for part in (_split(_coerce_text(setting, item)) if isinstance(item, str) else [item])]
        if value is not None:
            merged[name] = _coerce_text(setting, value) if isinstance(value, str) else value
    return settings_from_text(merged).check()
