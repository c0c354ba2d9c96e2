"""The OpenMP housekeeping of runtime/cpu_threads.py, where it can be seen from one process."""

from __future__ import annotations

from d3stream.runtime import cpu_threads


def test_a_worker_whose_model_needs_no_torch_does_not_import_it_to_release_teams(monkeypatch):
    # A model without torch (the null model of the Kafka benchmark, a remote one) made no OpenMP team: releasing
    # one must not cost the second of importing torch at every start.
    monkeypatch.setattr(cpu_threads, "_torch_imported", lambda: False)  # as in a process that never imported it

    def import_torch() -> None:
        raise AssertionError("torch's OpenMP runtime was looked up (importing torch) though no torch op has run")

    monkeypatch.setattr(cpu_threads, "_openmp", import_torch)
    assert cpu_threads.release_idle_teams() is False
