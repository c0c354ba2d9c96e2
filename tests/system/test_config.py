"""``d3stream serve --help`` in a fresh interpreter lists every setting (d3stream.settings)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from d3stream.settings import SETTINGS, env_name, flag_name


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
    for name in SETTINGS:
        assert flag_name(name) in result.stdout, name
        assert env_name(name) in result.stdout, name
    assert "--config" in result.stdout
