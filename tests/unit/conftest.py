"""tests/unit/<layer>: no JVM (no Kafka broker, no S3 store) and no other Python process, one folder per layer
of the package. ``make test-fast`` runs this folder.

A test here that asks, even through another fixture, for the broker or the store (marked ``infra`` by
tests/conftest.py), or that is marked ``subprocess``, stops the collection: it belongs in tests/integration or
tests/system."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misplaced = [
        item.nodeid for item in items
        if HERE in Path(item.path).resolve().parents
        and (item.get_closest_marker("infra") or item.get_closest_marker("subprocess"))
    ]
    if misplaced:
        raise pytest.UsageError("tests/unit needs no JVM and starts no process; move these to tests/integration "
                                "or tests/system:\n  " + "\n  ".join(misplaced))
