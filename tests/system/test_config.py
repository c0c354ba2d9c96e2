"""``d3stream serve --help`` in a fresh interpreter lists every setting (d3stream.config)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from d3stream.config import (
    Settings,
    env_name,
    flag_name,
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """No D3STREAM_* variable of the machine running the tests leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.startswith("D3STREAM_"):
            monkeypatch.delenv(name)


def test_serve_help_lists_every_setting():
    result = subprocess.run(
        [sys.executable, "-m", "d3stream", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for name in msgspec.structs.fields(Settings):
        assert flag_name(name.name) in result.stdout, name.name
        assert env_name(name.name) in result.stdout, name.name
    assert "--config" in result.stdout
