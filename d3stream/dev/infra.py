"""Real local servers for tests and ``d3stream demo``: an Apache Kafka broker and an S3-compatible store.

Why real servers rather than mocks: the service's correctness rests on broker behaviour that fakes do not
reproduce (transactions and ``read_committed``, consumer-group rebalances, a broker restarting under a
running consumer, S3 ETags and range reads). So tests start the actual programs:

* **Kafka** 4.x in KRaft mode (one JVM acting as broker and controller), built from the Maven Central jars
  listed in ``d3stream/dev/jvm/pom.xml`` -- no tarball download, no Docker.
* **S3Proxy** (same pom, its self-contained jar) with the jclouds ``filesystem`` backend, so objects are
  ordinary files in a temporary folder and survive a stop/start of the server.

Each server is a child process in its own process group, logging to a file in its work folder; it is
stopped by PID (SIGTERM, then SIGKILL after a grace period). Ports are picked once per object, so
``restart()`` brings a server back on the same address with the same data -- which is what a test of
"the broker went away mid-stream" needs.

Requirements: ``java`` (17+) and, the first time only, ``mvn`` plus network access to Maven Central.
:func:`ensure_jars` resolves the jars once into ``$D3STREAM_CACHE`` (default ``~/.cache/d3stream/jvm``),
in a sub-folder named after the pom's hash, so editing a version in the pom re-resolves by itself.

Tool output never goes to the terminal: Maven writes to ``maven.log`` in that sub-folder, each server to
its own log file, and an :class:`InfraError` carries the log's path and tail when a step fails -- a run
that works reads clean, one that does not says where to look.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import fcntl
import hashlib
import http.client
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self, TypeVar

import structlog

if TYPE_CHECKING:
    from botocore.client import BaseClient

__all__ = [
    "POM_PATH",
    "InfraError",
    "KafkaBroker",
    "ObjectStore",
    "LocalStack",
    "SchemaRegistry",
    "embedded_stack",
    "ensure_jars",
    "ensure_registry",
    "free_ports",
    "java_available",
    "kafka_properties",
    "local_stack",
]

log = structlog.get_logger(__name__)

POM_PATH = Path(__file__).parent / "jvm" / "pom.xml"
"""The Maven pom naming the Kafka and S3Proxy jars (a data file; ``d3stream/dev/jvm`` is not a package)."""

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


# --------------------------------------------------------------------------------------------------
# Jars


def _cache_dir() -> Path:
    """Where resolved jars live: one folder per pom content, so a pom edit never reuses stale jars."""
    root = Path(os.environ.get("D3STREAM_CACHE") or Path.home() / ".cache" / "d3stream") / "jvm"
    digest = hashlib.sha256(POM_PATH.read_bytes()).hexdigest()[:16]
    return root / digest


def _java() -> str:
    """The ``java`` executable: ``$JAVA_HOME/bin/java`` when set, else the one on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise InfraError(
            "java (17 or newer) is not on PATH and JAVA_HOME is not set; it runs Kafka and S3Proxy"
        )
    return found


# Extra JVM flags for both servers, after the defaults (a later flag wins). The test suite sets
# ``-XX:TieredStopAtLevel=1`` (C1 only) for its many short-lived servers: measured, a broker then starts on 2.9
# CPU-s instead of 6.1, and idles on two thirds of the CPU it took before.
JVM_OPTIONS_ENV = "D3STREAM_EMBEDDED_JVM_OPTIONS"


def _jvm_options() -> list[str]:
    return shlex.split(os.environ.get(JVM_OPTIONS_ENV, ""))


def java_available() -> str | None:
    """Why the local stack cannot run here, or None when it can (java present, jars resolved or mvn present).

    Fixtures use this to skip with a clear reason instead of failing deep inside a subprocess.
    """
    try:
        _java()
    except InfraError as exc:
        return str(exc)
    if not (_cache_dir() / ".resolved").is_file() and not shutil.which("mvn"):
        return "the Kafka/S3Proxy jars are not resolved yet and mvn is not on PATH to resolve them"
    return None


