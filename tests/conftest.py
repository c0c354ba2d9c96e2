"""Shared fixtures: real servers (tests/support/infra_fixtures.py), tiny checkpoints built on demand
(tests/support/model_fixtures.py), the stream helpers' ``stack`` and the fault proxy's ``proxy``.

Markers (registered in pyproject.toml; ``make test-fast`` runs ``-m "not infra and not subprocess and not
slow"``, ``make test`` runs everything):

``infra``       the test needs the JVM: it asks, directly or through another fixture, for the session's Kafka
                broker or S3 store (``INFRA_FIXTURES``). Applied here, from the fixtures, never by hand.
``subprocess``  the test starts another Python process (``d3stream serve``, ``replay``, ``python -c``).
                Applied by hand where the test does not already need the servers.
``slow``        the test trains a model, loads models beyond the session's four tiny ones (the reference
                runtime's, the demo's, variants of its own), runs a benchmark or feeds thousands of fuzzed or
                megabytes of input through a model: seconds to minutes each on two cores. Applied here from
                the fixtures that do (``SLOW_FIXTURES``), by hand where the test does it itself. The tests on
                the session's tiny models (the pipeline, the runtime, prefix reuse) stay in the quick loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# No torch behind this import: OMP_NUM_THREADS below is still set before torch loads.
from d3stream.dev.infra import JVM_OPTIONS_ENV

# The suite keeps two cores busy with its pytest workers, the worker processes they start and the JVMs, so a
# second OpenMP thread per process only spins and waits: one thread each made the model-heavy modules 15 %
# faster (measured side by side). Set before torch is imported; the worker processes inherit it. A test that
# is about thread counts sets its own (tests/test_pipeline.py). The servers' JVMs compile with C1 only
# (d3stream/dev/infra.py says what that saves). A value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(JVM_OPTIONS_ENV, "-XX:TieredStopAtLevel=1")

pytest_plugins = [
    "tests.support.infra_fixtures", "tests.support.model_fixtures", "tests.support.stream_helpers",
    "tests.support.fault_proxy",
]

# The fixtures that start a JVM server (tests/support/infra_fixtures.py); every fixture built on them (``stack``,
# ``s3_bucket``, the extra brokers of test_security and test_hostile) asks for one of these.
INFRA_FIXTURES = frozenset({"kafka_broker", "object_store"})
# The fixtures that train a model or load models beyond the session's tiny ones: the demo's trained and random
# models, and the modules' own (test_runtime's reference and variant models, test_checkpoint's backbones).
SLOW_FIXTURES = frozenset({
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


# Modules of long scenarios (worker processes killed and restarted, scale-out groups, training), longest first.
# `make test` runs the suite on three workers (pytest-xdist), which take tests in collection order: when these
# start first, the short tests fill the gaps and the workers end together, instead of one finishing a
# 70-second scenario alone at the end.
LONG_MODULES = (
    "test_scaleout", "test_delivery", "test_runtime", "test_hostile", "test_service", "test_ordering", "test_client",
    "test_bench",
    "test_unwritable", "test_demo", "test_evaluate", "test_media_memory", "test_replay", "test_shadow", "test_limits", "test_security", "test_training",
    "test_rollout", "test_media_limits", "test_checkpoint",
)


def _module_rank(item: pytest.Item) -> int:
    name = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_module_rank)  # stable: a module's tests keep their order
    for item in items:
        # fixturenames is the closure: the fixtures a test asks for and every fixture they ask for.
        names = frozenset(getattr(item, "fixturenames", ()))
        if names & INFRA_FIXTURES:
            item.add_marker(pytest.mark.infra)
        if names & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)


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
