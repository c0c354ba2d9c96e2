"""tests/deploy: the deployment files (deploy/: Kubernetes manifests and their components, the compose file,
the images). Every test here is marked ``deploy``."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.deploy)