def ensure_jars(progress: bool = False) -> Path:
    """Resolve the pom's jars from Maven Central once and return the folder holding them.

    Runs ``mvn dependency:copy-dependencies`` on a copy of the pom inside the cache folder (the package
    folder may be read-only). A marker file records success, so later calls cost one ``stat``; a file
    lock keeps parallel test processes from resolving into the same folder at once. The plugin version is
    pinned so the result does not depend on what the local Maven repository happens to hold.

    Maven's output (a screen of ``[INFO]`` lines) goes to ``maven.log`` in the cache folder, never to the
    terminal: a failure raises :class:`InfraError` with the log's tail and path, which is the only time
    anyone needs to read it. With ``progress`` one line says that the jars are being fetched and where
    Maven's output is (a first run waits on the network here, and should know why).
    """
    cache = _cache_dir()

    def resolve(mvn: str, staging: Path) -> str:
        shutil.copyfile(POM_PATH, cache / "pom.xml")
        if progress:
            _notice(f"fetching the Kafka and S3Proxy jars with Maven (once; its output goes to {cache / 'maven.log'})")
        log.info("jars.resolving", cache=str(cache))
        started = time.monotonic()
        _maven(mvn, cache, ["-f", str(cache / "pom.xml"),
                            f"{_DEPENDENCY_PLUGIN}:copy-dependencies", f"-DoutputDirectory={staging}"], str(POM_PATH))
        _kafka_classpath(staging)  # fail now, not at first start, if the pom lost a jar
        _s3proxy_jar(staging)
        log.info("jars.resolved", cache=str(cache), seconds=round(time.monotonic() - started, 1))
        return "\n".join(sorted(p.name for p in staging.glob("*.jar"))) + "\n"

    return _fetched_once(cache, "lib", "the Kafka/S3Proxy jars", resolve)


def _fetched_once(root: Path, name: str, what: str, fetch: Callable[[str, Path], str]) -> Path:
    """``root/name``, made once by ``fetch(mvn, staging folder)`` (which returns the marker's text) and kept.

    A marker file records success, so later calls cost one ``stat``; a file lock keeps parallel test processes
    from fetching into the same folder at once; the result is made in a staging folder and renamed into place,
    so an interrupted fetch leaves nothing that looks finished."""
    result, marker = root / name, root / ".resolved"
    if marker.is_file():
        return result
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return result
        mvn = shutil.which("mvn")
        if not mvn:
            raise InfraError(f"mvn is not on PATH; it is needed once to fetch {what}")
        staging = root / f"{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        marked = fetch(mvn, staging)
        shutil.rmtree(result, ignore_errors=True)
        staging.rename(result)
        marker.write_text(marked)
    return result


_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"


def _maven(mvn: str, cache: Path, arguments: list[str], what: str) -> None:
    """Run one Maven goal with its output in ``cache/maven.log``; InfraError with the log's tail if it fails.

    The plugin version is pinned so the result does not depend on what the local Maven repository holds."""
    log_path = cache / "maven.log"
    cmd = [mvn, "-B", *arguments]  # -B: no colours and no download progress meter in the log file
    with open(log_path, "w") as out:
        out.write(f"===== d3stream: {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cache, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise InfraError(
            f"Maven could not resolve {what} (exit {proc.returncode}); its log {log_path} ends:\n"
            f"{_tail(log_path, 4000)}"
        )


