"""The server processes and their ports: how each local server runs as a child of this Python process.

Each server is a child process in its own process group, logging to a file in its work folder; it is
stopped by PID (SIGTERM, then SIGKILL after a grace period). Ports are picked once per object, so
``restart()`` brings a server back on the same address with the same data -- which is what a test of
"the broker went away mid-stream" needs.

What the Kafka broker, the S3 store and the Schema Registry share lives here, so each of their modules holds
only what is its own: the error every step raises (:class:`InfraError`, with the log's tail), the ports
(:func:`free_ports`, :class:`PortTaken`), the child process (``_Process``, stopped at exit whatever happens),
and ``_LocalServer``, the start/stop/restart life of one JVM with its config, data and log in a work folder.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Self, TypeVar

import structlog

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


def _die_with_parent() -> None:
    """In the child: ask Linux to stop this server when the Python process that started it dies, so a
    killed test run or demo never leaves a broker or store behind (atexit does not run on SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class InfraError(RuntimeError):
    """A local server could not be resolved, started or reached; the message carries its log tail."""


# Ports this process has handed out: a port picked for one server is never picked for another, even after
# the first let it go (a stopped server keeps its port for its next start).
_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free right now on 127.0.0.1, picked together.

    Every socket stays bound until all are picked, so the OS cannot hand the same port twice, and no port
    this process handed out before comes back. Another program may still take one before the server binds
    it: the servers' first start retries with fresh ports when that happens (:class:`PortTaken`).
    """
    with _ports_lock, contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in _handed_out:
                ports.append(port)
        _handed_out.update(ports)
        return ports


def _free_port() -> int:
    return free_ports(1)[0]


class PortTaken(InfraError):
    """A server could not bind a port picked for it: another program took it in between."""


# What each server's log says when its port is taken (Kafka, Jetty in S3Proxy, Vert.x in Apicurio).
_PORT_TAKEN = ("Address already in use", "BindException", "Failed to bind", "seems to be in use by another process")


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def _tail(path: Path, max_bytes: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"


_live: set[_Process] = set()
_live_lock = threading.Lock()


class _Process:
    """One server child: own process group, output appended to a log file, stopped by PID.

    Its own session means Ctrl-C in a terminal reaches only the Python parent, which then stops the
    servers in order; and the group kill takes along anything the JVM might fork.
    """

    def __init__(self, name: str, cmd: list[str], log_path: Path, cwd: Path,
                 on_exit: Callable[[bool], None] | None = None) -> None:
        """``on_exit`` is told, once the process has ended, whether it exited cleanly (status 0, or a JVM's 143
        after SIGTERM) rather than being killed."""
        self.name = name
        self.log_path = log_path
        self._on_exit = on_exit
        with open(log_path, "ab") as out:
            out.write(f"\n===== d3stream: starting {name}: {' '.join(cmd[:3])} ... =====\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Only from the main thread: Linux ties the signal to the starting *thread*'s exit.
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        with _live_lock:
            _live.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float, *, failed: bool = False) -> None:
        """SIGTERM the group (clean shutdown: Kafka checkpoints its logs), SIGKILL if still there after ``grace``.
        ``failed``: it never became ready, so its exit does not count as clean for ``on_exit``."""
        try:
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGTERM)
                try:
                    self.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    log.warning("process.kill", name=self.name, pid=self.pid, grace=grace)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.pid, signal.SIGKILL)
                    self.popen.wait(timeout=30)
        finally:
            with _live_lock:
                _live.discard(self)
            self._ended(failed)

    def kill(self) -> None:
        """SIGKILL now: a crash, for tests of what survives one."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)
        with _live_lock:
            _live.discard(self)
        self._ended(failed=True)

    def _ended(self, failed: bool) -> None:
        on_exit, self._on_exit = self._on_exit, None
        if on_exit is not None:
            on_exit(not failed and self.popen.returncode in (0, 128 + signal.SIGTERM))


def _stop_leftovers() -> None:
    """atexit: never leave a JVM running after the interpreter exits (e.g. a test session aborted)."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.stop(grace=5)


atexit.register(_stop_leftovers)


def _run_sync(factory: Callable[[], Awaitable[_T]]) -> _T:
    """Run a coroutine to completion from sync code, even when this thread already runs an event loop.

    ``asyncio.run`` refuses to nest, so inside a running loop the coroutine gets its own thread and loop.
    """

    async def runner() -> _T:
        return await factory()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(runner())
    values: list[_T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            values.append(asyncio.run(runner()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=target, name="d3stream-infra-sync")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return values[0]


def _wait_until(
    ready: Callable[[], bool], proc: _Process, what: str, timeout: float, interval: float = 0.2
) -> float:
    """Poll ``ready`` until true; fail fast with the log tail if the process dies or time runs out."""
    started = time.monotonic()
    while True:
        if not proc.alive():
            raise InfraError(
                f"{what} exited with code {proc.popen.returncode} during startup; log {proc.log_path}:\n"
                f"{_tail(proc.log_path)}"
            )
        if ready():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise InfraError(
                f"{what} did not become ready within {timeout:.0f}s; log {proc.log_path}:\n{_tail(proc.log_path)}"
            )
        time.sleep(interval)


def _workdir(given: Path | None, prefix: str) -> tuple[Path, bool]:
    """The folder for a server's config, data and log, and whether we created it (and so delete it on close)."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        return given.resolve(), False
    return Path(tempfile.mkdtemp(prefix=prefix)), True

def _write_properties(path: Path, props: Mapping[str, str]) -> None:
    """A Java ``.properties`` file; backslashes are escaped (the format's only surprise for values)."""
    path.write_text("".join(f"{k}={v.replace(chr(92), chr(92) * 2)}\n" for k, v in props.items()))


class _LocalServer:
    """What the embedded broker and object store share: one JVM process with its config, data and log in a
    work folder. ``stop``/``start`` keep the port and the data, so a test can take a server away under a
    running service and bring the same one back; ``close`` also deletes the folder if this object made it.
    Subclasses set ``workdir``, ``_owns_workdir``, ``log_path``, ``startup_timeout`` and ``stop_grace`` and
    start through :meth:`_launch`."""

    event = "server"  # prefix of the log events: <event>.starting, .ready, .stopping
    label = "server"  # its name in start-up errors
    workdir: Path
    _owns_workdir: bool
    log_path: Path
    startup_timeout: float
    stop_grace: float
    startup_seconds: float | None = None
    _proc: _Process | None = None
    _log_start = 0
    _launched_at = 0.0
    _started_once = False
    _ports_picked = False  # picked here rather than given: a lost port race may pick again

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc else None

    def _ready(self) -> bool:
        raise NotImplementedError

    def _launch(self, cmd: list[str], started: float, *, poll_s: float = 0.2, wait: bool = True,
                on_exit: Callable[[bool], None] | None = None, **where: object) -> None:
        """Run ``cmd`` and (with ``wait``) wait until :meth:`_ready`; a server that dies or stays unready is
        stopped and the error carries its log tail (:class:`PortTaken` when its port was taken). ``on_exit``:
        see :class:`_Process`."""
        log.info(f"{self.event}.starting", workdir=str(self.workdir), **where)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._launched_at = started
        self._proc = _Process(self.event, cmd, self.log_path, self.workdir, on_exit)
        if wait:
            self.wait_ready(poll_s=poll_s, **where)

    def wait_ready(self, *, poll_s: float = 0.2, **where: object) -> Self:
        """Wait until the launched server answers; stop it and raise when it dies or stays unready."""
        proc = self._proc
        if proc is None:
            raise InfraError(f"{self.label} was not started")
        try:
            _wait_until(self._ready, proc, self.label, self.startup_timeout, interval=poll_s)
        except InfraError as exc:
            proc.stop(grace=5, failed=True)
            self._proc = None
            if self._port_taken():
                raise PortTaken(f"{self.label}: a port picked for it was taken by another program; {exc}") from exc
            raise
        except BaseException:
            proc.stop(grace=5, failed=True)
            self._proc = None
            raise
        self.startup_seconds = time.monotonic() - self._launched_at
        self._started_once = True
        log.info(f"{self.event}.ready", pid=proc.pid, seconds=round(self.startup_seconds, 2), **where)
        return self

    def _port_taken(self) -> bool:
        """Whether this launch's log says a port was in use."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return False
        return any(marker in text for marker in _PORT_TAKEN)

    def start(self) -> Self:
        """Launch the server and wait until it answers. A first start whose picked port was taken in between
        (another program bound it) tries again on fresh ports; later starts keep their address."""
        attempts = 4
        for attempt in range(1, attempts + 1):
            try:
                return self._start()
            except PortTaken:
                if self._started_once or not self._ports_picked or attempt == attempts:
                    raise
                log.info(f"{self.event}.port_taken", attempt=attempt)
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start(self) -> Self:
        raise NotImplementedError

    def _pick_ports(self) -> None:
        """Fresh ports for a first start that lost a port race."""
        raise NotImplementedError

    def stop(self) -> None:
        """Clean shutdown (SIGTERM, SIGKILL after ``stop_grace``); the data stays for the next ``start``."""
        if self._proc is None:
            return
        log.info(f"{self.event}.stopping", pid=self._proc.pid)
        self._proc.stop(self.stop_grace)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, no clean shutdown: the server crashing (a broker's :meth:`start` then recovers its logs)."""
        if self._proc is not None:
            log.info(f"{self.event}.killing", pid=self._proc.pid)
            self._proc.kill()
            self._proc = None

    def restart(self) -> None:
        """Stop then start on the same port and data folder."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop, and delete the work folder if this object created it."""
        self.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
