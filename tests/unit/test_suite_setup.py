"""The suite's own machinery: what ``make test`` relies on to share slow set-ups still does what it says.

Modules whose module-scoped servers or models take a minute to start carry an ``xdist_group`` so that
``--dist loadgroup`` runs them on one pytest worker (tests/conftest.py). When that stops working nothing
fails: each worker starts its own copy and the suite only gets slower (pytest 9.2 with pytest-xdist 3.8 did
exactly that, pytest-dev/pytest-xdist#1386). This runs a small suite the way ``make test`` runs the real one
and checks that a group stays on one worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = '''
import os

import pytest

pytestmark = pytest.mark.xdist_group("one-worker")


@pytest.mark.parametrize("case", range(8))
def test_grouped(case):
    print("worker", os.environ["PYTEST_XDIST_WORKER"])
'''


def test_an_xdist_group_runs_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's options and plugins
    # Two workers are enough to split an ungrouped group; xdist alone of the installed plugins is loaded (the
    # others only cost each process's start).
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert finished.returncode == 0, finished.stdout + finished.stderr
    workers = {line.split("]")[0].lstrip("[") for line in finished.stdout.splitlines()
               if line.startswith("[gw") and "PASSED" in line}
    assert len(workers) == 1, f"the group ran on {sorted(workers)}:\n{finished.stdout}"
