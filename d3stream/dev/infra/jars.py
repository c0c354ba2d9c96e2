"""The Maven jars of the Kafka broker and S3Proxy, and the ``java`` that runs every server.

The jars are the ones listed in ``d3stream/dev/jvm/pom.xml``, taken from Maven Central -- no tarball
download, no Docker.

Requirements: ``java`` (17+) and, the first time only, ``mvn`` plus network access to Maven Central.
:func:`ensure_jars` resolves the jars once into ``$D3STREAM_CACHE`` (default ``~/.cache/d3stream/jvm``),
in a sub-folder named after the pom's hash, so editing a version in the pom re-resolves by itself.

Tool output never goes to the terminal: Maven writes to ``maven.log`` in that sub-folder, each server to
its own log file, and an :class:`InfraError` carries the log's path and tail when a step fails -- a run
that works reads clean, one that does not says where to look.

The fetch-once machinery (``_fetched_once``, ``_maven``) is shared with the Schema Registry's module, which
fetches Apicurio's tarball through Maven the same way. This module imports nothing heavy (no torch, no
aiokafka): tests/conftest.py reads :data:`JVM_OPTIONS_ENV` through the package before torch loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from d3stream.dev.infra.processes import InfraError, _tail

log = structlog.get_logger(__name__)

# d3stream/dev/jvm, beside this package: two parents up from this file.
POM_PATH = Path(__file__).parent.parent / "jvm" / "pom.xml"
"""The Maven pom naming the Kafka and S3Proxy jars (a data file; ``d3stream/dev/jvm`` is not a package)."""


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
