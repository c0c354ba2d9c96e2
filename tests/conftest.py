"""Shared fixtures and the suite's markers and order.

The folders are the layers of testing; each folder's ``conftest.py`` marks its tests:

``tests/unit/<layer>/``  no JVM and no other Python process; one folder per layer of the package
                         (``runtime``, ``core``, ``kafka``, ``models``, ``ops``, ``service``, ``jobs``, ``dev``,
                         ``benchmarks``), ``config`` for d3stream/config.py and ``client`` for the light client.
                         ``make test-fast`` runs this folder.
``tests/integration/``   the real broker and/or S3 store, in this process (marked ``infra``).
``tests/system/``        other Python processes: ``d3stream serve`` workers killed and restarted, scale-out
                         groups, fresh interpreters (marked ``subprocess``).
``tests/deploy/``        the Kubernetes manifests, the compose file and the images (marked ``deploy``).
``tests/support/``       helpers, no tests: real servers (infra_fixtures), tiny checkpoints built on demand
                         (model_fixtures), the stream helpers' ``stack``, the fault proxy's ``proxy``, media makers.

Markers (registered in pyproject.toml):

``infra``       the test needs the JVM: it asks, directly or through another fixture, for the session's Kafka
                broker or S3 store (``INFRA_FIXTURES``). Applied here, from the fixtures, wherever the test is.
``subprocess``  the test starts another Python process (``d3stream serve``, ``replay``, ``python -c``):
                every test of tests/system.
``deploy``      a check of the deployment files: every test of tests/deploy.
``slow``        the test trains a model, loads models beyond the session's four tiny ones (the reference
                runtime's, the demo's, variants of its own), runs a benchmark or feeds thousands of fuzzed or
                megabytes of input through a model: seconds to minutes each on two cores. Applied here from
                the fixtures that do (``SLOW_FIXTURES``), by hand where the test does it itself. The tests on
                the session's tiny models (the pipeline, the runtime, prefix reuse) stay in the quick loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# No torch behind these imports: OMP_NUM_THREADS below is still set before torch loads.
from d3stream.dev.infra import JVM_OPTIONS_ENV
from d3stream.dev.infra.class_data import ARCHIVES_ENV

# The suite keeps two cores busy with its pytest workers, the worker processes they start and the JVMs, so a
# second OpenMP thread per process only spins and waits: one thread each made the model-heavy modules 15 %
# faster (measured side by side). Set before torch is imported; the worker processes inherit it. A test that
# is about thread counts sets its own (tests/unit/core/test_pipeline.py). The servers' JVMs compile with C1 only
# (d3stream/dev/infra/jars.py says what that saves). A value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(JVM_OPTIONS_ENV, "-XX:TieredStopAtLevel=1")
# And they load their classes from a class-data archive each, made by the first of them to exit cleanly and kept
# in the cache (d3stream/dev/infra/class_data.py): about a third less CPU per start, for some sixty starts.
os.environ.setdefault(ARCHIVES_ENV, "1")

pytest_plugins = [
    "tests.support.infra_fixtures", "tests.support.model_fixtures", "tests.support.stream_helpers",
    "tests.support.fault_proxy", "tests.support.compare_answers",
    "tests.support.kafka_pki",
]

# The fixtures that start a JVM server (tests/support/infra_fixtures.py); every fixture built on them (``stack``,
# ``s3_bucket``, the extra brokers of integration/test_security and test_hostile) asks for one of these.
INFRA_FIXTURES = frozenset({"kafka_broker", "object_store", "schema_registry"})
# The fixtures that train a model or load models beyond the session's tiny ones: the demo's trained and random
# models, and the modules' own (unit/runtime/test_model's reference and variant models,
# unit/dev/test_build_checkpoint's backbones).
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


# The order the tests start in. `make test` runs the suite on three pytest-xdist workers, which take tests in
# collection order: the long scenarios (worker processes, scale-out groups, the broker and store) start first and
# the many short unit tests fill the gaps at the end, so the workers end together instead of one finishing a
# 70-second scenario alone. Modules with a slow test (training, reference models, fuzzing: a minute of set-up
# each) start right after them, whatever their folder. No list to keep: a new module takes its place from its folder
# and its markers.
FOLDER_ORDER = ("system", "integration", "deploy", "unit")
TESTS = Path(__file__).resolve().parent


def _folder_rank(item: pytest.Item) -> int:
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    return FOLDER_ORDER.index(parts[0]) if parts[0] in FOLDER_ORDER else len(FOLDER_ORDER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # fixturenames is the closure: the fixtures a test asks for and every fixture they ask for.
        names = frozenset(getattr(item, "fixturenames", ()))
        if names & INFRA_FIXTURES:
            item.add_marker(pytest.mark.infra)
        if names & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    # stable: a module's tests keep their order and stay together
    # system first, then the slow modules of the other folders, then integration, deploy and unit
    items.sort(key=lambda item: (0 if item.path in slow_modules else _folder_rank(item), _folder_rank(item) != 0))


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
