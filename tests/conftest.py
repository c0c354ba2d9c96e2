"""Shared fixtures: real servers (tests/infra_fixtures.py), tiny checkpoints built on demand
(tests/model_fixtures.py), the stream helpers' ``stack`` and the fault proxy's ``proxy``.

Markers (registered in pyproject.toml; ``make test-fast`` runs ``-m "not infra and not subprocess and not
model"``, ``make test`` runs everything):

``infra``       the test needs the JVM: it asks, directly or through another fixture, for the session's Kafka
                broker or S3 store (``INFRA_FIXTURES``). Applied here, from the fixtures, never by hand.
``subprocess``  the test starts another Python process (``d3stream serve``, ``replay``, ``python -c``).
                Applied by hand where the test does not already need the servers.
``model``       the test loads a tiny model's weights, or trains one: applied here from the fixtures that do
                (``MODEL_FIXTURES``), by hand where the test does it itself (``load_model``, a command run in
                process, ``request.getfixturevalue``). On two CPU cores these tests are most of the time of
                the suite without the servers (a load parses the Qwen tokenizer too: seconds each). Building a
                checkpoint (seconds, once a session) or loading only its tokenizer does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest_plugins = ["tests.infra_fixtures", "tests.model_fixtures", "tests.stream_helpers", "tests.fault_proxy"]

# The fixtures that start a JVM server (tests/infra_fixtures.py); every fixture built on them (``stack``,
# ``s3_bucket``, the extra brokers of test_security and test_hostile) asks for one of these.
INFRA_FIXTURES = frozenset({"kafka_broker", "object_store"})
# The fixtures that load a tiny model's weights, or train one: tests/model_fixtures.py's loaded models and trained
# checkpoint, and the modules' own (test_runtime's reference and variant models, test_checkpoint's backbones).
MODEL_FIXTURES = frozenset({
    "qwen35_model",
    "qwen35_text_model",
    "qwen35_noncausal_model",
    "qwen3vl_model",
    "demo_trained_model",
    "demo_random_model",
    "demo_trained_checkpoint",
    "averaging_model",
    "short_model",
    "reference_qwen35",
    "reference_noncausal",
    "reference_qwen3vl",
    "reference_demo",
    "backbones",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: the fixtures a test asks for and every fixture they ask for.
        names = frozenset(getattr(item, "fixturenames", ()))
        if names & INFRA_FIXTURES:
            item.add_marker(pytest.mark.infra)
        if names & MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)


@pytest.fixture
def logging_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that run a command (``serve``, ``replay``, ...) in process: the command sets up logging on the
    stderr of the moment -- this test's captured one, closed afterwards -- so every set-up it makes is undone
    after the test, or later log calls of the session would write to a closed stream."""
    import d3stream.ops.logs

    restores: list[Callable[[], None]] = []
    real = d3stream.ops.logs.configure_logging

    def configure(*args: Any, **kwargs: Any) -> Callable[[], None]:
        restores.append(real(*args, **kwargs))
        return restores[-1]

    monkeypatch.setattr(d3stream.ops.logs, "configure_logging", configure)
    yield
    for restore in reversed(restores):
        restore()
