"""The garbage collector while workers serve (collector.py): tuned by the first, restored by the last."""

from __future__ import annotations

import gc

import pytest

from d3stream.ops.collector import tuned_collector
from d3stream.settings import Settings


def test_the_start_up_heap_is_frozen_and_young_collections_spaced_out_until_the_last_worker_stops():
    before = gc.get_threshold()
    first, second = tuned_collector(20_000), tuned_collector(50_000)
    first.__enter__()
    assert gc.get_threshold() == (20_000, *before[1:])
    assert gc.get_freeze_count() > 1000  # at least the interpreter's and the test run's own objects
    second.__enter__()  # a second worker in the same process (replay, tests)
    assert gc.get_threshold()[0] == 50_000
    first.__exit__(None, None, None)  # the first one out leaves the second one's setting alone
    assert gc.get_threshold()[0] == 50_000 and gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_zero_leaves_the_collector_alone_and_a_negative_threshold_names_the_setting():
    before = gc.get_threshold()
    with tuned_collector(0):
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="gc_young_threshold"):
        Settings.from_flat(gc_young_threshold=-1).check()


def test_an_error_inside_still_restores_the_collector():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), tuned_collector(30_000):
        raise RuntimeError("the worker failed")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_retired_models_cycles_frozen_with_the_start_up_heap_are_freed_at_its_drop():
    import weakref

    from d3stream.ops.collector import collect_released

    class Weights:  # a model object that holds itself in a cycle
        def __init__(self):
            self.me = self

    held = Weights()
    gone = weakref.ref(held)
    with tuned_collector(20_000):  # frozen with the start-up heap
        del held
        gc.collect()
        assert gone() is not None  # the collector does not look at frozen objects
        collect_released()
        assert gone() is None
        assert gc.get_freeze_count() > 0  # the rest stays frozen
