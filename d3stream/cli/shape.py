"""The shape every command has: a name, a one-line help, its arguments and what it runs.

A command module holds one ``Command``; ``cli/__init__.py`` lists them and ``register`` adds each to the
parser with the shared ``HelpFormatter``. Heavy imports (torch, transformers, aiokafka) happen inside ``run``,
so ``d3stream --help`` is instant and a command only pays for what it uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One sub-command of ``d3stream``."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None  # its --help's text (default: the one-line help)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every command: each option's default after its help, where it has one.

    argparse's ArgumentDefaultsHelpFormatter appends "(default: None)" to options whose default is "not
    given" (the settings, whose unset flags fall back to the environment, the file, then the setting's own
    default, which their help states) and repeats defaults the help already names. This one shows a
    default only when there is one to show and the help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _has_default(action) or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _has_default(action: argparse.Action) -> bool:
    """An option with a default worth showing: not "not given" (None), an off switch or a suppressed one."""
    unshown = action.default is None or action.default is False or action.default == argparse.SUPPRESS
    return bool(action.option_strings) and not unshown


def register(subparsers: argparse._SubParsersAction, commands: Sequence[Command]) -> None:
    """Add each command as a sub-command: its parser (the shared formatter, its help as description), its
    arguments, and ``run`` as what ``main`` calls."""
    for command in commands:
        parser = subparsers.add_parser(command.name, help=command.help, formatter_class=HelpFormatter,
                                       description=command.description or command.help)
        command.add_arguments(parser)
        parser.set_defaults(run=command.run)
        show_defaults(parser)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """An option without help but with a default still says its default (argparse prints no line for None)."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps a parser's actions nowhere public
        if action.help is None and _has_default(action):
            action.help = "default: %(default)s"