def _notice(text: str) -> None:
    """One line for the person at the terminal, through ``tqdm.write`` so that a progress bar drawn at the
    time (the demo's) is redrawn below it instead of being torn."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def _s3proxy_jar(lib: Path) -> Path:
    jars = sorted(lib.glob("s3proxy-*-jar-with-dependencies.jar"))
    if not jars:
        raise InfraError(f"no S3Proxy jar in {lib}; delete {lib.parent} to resolve again")
    return jars[-1]


def _kafka_classpath(lib: Path) -> str:
    """Every resolved jar except S3Proxy's shaded one, whose bundled Jetty/Jackson must not mix with Kafka's."""
    jars = sorted(p for p in lib.glob("*.jar") if not p.name.startswith("s3proxy-"))
    if not any(p.name.startswith("kafka_2.13-") for p in jars):
        raise InfraError(f"no kafka_2.13 jar in {lib}; delete {lib.parent} to resolve again")
    return os.pathsep.join(str(p) for p in jars)


# --------------------------------------------------------------------------------------------------
# Processes


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

    def __init__(self, name: str, cmd: list[str], log_path: Path, cwd: Path) -> None:
        self.name = name
        self.log_path = log_path
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

    def stop(self, grace: float) -> None:
        """SIGTERM the group (clean shutdown: Kafka checkpoints its logs), SIGKILL if still there after ``grace``."""
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

    def kill(self) -> None:
        """SIGKILL now: a crash, for tests of what survives one."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)
        with _live_lock:
            _live.discard(self)


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


# --------------------------------------------------------------------------------------------------
# Kafka


_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = INFO
"""


def kafka_properties(
    *,
    port: int,
    controller_port: int,
    log_dir: Path,
    partitions: int = 4,
    node_id: int = 1,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``server.properties`` of a single-node KRaft cluster (broker and controller in one process).

    Everything that would otherwise need three brokers is set to one replica. Internal topics get few
    partitions so the first consumer group and the first transaction are quick to set up. ``extra`` is
    applied last and may override anything -- e.g. to switch the client listener to SASL_PLAINTEXT
    (``listeners``, ``advertised.listeners``, ``listener.security.protocol.map``,
    ``sasl.enabled.mechanisms``, ``listener.name.<name>.plain.sasl.jaas.config``).
    """
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": f"{node_id}@127.0.0.1:{controller_port}",
        "controller.listener.names": "CONTROLLER",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": str(partitions),
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "true",
        "delete.topic.enable": "true",
        # After a crash (kill()) the controller refuses the new incarnation until the old one's session
        # expires (DUPLICATE_BROKER_REGISTRATION): 9 s by default, ~4 s here. Not lower, so a loaded
        # machine's GC pause does not fence the only broker.
        "broker.heartbeat.interval.ms": "500",
        "broker.session.timeout.ms": "4000",
        "num.network.threads": "2",
        "num.io.threads": "4",
    }
    props.update(extra or {})
    return props


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
                **where: object) -> None:
        """Run ``cmd`` and (with ``wait``) wait until :meth:`_ready`; a server that dies or stays unready is
        stopped and the error carries its log tail (:class:`PortTaken` when its port was taken)."""
        log.info(f"{self.event}.starting", workdir=str(self.workdir), **where)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._launched_at = started
        self._proc = _Process(self.event, cmd, self.log_path, self.workdir)
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
            proc.stop(grace=5)
            self._proc = None
            if self._port_taken():
                raise PortTaken(f"{self.label}: a port picked for it was taken by another program; {exc}") from exc
            raise
        except BaseException:
            proc.stop(grace=5)
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


