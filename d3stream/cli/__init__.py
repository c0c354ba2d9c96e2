"""The ``d3stream`` command line: one module per command, each a ``shape.Command`` (its name, help, arguments
and what it runs), listed below in the order ``--help`` shows them.

argparse, kept rather than a CLI library: every setting already becomes a flag from its typed field
(``config.add_arguments``, with its ``D3STREAM_*`` variable and TOML key), which click or typer would have to
be taught again, and the standard library costs no dependency on the light path (``d3stream --help`` imports
no torch: a command imports what it needs inside ``run``).
"""

from __future__ import annotations

import argparse

from d3stream.cli import (
    bench,
    chaos,
    compare,
    consume,
    decide,
    demo,
    demo_task,
    evaluate,
    make_checkpoint,
    produce,
    replay,
    schemas,
    serve,
    stack,
)
from d3stream.cli.common import run_command
from d3stream.cli.shape import Command, HelpFormatter, register

COMMANDS: tuple[Command, ...] = (
    serve.COMMAND, produce.COMMAND, consume.COMMAND, decide.COMMAND, demo.COMMAND, stack.COMMAND,
    demo_task.COMMAND, make_checkpoint.COMMAND, replay.COMMAND, compare.COMMAND, evaluate.COMMAND,
    schemas.COMMAND, chaos.COMMAND, bench.COMMAND,
)


def build_parser() -> argparse.ArgumentParser:
    from d3stream import __version__

    parser = argparse.ArgumentParser(
        prog="d3stream",
        description="Typed D3 decisions at streaming scale: Kafka requests in, answers with provenance out.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; an expected failure ends it with one line and exit status 2 (``common.run_command``)."""
    return run_command(build_parser().parse_args(argv))
