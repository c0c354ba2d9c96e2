"""tests/system: tests that start other Python processes: ``d3stream serve`` and ``evaluate`` workers killed,
restarted and rebalanced, scale-out groups, a killed ``replay``, fresh interpreters that check what an import
loads. Every test here is marked ``subprocess``; those on the session's broker or store are also ``infra``
(tests/conftest.py, from their fixtures)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.subprocess)