class KafkaBroker(_LocalServer):
    """A single-node Kafka (KRaft) on 127.0.0.1, for tests and the demo.

    Ports and the data folder are fixed for the object's lifetime, so :meth:`restart` (or :meth:`kill`
    then :meth:`start`) brings the *same* cluster back: same address, same topics, same committed offsets.
    Use as a context manager, or call :meth:`start` and :meth:`close`.
    """

    event, label = "kafka", "Kafka"

    def __init__(
        self,
        workdir: Path | None = None,
        partitions: int = 4,
        extra_properties: Mapping[str, str] | None = None,
        *,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
        startup_timeout: float = 90.0,
        stop_grace: float = 30.0,
        client_options: Mapping[str, object] | None = None,
        format_arguments: Sequence[str] = (),
    ) -> None:
        """``client_options`` are extra aiokafka kwargs (``security_protocol``, ``sasl_*``) that the
        readiness probe and :meth:`create_topic` need when ``extra_properties`` turn on SASL.
        ``format_arguments`` are added to ``kafka-storage format`` on the first start, e.g.
        ``--add-scram=SCRAM-SHA-512=[name=alice,password=secret]`` (KRaft's way to create SCRAM users)."""
        self.workdir, self._owns_workdir = _workdir(workdir, "d3stream-kafka-")
        self.partitions = partitions
        self.extra_properties = dict(extra_properties or {})
        self._ports_picked = port is None and controller_port is None
        picked = free_ports(2)
        self.port = port or picked[0]
        self.controller_port = controller_port or picked[1]
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.client_options: dict[str, object] = dict(client_options or {})
        self.format_arguments = list(format_arguments)
        self.log_path = self.workdir / "kafka.log"
        self.data_dir = self.workdir / "data"
        self.startup_seconds = None
        self._proc = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _pick_ports(self) -> None:
        self.port, self.controller_port = free_ports(2)

    # -- lifecycle

    def _start(self) -> Self:
        """Write the config, format storage on first start, launch the JVM and wait until it serves metadata."""
        if self.running:
            return self
        lib = ensure_jars()
        classpath = _kafka_classpath(lib)
        java = _java()
        props_path = self.workdir / "server.properties"
        log4j_path = self.workdir / "log4j2.properties"
        _write_properties(
            props_path,
            kafka_properties(
                port=self.port,
                controller_port=self.controller_port,
                log_dir=self.data_dir,
                partitions=self.partitions,
                extra=self.extra_properties,
            ),
        )
        log4j_path.write_text(_LOG4J2)
        jvm = [
            java,
            f"-Xmx{self.heap}",
            "-Xms64m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            *_jvm_options(),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j_path}",
            "-cp",
            classpath,
        ]
        started = time.monotonic()
        if not (self.data_dir / "meta.properties").is_file():
            self._format(jvm, props_path)
        self._launch([*jvm, "kafka.Kafka", str(props_path)], started, bootstrap=self.bootstrap_servers)
        return self

    def _format(self, jvm: list[str], props_path: Path) -> None:
        """``kafka-storage format`` with a fresh cluster id (static quorum: no ``--standalone`` needed)."""
        cluster_id = "-"
        while cluster_id.startswith("-"):  # like Kafka's Uuid.randomUuid: a leading '-' reads as an option
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        cmd = [
            *jvm,
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            f"--config={props_path}",
            *self.format_arguments,
        ]
        with open(self.log_path, "a") as out:
            proc = subprocess.run(cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=120)
        if proc.returncode != 0:
            raise InfraError(
                f"kafka-storage format failed (exit {proc.returncode}); log {self.log_path}:\n{_tail(self.log_path)}"
            )

    def _ready(self) -> bool:
        """The client port accepts connections and a metadata request lists this node as a broker."""
        if not _port_open(self.port):
            return False

        async def probe() -> bool:
            from aiokafka.admin import AIOKafkaAdminClient

            admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000, **self.client_options
            )
            try:
                await admin.start()
                cluster = await admin.describe_cluster()
                return any(b["node_id"] == 1 for b in cluster.get("brokers", []))
            except Exception:  # noqa: BLE001 - any failure means not ready yet; the caller retries
                return False
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()

        return _run_sync(probe)

    def kill(self) -> None:
        """SIGKILL, no clean shutdown: the broker crashing. :meth:`start` recovers the logs."""
        if self._proc is not None:
            log.info("kafka.killing", pid=self._proc.pid)
            self._proc.kill()
            self._proc = None

    # -- helpers

    def create_topic(
        self,
        name: str,
        partitions: int | None = None,
        config: Mapping[str, str] | None = None,
        *,
        exist_ok: bool = False,
    ) -> None:
        """Create a topic (replication 1) and wait until every partition has a leader.

        Waiting for leaders avoids the first produce racing the metadata propagation. Safe to call from
        inside a running event loop (it then uses a helper thread).
        """
        _run_sync(lambda: self.acreate_topic(name, partitions, config, exist_ok=exist_ok))

    async def acreate_topic(
        self,
        name: str,
        partitions: int | None = None,
        config: Mapping[str, str] | None = None,
        *,
        exist_ok: bool = False,
    ) -> None:
        """Async form of :meth:`create_topic`."""
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.errors import for_code

        count = partitions or self.partitions
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, **self.client_options)
        await admin.start()
        try:
            response = await _once_a_controller_is_known(lambda: admin.create_topics(
                [NewTopic(name, count, 1, topic_configs=dict(config or {}))], timeout_ms=30000
            ))
            for entry in response.topic_errors:
                topic, code = entry[0], entry[1]
                if code == 0 or (exist_ok and code == 36):  # 36: TOPIC_ALREADY_EXISTS
                    continue
                message = entry[2] if len(entry) > 2 else ""
                raise InfraError(
                    f"creating topic {topic!r} failed: {for_code(code).__name__} {message or ''}".strip()
                )
            deadline = time.monotonic() + 30
            while True:
                (meta,) = await admin.describe_topics([name])
                parts = meta.get("partitions", [])
                if (
                    meta.get("error_code", 0) == 0
                    and len(parts) >= count
                    and all(p["leader"] >= 0 for p in parts)
                ):
                    return
                if time.monotonic() > deadline:
                    raise InfraError(f"topic {name!r} has no leaders after 30s: {meta}")
                await asyncio.sleep(0.1)
        finally:
            await admin.close()


