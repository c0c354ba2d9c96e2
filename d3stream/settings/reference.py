"""docs/SETTINGS.md, written from the settings' own fields: a table per section, each setting with its flag,
variable, default and help. ``python -m d3stream.settings.reference docs/SETTINGS.md`` writes it; a test
fails while the committed file differs from what this prints, so the page cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from d3stream.settings.catalog import SECTIONS, SETTINGS, Setting
from d3stream.settings.sources import CONFIG_ENV, env_name, flag_name

INTRODUCTION = f"""\
# Settings

<!-- Written by `python -m d3stream.settings.reference docs/SETTINGS.md` from d3stream/settings/sections.py:
     edit the fields' help there, not this page. -->

`d3stream serve` (and `d3stream replay`) take every setting as a flag, a `D3STREAM_*` environment variable
or a key of a TOML file (`--config FILE` or `{CONFIG_ENV}`, keys at top level or under `[d3stream]`);
flag beats environment beats file beats default. Lists are comma-separated in flags and the environment (a
list's flag may also be repeated). `produce`, `consume` and `compare` take the connection settings the same
way ([secured Kafka clusters](CONNECTING.md#secured-kafka-clusters)); `evaluate` takes the connection's, the
evaluation's and the few others it reads.
`d3stream serve --help` prints the same, by section.

The sections are how the code reads the settings (`settings.delivery.answer_topic`); a file, a flag or a
variable names a setting alone (`answer_topic`), whatever its section. Passwords are secrets: they never
print, in logs, errors or `--help`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(setting: Setting) -> str:
    default = "unset" if setting.default is None else f"`{setting.default!r}`"
    return (f"| `{setting.name}` | `{flag_name(setting.name)}` | `{env_name(setting.name)}` | {default} | "
            f"{_cell(setting.help)} |")


def settings_reference() -> str:
    """The whole page."""
    parts = [INTRODUCTION]
    for section, struct in SECTIONS.items():
        parts.append(f"\n## {section}\n\n{(struct.__doc__ or '').strip()}\n")
        parts.append("| setting (TOML key) | flag | environment | default | meaning |")
        parts.append("|---|---|---|---|---|")
        parts.extend(_row(setting) for setting in SETTINGS.values() if setting.section == section)
    return "\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    text = settings_reference()
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
