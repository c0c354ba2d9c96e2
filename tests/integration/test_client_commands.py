"""Ctrl-C ends a Kafka client command (``consume``, ``produce``) even when a library loses the cancellation.

aiokafka closes a client's background task under ``suppress(CancelledError)``: a cancellation that arrives
while it waits there is swallowed with the task's own. The Ctrl-C of ``d3stream consume`` was once lost so (a
fresh-clone CI run: still reading 120 s after the signal, its ``--timeout`` an hour away). ``run_command``'s
loop therefore also gets ``stop_asked``; these tests lose the cancellation on purpose, in the same process and
through the real command.

The whole commands under signals: tests/system/test_one_line_failures.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

import pytest

from d3stream.cli.common import run_kafka


async def _swallowing_a_cancellation(stop_asked: Callable[[], bool]) -> str:
    """What a command does when a library swallows its cancellation: it would go on until its --timeout."""
    os.kill(os.getpid(), signal.SIGINT)
    with contextlib.suppress(asyncio.CancelledError):  # as aiokafka's close() awaits its sync task
        await asyncio.sleep(5)
    deadline = time.monotonic() + 30
    while not stop_asked():
        assert time.monotonic() < deadline, "Ctrl-C was lost: the command would have read until its --timeout"
        await asyncio.sleep(0.05)
    return "stopped"


def test_ctrl_c_ends_a_client_command_whose_cancellation_a_library_swallowed(stack):
    with pytest.raises(KeyboardInterrupt):
        run_kafka(stack.settings(), _swallowing_a_cancellation)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is Python's own again


async def _reading(stop_asked: Callable[[], bool]) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.sleep(30)  # the cancellation ends this
    raise AssertionError("not cancelled")


def test_ctrl_c_cancels_a_client_command_where_nothing_swallows_it(stack):
    with pytest.raises(KeyboardInterrupt):
        run_kafka(stack.settings(), _reading)


async def _done(stop_asked: Callable[[], bool]) -> str:
    return "done"


def test_a_client_command_that_was_not_interrupted_ends_with_status_0(stack):
    assert run_kafka(stack.settings(), _done) == 0
