"""``d3stream bench servers``: what each embedded server's start costs, without and with its class-data archive.

The test suite starts about sixty short-lived JVM servers (Kafka brokers, S3Proxy stores, Schema Registries) on a
2-core machine, so their start-up CPU is suite time. Each server is started and stopped ``rounds`` times with no
archive, once more to write its archive (``dev/infra/class_data.py``: on a clean exit), then ``rounds`` times
from the archive; the report gives the CPU of each start and stop (the JVM's, with Kafka's storage format) and the
wall time until it answered. The archives go to a temporary folder, not the cache the suite uses.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from d3stream.dev.infra import KafkaBroker, ObjectStore, SchemaRegistry, class_data

SERVERS: dict[str, Callable[[], Any]] = {"kafka": KafkaBroker, "s3proxy": ObjectStore, "registry": SchemaRegistry}
RUNS = ("no archive", "writing it", "from the archive")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _start_and_stop(make: Callable[[], Any]) -> tuple[float, float]:
    """CPU seconds of one start and stop of a fresh server (its JVMs, ended), and seconds until it answered."""
    cpu, began = _children_cpu_s(), time.monotonic()
    server = make()
    try:
        server.start()
        answered = time.monotonic() - began
    finally:
        server.close()
    return _children_cpu_s() - cpu, answered


def servers_bench(rounds: int = 3, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    step = progress or (lambda name: None)
    folder = Path(tempfile.mkdtemp(prefix="d3stream-bench-archives-"))
    wanted, kept_folder = os.environ.get(class_data.ARCHIVES_ENV), class_data.archive_folder
    class_data.archive_folder = lambda: folder  # the measured archives only, not the cache the suite uses
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for name, make in SERVERS.items():
            results[name] = {}
            for run in RUNS:
                os.environ[class_data.ARCHIVES_ENV] = "0" if run == "no archive" else "1"
                times = [_start_and_stop(make) for _ in range(1 if run == "writing it" else rounds)]
                results[name][run] = {"cpu_s": sum(cpu for cpu, _ in times) / len(times),
                                      "start_s": sum(wall for _, wall in times) / len(times), "runs": len(times)}
                step(f"{name}: {run}")
    finally:
        class_data.archive_folder = kept_folder
        if wanted is None:
            os.environ.pop(class_data.ARCHIVES_ENV, None)
        else:
            os.environ[class_data.ARCHIVES_ENV] = wanted
    return {"rounds": rounds, "jvm_options": os.environ.get("D3STREAM_EMBEDDED_JVM_OPTIONS", ""),
            "servers": results}


def servers_markdown(report: dict[str, Any]) -> str:
    lines = [f"Each server started and stopped {report['rounds']} times (JVM options "
             f"{report['jvm_options'] or 'none'}), CPU of the JVMs per start and stop, seconds until it answered:",
             "", "| server | " + " | ".join(RUNS) + " | CPU from the archive ÷ without |",
             "|---|" + "---:|" * (len(RUNS) + 1)]
    for name, runs in report["servers"].items():
        cells = [f"{runs[run]['cpu_s']:.2f} CPU-s, {runs[run]['start_s']:.2f} s" for run in RUNS]
        ratio = runs["from the archive"]["cpu_s"] / max(runs["no archive"]["cpu_s"], 1e-9)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines) + "\n"