async def _once_a_controller_is_known(call: Callable[[], Awaitable[_T]]) -> _T:
    """``call()``, tried again for up to 15 s while the metadata names no controller: aiokafka's admin then fails
    with an AttributeError in its send to the controller (seen once in a CI run, the broker under load)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            return await call()
        except AttributeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


# --------------------------------------------------------------------------------------------------
# S3


class ObjectStore(_LocalServer):
    """S3Proxy on 127.0.0.1 with the filesystem backend: a real S3 HTTP API whose objects are files.

    Signatures are checked (V2 or V4) against fixed test keys, so code that forgets credentials fails
    here as it would against AWS. :meth:`stop`/:meth:`start` keep the port and the files, so a test can
    take the store away under a running service and bring it back.
    """

    event, label = "s3", "S3Proxy"

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        port: int | None = None,
        access_key: str = "d3stream-test",
        secret_key: str = "d3stream-test-secret",
        region: str = "us-east-1",
        heap: str = "256m",
        startup_timeout: float = 60.0,
        stop_grace: float = 10.0,
    ) -> None:
        self.workdir, self._owns_workdir = _workdir(workdir, "d3stream-s3-")
        self._ports_picked = port is None
        self.port = port or _free_port()
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "s3proxy.log"
        self.startup_seconds = None
        self._proc = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pick_ports(self) -> None:
        self.port = _free_port()

    def _start(self) -> Self:
        """Launch S3Proxy and wait until its HTTP port answers (any status: unauthenticated gets 403)."""
        if self.running:
            return self
        jar = _s3proxy_jar(ensure_jars())
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props_path = self.workdir / "s3proxy.properties"
        _write_properties(
            props_path,
            {
                "s3proxy.endpoint": self.endpoint_url,
                "s3proxy.authorization": "aws-v2-or-v4",
                "s3proxy.identity": self.access_key,
                "s3proxy.credential": self.secret_key,
                "jclouds.provider": "filesystem",
                "jclouds.filesystem.basedir": str(self.data_dir),
            },
        )
        cmd = [
            _java(),
            f"-Xmx{self.heap}",
            "-Xms32m",
            *_jvm_options(),
            "-Djava.awt.headless=true",
            "-Dlogback.statusListenerClass=ch.qos.logback.core.status.NopStatusListener",
            "-jar",
            str(jar),
            "--properties",
            str(props_path),
        ]
        self._launch(cmd, time.monotonic(), poll_s=0.1, endpoint=self.endpoint_url)
        return self

    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status > 0
        except OSError:
            return False
        finally:
            conn.close()

    @property
    def client_kwargs(self) -> dict[str, str]:
        """What ``boto3.client("s3", **kwargs)`` needs to reach this store (also useful for service config)."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def client(self, **config: object) -> BaseClient:
        """A boto3 S3 client for this store: path-style addressing (no DNS for bucket names on 127.0.0.1).

        ``config`` goes to ``botocore.config.Config`` (e.g. ``retries``, ``connect_timeout``).
        """
        import boto3
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, **config)
        return boto3.client("s3", config=cfg, **self.client_kwargs)

    def create_bucket(self, name: str) -> None:
        """Create a bucket; one that already exists (and is ours) is fine."""
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise


