"""The garbage collector while a worker serves on the real broker (d3stream/ops/collector.py): tuned while it
serves, handed back when it stops."""

from __future__ import annotations

import gc


def test_a_serving_worker_runs_with_the_tuned_collector_and_hands_it_back(stack, qwen35_model):
    from tests.support.stream_helpers import Q_NOUL, record, run, serve

    before = gc.get_threshold()
    seen: dict[str, object] = {}

    async def look(service, reader, task):
        seen["threshold"], seen["frozen"] = gc.get_threshold(), gc.get_freeze_count()

    request = {"id": "gc-1", "state": "the collector", "questions": {"noul": Q_NOUL}}
    run(serve(stack, stack.settings(gc_young_threshold=12_345), qwen35_model, [record(request)], ["gc-1"],
              during=look))
    assert seen["threshold"] == (12_345, *before[1:])
    assert seen["frozen"] > 10_000  # the model and the libraries are out of the collector's walk
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
