"""One worker of ``d3stream bench fleet``: the real worker with a model that only waits, as a GPU pass does.

``python -P -m d3stream.benchmarks.fleet_worker --device-ms 40`` runs what ``d3stream serve`` runs -- ``Service``,
with its consume loop, request pipeline, batch scheduler, commit policy, rebalance listener and metrics
endpoint, its settings read from the ``D3STREAM_*`` variables (and flags or a file) as ``serve`` reads them --
with ``SleepModel`` in place of a checkpoint. SIGTERM and SIGINT stop it as they stop ``serve``: stop reading,
finish what is in flight, publish, commit, leave the group, exit 0.

``SleepModel`` is the Kafka benchmark's ``NullModel`` (it validates the questions and answers uniform
probabilities) whose ``forward`` first sleeps ``--device-ms``, once per pass, however many rows it carries. The
service calls ``forward`` on its one model thread (``core.passes.model_thread``), exactly where a real pass runs,
and ``time.sleep`` releases the GIL: the pass takes its device time while the event loop fetches, prepares,
publishes and commits, and no CPU is spent, as with a GPU pass that the model thread waits on. So a fleet of
these is bound by its passes (``max_batch_rows`` rows per ``--device-ms``), not by the CPUs of the machine it
runs on, and what a rebalance costs shows as passes not run.

Why a module of its own and not a flag of ``serve``: the production command carries no fake model. ``--load-s``
stands for a checkpoint's load (the seconds a real worker spends between its process start and joining the
group); without it a start costs the interpreter and the imports only.

``--serve-nice N``: bench fleet starts its workers below its own CPU priority (``nice -n``) and each takes
priority ``N`` back once its service is built, to drop it again when its service has stopped. On a fleet each
worker has a machine of its own; on the 2-core machine the fleet runs on, a starting process (interpreter,
imports, torch) or an exiting one (the interpreter's teardown, seconds of garbage collection) would otherwise
take its CPU from the workers serving beside it, and a restart would cost them throughput no real fleet pays.
Taking a priority back needs the privilege to (root, or CAP_SYS_NICE); without it the worker serves at the
priority it started with, as every other worker then does too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Sequence

from d3stream.benchmarks.bench_service import NullModel
from d3stream.runtime import Row


class SleepModel(NullModel):
    """``NullModel`` whose every forward pass holds the model thread for ``device_s`` without using the CPU."""

    model_name = "sleep-model"

    def __init__(self, device_s: float):
        super().__init__()
        self.device_s = device_s

    def provenance(self) -> dict[str, str]:
        return {"kind": "sleep", "runtime": "d3stream-bench-fleet",
                "policy": f"uniform probabilities after {self.device_s * 1000:g} ms per pass, no model"}

    def forward(self, rows: Sequence[Row]) -> list[list[float]]:
        # On the model thread, where a real pass waits for its device: the GIL is released meanwhile.
        time.sleep(self.device_s)
        return super().forward(rows)


def main(argv: list[str] | None = None) -> int:
    from d3stream.kafka.connection import check_connection
    from d3stream.ops.logs import configure_logging
    from d3stream.ops.metrics import Metrics, serve_metrics
    from d3stream.service import Service
    from d3stream.settings import add_arguments, load_settings

    parser = argparse.ArgumentParser(prog="python -P -m d3stream.benchmarks.fleet_worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-ms", type=float, default=40.0, help="device time of one forward pass (a sleep)")
    parser.add_argument("--load-s", type=float, default=0.0,
                        help="seconds a checkpoint's load would take, spent after the metrics endpoint is up")
    parser.add_argument("--serve-nice", type=int, default=None,
                        help="the CPU priority (nice value) to serve at, taken once the service is built")
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = load_settings(args)
    check_connection(settings.connection)
    configure_logging(settings.observability.log_format, settings.observability.log_level)
    # As serve does: the endpoint is up before the (simulated) load, so a probe sees a live process meanwhile.
    metrics = Metrics()
    server = serve_metrics(metrics, settings.observability)
    stop_asked = False

    def stop_loading(signum: int, frame: object) -> None:
        nonlocal stop_asked
        stop_asked = True

    # Until the event loop takes the signals over, one only notes that a stop was asked (a SIGTERM during the
    # load ends it at once, one during the service's set-up stops the service as soon as it runs).
    for each in (signal.SIGTERM, signal.SIGINT):
        signal.signal(each, stop_loading)
    try:
        deadline = time.monotonic() + args.load_s
        while not stop_asked and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if stop_asked:
            return 0
        service = Service(settings, SleepModel(args.device_ms / 1000), metrics=metrics)
        started_at = os.getpriority(os.PRIO_PROCESS, 0)

        async def serve() -> None:
            if args.serve_nice is not None:
                take_priority(args.serve_nice)
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, service.stop)
            if stop_asked:
                service.stop()
            try:
                await service.run()
            finally:
                if service.consumer is not None:  # a start-up step that failed leaves it made, never started
                    await service.consumer.stop()

        asyncio.run(serve())
        if args.serve_nice is not None:
            take_priority(started_at)  # the interpreter's teardown yields to the workers still serving
    finally:
        if server is not None:
            server.stop()
    return 0


def take_priority(nice: int) -> None:
    """Serve at CPU priority ``nice`` from here on (the calling thread and the threads it starts later: Linux
    keeps a nice value per thread). Raising it back needs a privilege: without one, say so and go on."""
    import structlog

    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        structlog.get_logger(__name__).warning("CPU priority not taken back: serving at the start's", nice=nice,
                                               serving_at=os.getpriority(os.PRIO_PROCESS, 0))


if __name__ == "__main__":
    sys.exit(main())