# --------------------------------------------------------------------------------------------------
# Schema Registry

# Apicurio Registry implements Confluent's Schema Registry API (under /apis/ccompat/v7). Maven Central serves
# its finished Quarkus application as a tarball; 3.x needs Java 21, the 2.6 line runs on Java 17.
APICURIO_VERSION = "3.3.3"
APICURIO_JAVA17_VERSION = "2.6.13.Final"
APICURIO_VERSION_ENV = "D3STREAM_APICURIO_VERSION"
_JVM_FOLDERS = (Path("/usr/lib/jvm"), Path("/usr/java"), Path("/opt/java"), Path("/Library/Java/JavaVirtualMachines"))


def _java_feature(java: Path) -> int | None:
    """The Java feature version (17, 21, 25) of a ``bin/java``, from the ``release`` file beside it, else from
    ``java -version``; None when it cannot be told."""
    home = java.resolve().parent.parent
    with contextlib.suppress(OSError):
        for line in (home / "release").read_text().splitlines():
            if line.startswith("JAVA_VERSION="):
                return _feature_of(line.split("=", 1)[1].strip().strip('"'))
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        if word.strip('"')[:1].isdigit():
            return _feature_of(word.strip('"'))
    return None


def _feature_of(version: str) -> int | None:
    head = version.split(".")
    with contextlib.suppress(ValueError):
        return int(head[1]) if head[0] == "1" and len(head) > 1 else int(head[0])
    return None


def java_installations() -> list[tuple[int, Path]]:
    """Every Java found: ``$JAVA_HOME``, ``java`` on PATH and the system's JVM folders; newest first."""
    candidates: list[Path] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    if shutil.which("java"):
        candidates.append(Path(str(shutil.which("java"))))
    for folder in _JVM_FOLDERS:
        with contextlib.suppress(OSError):
            candidates.extend(sorted(folder.glob("*/bin/java")) + sorted(folder.glob("*/Contents/Home/bin/java")))
    found: dict[Path, tuple[int, Path]] = {}
    for java in candidates:
        if java.is_file() and java.resolve() not in found:
            feature = _java_feature(java)
            if feature is not None:
                found[java.resolve()] = (feature, java)
    return sorted(found.values(), key=lambda each: -each[0])


def registry_java() -> tuple[Path, str]:
    """The ``java`` to run the registry with and the Apicurio version it can run: 3.x on Java 21 or newer,
    2.6 on Java 17 (``$D3STREAM_APICURIO_VERSION`` chooses one)."""
    installed = java_installations()
    wanted = os.environ.get(APICURIO_VERSION_ENV)
    choices = [(wanted, 21 if int(wanted.split(".")[0]) >= 3 else 17)] if wanted else [
        (APICURIO_VERSION, 21), (APICURIO_JAVA17_VERSION, 17)]
    for version, needs in choices:
        for feature, java in installed:
            if feature >= needs:
                return java, version
    needs = choices[0][1]
    seen = ", ".join(f"Java {feature} at {java}" for feature, java in installed) or "no Java at all"
    raise InfraError(
        f"the Schema Registry (Apicurio {wanted or APICURIO_VERSION}) needs Java {needs} or newer; found {seen}. "
        "Install a JDK 21 (e.g. apt install openjdk-21-jdk-headless, or Temurin into /usr/lib/jvm) or set "
        f"JAVA_HOME to one; with only Java 17, {APICURIO_VERSION_ENV}={APICURIO_JAVA17_VERSION} runs the older line"
    )


