"""Service-side commands (serve, produce, consume, demo); registered by the CLI."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    """Add the service commands to the CLI's sub-command table."""
