"""The Schema Registry: Apicurio Registry on 127.0.0.1, and the discovery of a Java that can run it.

Apicurio implements Confluent's Schema Registry API, so the service's registry code (d3stream/kafka/registry.py)
and confluent-kafka's clients talk to it as to Confluent's. Apicurio is no jar in the pom: Maven Central serves
the finished Quarkus application as a tarball, fetched and unpacked once into ``$D3STREAM_CACHE/apicurio``
with the same Maven machinery as the jars. Its 3.x line needs Java 21 where Kafka and S3Proxy run on 17, so
this module looks beyond ``$JAVA_HOME`` and PATH for the newest Java installed (:func:`java_installations`)
and falls back to the 2.6 line on a machine with Java 17 only (:func:`registry_java`).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Self

from d3stream.dev.infra.class_data import server_archive
from d3stream.dev.infra.jars import _DEPENDENCY_PLUGIN, _fetched_once, _jvm_options, _maven, _notice
from d3stream.dev.infra.processes import InfraError, _LocalServer, _workdir, free_ports

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
        runner = str(_runner_jar(app))
        archive = server_archive(f"registry-{self.version}", str(self.java), runner)
        cmd = [
            str(self.java),
            f"-Xmx{self.heap}",
            "-Xms64m",
            *_jvm_options(),
            *archive.options(),
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
            runner,
        ]
        self._launch(cmd, time.monotonic(), wait=False, on_exit=archive.exited, url=self.url,
                     version=self.version)
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