def ensure_registry(version: str, progress: bool = False) -> Path:
    """Fetch and unpack Apicurio Registry ``version`` from Maven Central once; the application's folder."""
    root = Path(os.environ.get("D3STREAM_CACHE") or Path.home() / ".cache" / "d3stream") / "apicurio" / version
    artifact = f"io.apicurio:apicurio-registry-app:{version}:tar.gz:all"

    def unpack(mvn: str, staging: Path) -> str:
        if progress:
            _notice(f"fetching the Schema Registry (Apicurio {version}) with Maven (once; its output goes to "
                    f"{root / 'maven.log'})")
        _maven(mvn, root, [f"{_DEPENDENCY_PLUGIN}:unpack", f"-Dartifact={artifact}",
                           f"-DoutputDirectory={staging}"], artifact)
        _runner_jar(staging)  # fail now if the tarball has no application in it
        return artifact + "\n"

    return _fetched_once(root, "app", "the Apicurio Schema Registry", unpack)


def _runner_jar(app: Path) -> Path:
    """The application's jar: ``quarkus-run.jar`` (3.x) or ``*-runner.jar`` (the 2.6 line's legacy layout)."""
    found = [app / "quarkus-run.jar"] if (app / "quarkus-run.jar").is_file() else sorted(app.glob("*-runner.jar"))
    if not found:
        raise InfraError(f"no quarkus-run.jar or *-runner.jar in {app}; delete {app.parent} to fetch it again")
    return found[0]


class SchemaRegistry(_LocalServer):
    """Apicurio Registry on 127.0.0.1, speaking Confluent's Schema Registry API at :attr:`url`.

    Its schemas live in an H2 database file in the work folder, so :meth:`stop`/:meth:`start` (a registry
    outage) brings back the same schema ids. Auth is off. Both of its ports (the API and Quarkus's
    management port, which would otherwise open 9000 on every interface) are bound to loopback.

    With ``tls`` (the server's certificate and key files, PEM, and the CA file that signs them) the API is
    served over HTTPS only, at an ``https://`` :attr:`url`, as a production registry behind TLS is.
    """

    event, label = "registry", "Schema Registry (Apicurio)"

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        port: int | None = None,
        heap: str = "384m",
        startup_timeout: float = 180.0,
        stop_grace: float = 15.0,
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        self.workdir, self._owns_workdir = _workdir(workdir, "d3stream-registry-")
        self._ports_picked = port is None
        picked = free_ports(3)
        self.port = port or picked[0]
        self.management_port, self._plain_port = picked[1], picked[2]
        self.tls = tls
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.log_path = self.workdir / "registry.log"
        self.java, self.version = registry_java()
        self.startup_seconds = None
        self._proc = None

    @property
    def url(self) -> str:
        """The Confluent-compatible API: what ``schema_registry_url`` and confluent-kafka's clients take."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/apis/ccompat/v7"

    def _pick_ports(self) -> None:
        self.port, self.management_port, self._plain_port = free_ports(3)

    def launch(self) -> Self:
        """Start the JVM without waiting for it (Quarkus takes seconds): start the other servers meanwhile, then
        :meth:`wait_ready`."""
        if self.running:
            return self
        app = ensure_registry(self.version)
        database = self.workdir / "registry-db"
        cmd = [
            str(self.java),
            f"-Xmx{self.heap}",
            "-Xms64m",
            *_jvm_options(),
            "-Djava.awt.headless=true",
            "-Dquarkus.http.host=127.0.0.1",
            *self._listener_options(),
            "-Dquarkus.management.host=127.0.0.1",
            f"-Dquarkus.management.port={self.management_port}",
            # A file database, so a restart keeps the ids (3.x and 2.6 name the setting differently).
            f"-Dapicurio.datasource.url=jdbc:h2:file:{database};DB_CLOSE_ON_EXIT=FALSE",
            f"-Dregistry.datasource.url=jdbc:h2:file:{database};DB_CLOSE_ON_EXIT=FALSE",
            "-Dquarkus.log.level=WARN",
            "-jar",
            str(_runner_jar(app)),
        ]
        self._launch(cmd, time.monotonic(), wait=False, url=self.url, version=self.version)
        return self

    def _listener_options(self) -> list[str]:
        """Plain HTTP on :attr:`port`; with ``tls``, HTTPS there and plain HTTP refused (on a port of its own)."""
        if self.tls is None:
            return [f"-Dquarkus.http.port={self.port}"]
        certificate, key, _ = self.tls
        return [f"-Dquarkus.http.port={self._plain_port}", f"-Dquarkus.http.ssl-port={self.port}",
                "-Dquarkus.http.insecure-requests=disabled",
                f"-Dquarkus.tls.key-store.pem.0.cert={certificate}", f"-Dquarkus.tls.key-store.pem.0.key={key}"]

    def _start(self) -> Self:
        if not self.running:
            self.launch()
        return self.wait_ready(url=self.url)

    def _ready(self) -> bool:
        conn = (http.client.HTTPSConnection("127.0.0.1", self.port, timeout=2,
                                            context=ssl.create_default_context(cafile=str(self.tls[2])))
                if self.tls else http.client.HTTPConnection("127.0.0.1", self.port, timeout=2))
        try:
            conn.request("GET", "/apis/ccompat/v7/subjects")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def pause(self) -> None:
        """SIGSTOP: the registry still holds its port but answers nothing (a hung registry)."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)


