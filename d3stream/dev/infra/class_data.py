"""Class-data archives (AppCDS) for the embedded servers' JVMs, so that a server that starts often starts cheaper.

A JVM spends most of a short life loading, parsing and verifying the same few thousand classes from its jars.
With an archive of them (HotSpot's class-data sharing, Java 13 and newer) it maps them ready-made instead, on
0.58-0.64 of the CPU per start and stop for each of the three servers (``d3stream bench servers``; figures in
docs/MEASUREMENTS.md). The test suite starts about sixty servers, so it turns this on (:data:`ARCHIVES_ENV`, set
in tests/conftest.py); ``d3stream stack`` and the demo, which start three each, do not.

There is no separate step to make an archive: a server started while its archive is missing is told to write
one when it exits (``-XX:ArchiveClassesAtExit``), to a file of its own; only a clean exit of a server that became
ready (SIGTERM, not the SIGKILL of a stop that ran out of grace, nor a test's kill) moves it into place, so a
half-written archive, or one of a server that never got going, is never used. Each archive is named after what it must match (the ``java`` and its runtime image, the class
path or jar, the server), so a new JDK or a new jar set makes a new one. A JVM that finds an archive it cannot
use (one made by another JDK build at the same path) says so in the server's log and starts without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

ARCHIVES_ENV = "D3STREAM_EMBEDDED_JVM_ARCHIVES"
"""``1``: the embedded servers start from class-data archives, made on their first clean exit (off by default)."""


def archives_wanted() -> bool:
    return os.environ.get(ARCHIVES_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def server_archive(server: str, java: str, classes: str) -> ClassDataArchive:
    """The archive a server start uses (or writes); one that gives no flags unless :data:`ARCHIVES_ENV` asks
    for archives. They live in ``$D3STREAM_CACHE/jvm-archives`` (default ``~/.cache/d3stream``), beside the jars."""
    return ClassDataArchive.of(archive_folder(), server, java, classes, wanted=archives_wanted())


def archive_folder() -> Path:
    return Path(os.environ.get("D3STREAM_CACHE") or Path.home() / ".cache" / "d3stream") / "jvm-archives"


def _runtime_identity(java: str) -> str:
    """What tells one JDK build from another: the resolved ``java`` and its runtime image's size and time."""
    resolved = Path(java).resolve()
    modules = resolved.parent.parent / "lib" / "modules"
    try:
        stat = modules.stat()
        return f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        return str(resolved)


@dataclass
class ClassDataArchive:
    """The archive of one server's classes for one ``java`` and class path, in ``folder``."""

    path: Path
    wanted: bool = True  # False: no flags, the server starts as it would without archives
    _pending: Path | None = field(default=None, init=False)

    @classmethod
    def of(cls, folder: Path, server: str, java: str, classes: str, *, wanted: bool = True) -> ClassDataArchive:
        """``classes``: the class path, or the jar run with ``-jar``, exactly as the command line gives it."""
        key = hashlib.sha256("\n".join((server, _runtime_identity(java), classes)).encode()).hexdigest()[:16]
        return cls(folder / f"{server}-{key}.jsa", wanted)

    def options(self) -> list[str]:
        """The JVM flags of a server start: use the archive, or write it at exit when there is none yet."""
        if not self.wanted:
            return []
        if self.path.is_file():
            return [f"-XX:SharedArchiveFile={self.path}"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._sweep()
        self._pending = self.path.with_name(f"{self.path.stem}.{uuid.uuid4().hex[:8]}.partial")
        return [f"-XX:ArchiveClassesAtExit={self._pending}"]

    def reuse_only(self) -> list[str]:
        """The flags of a short helper run on the same class path (Kafka's storage format): use the archive when
        there is one, never write it (a helper's classes are not the server's)."""
        return [f"-XX:SharedArchiveFile={self.path}"] if self.wanted and self.path.is_file() else []

    def _sweep(self) -> None:
        """Drop this archive's pending files older than a day: written by servers whose parent went away before
        it could keep or drop them (a JVM told by the kernel that its parent died exits cleanly, and dumps)."""
        stale = time.time() - 86_400
        for pending in self.path.parent.glob(f"{self.path.stem}.*.partial"):
            with contextlib.suppress(OSError):
                if pending.stat().st_mtime < stale:
                    pending.unlink()

    def exited(self, cleanly: bool) -> None:
        """The server's JVM has ended: keep the archive it wrote on a clean exit, drop a partial one."""
        pending, self._pending = self._pending, None
        if pending is None or not pending.is_file():
            return
        if cleanly and pending.stat().st_size > 0:
            os.replace(pending, self.path)  # atomic: a JVM starting meanwhile sees the whole file or none
            log.info("class_data.archived", path=str(self.path), bytes=self.path.stat().st_size)
        else:
            with contextlib.suppress(OSError):
                pending.unlink()
