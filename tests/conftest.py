"""Shared fixtures: real servers (tests/infra_fixtures.py) and tiny checkpoints built on demand.

Markers (registered in pyproject.toml; ``make test-fast`` runs ``-m "not infra and not subprocess"``):

``infra``       the test needs the JVM: it asks, directly or through another fixture, for the session's Kafka
                broker or S3 store (``INFRA_FIXTURES``). Applied here, from the fixtures, never by hand.
``subprocess``  the test starts another Python process (``d3stream serve``, ``replay``, ``python -c``).
                Applied by hand where the test does not already need the servers.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.infra_fixtures", "tests.model_fixtures", "tests.stream_helpers"]

# The fixtures that start a JVM server (tests/infra_fixtures.py); every fixture built on them (``stack``,
# ``s3_bucket``, the extra brokers of test_security and test_hostile) asks for one of these.
INFRA_FIXTURES = frozenset({"kafka_broker", "object_store"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: the fixtures a test asks for and every fixture they ask for.
        if INFRA_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.infra)