# --------------------------------------------------------------------------------------------------
# Both


@dataclass
class LocalStack:
    """The embedded servers of one run: a Kafka broker, an S3 store and (when asked for) a Schema Registry."""

    broker: KafkaBroker
    store: ObjectStore
    registry: SchemaRegistry | None = None


@contextlib.contextmanager
def embedded_stack(
    workdir: Path | None = None, partitions: int = 4, progress: bool = False, registry: bool = True
) -> Iterator[LocalStack]:
    """Start a Kafka broker, an S3 store and (with ``registry``) a Schema Registry; yield them; stop all three.

    With ``workdir`` the data lives in ``workdir/kafka``, ``workdir/s3`` and ``workdir/registry`` and is kept
    afterwards; without, temporary folders are deleted on exit. ``progress`` says so in one line when a
    one-time download runs (Maven's output goes to a log file). The registry's JVM starts first and comes up
    while the other two start, so it adds little to the wait.
    """
    ensure_jars(progress=progress)
    with contextlib.ExitStack() as stack:
        schemas: SchemaRegistry | None = None
        if registry:
            schemas = stack.enter_context(contextlib.closing(SchemaRegistry(workdir / "registry" if workdir else None)))
            ensure_registry(schemas.version, progress=progress)
            schemas.launch()
        store = stack.enter_context(ObjectStore(workdir / "s3" if workdir else None))
        broker = stack.enter_context(KafkaBroker(workdir / "kafka" if workdir else None, partitions=partitions))
        if schemas is not None:
            schemas.start()  # waits for the launched JVM (and relaunches on fresh ports if it lost one)
        yield LocalStack(broker, store, schemas)


@contextlib.contextmanager
def local_stack(
    workdir: Path | None = None, partitions: int = 4, progress: bool = False
) -> Iterator[tuple[KafkaBroker, ObjectStore]]:
    """A Kafka broker and an S3 store (no registry), as ``(broker, store)``: what the benchmarks use."""
    with embedded_stack(workdir, partitions, progress, registry=False) as stack:
        yield stack.broker, stack.store
