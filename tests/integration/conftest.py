"""tests/integration: the real Kafka broker and/or S3 store (the session's JVM servers, tests/support/infra_fixtures.py),
with the service, the commands and the client in this process. Every test here is marked ``infra``."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.infra)
