"""The garbage collector while a worker serves: the start-up heap frozen, young collections spaced out.

A worker imports torch and transformers and loads its checkpoints before it reads a request: a quarter of a
million objects that live as long as the process. CPython's cyclic collector would walk them all at every
full collection, and its default young threshold (700 allocations) is passed every few dozen requests,
each a few dozen short-lived objects. Measured on the null-model Kafka path (``d3stream bench kafka``),
collections took about a third of the event loop's time.

So while a ``Service`` runs, the objects alive at its start are moved out of the collector's reach
(``gc.freeze``) and the young threshold is raised to ``gc_young_threshold`` (default 1,000,000). The threshold
counts allocations less deallocations, and nearly every per-request object is freed by reference counting
the moment its answer is delivered: no request may leave a reference cycle, or what it holds waits for the
next collection, perhaps a million allocations away (issue 36: 600 MB of an image request's media per
request; tests/integration/test_memory_release.py serves requests with the collector off and checks nothing stays). So
the count rises only while a fetch's work is alive, and falls again as it is answered. A young collection
walks every young object still alive: below the in-flight population (thousands of requests of a few dozen
objects each) a threshold of 100,000 started one every couple of thousand requests, each walking the whole
in-flight work (30-45 ms; 15 % of the null-model Kafka path at 4,096 requests in flight). Above it,
collections start only when objects really accumulate (cycles, growing caches), and each then frees what
accumulated. When the last serving worker of the process stops, the collector is as it was.
``gc_young_threshold = 0`` leaves it alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_serving = 0  # workers of this process inside ``tuned_collector`` (tests and replays run several)
_thresholds_before: tuple[int, int, int] | None = None


@contextlib.contextmanager
def tuned_collector(young_threshold: int) -> Iterator[None]:
    """Freeze the heap and raise the young threshold for the block (the first worker in tunes, the last one
    out restores); nothing changes when ``young_threshold`` is 0."""
    if young_threshold <= 0:
        yield
        return
    _enter(young_threshold)
    try:
        yield
    finally:
        _leave()


def _enter(young_threshold: int) -> None:
    global _serving, _thresholds_before
    with _lock:
        if _serving == 0:
            _thresholds_before = gc.get_threshold()
            gc.collect()  # start-up garbage is freed, not frozen
        gc.freeze()  # a later worker's models join the frozen heap too
        young, *older = gc.get_threshold()
        gc.set_threshold(young_threshold if _serving == 0 else max(young, young_threshold), *older)
        _serving += 1


def _leave() -> None:
    global _serving, _thresholds_before
    with _lock:
        _serving -= 1
        if _serving == 0 and _thresholds_before is not None:
            gc.set_threshold(*_thresholds_before)
            _thresholds_before = None
            gc.unfreeze()  # what the workers left behind is the collector's again


def collect_released() -> None:
    """Free what a retired model leaves in reference cycles: it was frozen with the start-up heap, where the
    collector never looks. One full collection (tens of milliseconds), once per model swap."""
    with _lock:
        if _serving == 0:
            return  # not frozen: the collector finds it by itself
        gc.unfreeze()
        gc.collect()
        gc.freeze()
