"""Who runs torch's CPU ops on how many threads: the model thread takes the intra-op threads, the others one.

torch's CPU ops run in parallel on an OpenMP team, and every thread that runs a parallel op gets a team of its
own, kept for as long as the thread lives. Once the teams of a process hold more threads than there are CPUs,
GNU OpenMP stops letting an idle team thread wait for the next op (it spins 100 rounds instead of about
300,000) and puts it to sleep: from then on every op of every team pays a futex wake-up. A model's passes are
thousands of small ops, so a worker whose prepare thread ran the image processor (torch ops) beside the model
thread ran its passes 2-2.5x slower, and stayed that slow (docs/MEASUREMENTS.md, "CPU threads"). Hence:

* ``cap_torch_threads(n)`` at a worker's start, when ``torch_threads`` is set: the process-wide count that
  threads which set none settle on;
* ``use_intraop_threads(n)`` as the initializer of the model thread (n: ``torch_threads``, or torch's own
  choice) and, with n = 1, of the other threads that touch torch on a CPU worker (the prepare thread): a
  one-thread op runs inline and makes no team;
* ``release_idle_teams()`` once before serving, on the thread that loaded (and maybe warmed up) the model:
  its team would otherwise count against the CPUs for good.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable


def cap_torch_threads(count: int | None) -> None:
    """Cap torch's intra-op threads (torch_threads; unset leaves torch's own choice)."""
    if count:
        import torch

        torch.set_num_threads(count)


def use_intraop_threads(count: int) -> None:
    """Run this thread's torch CPU ops on ``count`` threads (1: inline, no OpenMP team)."""
    import torch

    # torch settles a thread's count on its first op, from the process-wide value that the latest
    # set_num_threads of any thread wrote: settle it now, so that this thread's count is the one that stays.
    torch.get_num_threads()
    torch.set_num_threads(count)


def intraop_initializer(count: int | None) -> Callable[[], None]:
    """A thread pool initializer giving its threads ``count`` intra-op threads (None: what the calling thread
    has now, torch's choice unless set)."""
    if count is None:
        import torch

        count = torch.get_num_threads()
    return functools.partial(use_intraop_threads, count)


def _torch_imported() -> bool:
    return "torch" in sys.modules


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """torch's bundled GNU OpenMP runtime (the one its ops run on), or None where torch brings another."""
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    if not os.path.exists(path):
        return None
    try:
        library = ctypes.CDLL(path)  # already loaded by torch: the same instance
    except OSError:
        return None
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_idle_teams() -> bool:
    """Free the calling thread's idle OpenMP team (OpenMP 5's ``omp_pause_resource_all``, soft), so that it no
    longer counts against the CPUs; its next parallel op builds a new one. False where the runtime has no such
    call (a torch not built on GNU OpenMP), which leaves things as they were; False, without importing torch
    (about a second), where nothing has imported it yet: no op has run, so there is no team."""
    if not _torch_imported():
        return False
    library = _openmp()
    if library is None:
        return False
    return int(library.omp_pause_resource_all(1)) == 0  # 1: omp_pause_soft
