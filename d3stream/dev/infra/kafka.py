"""The Kafka broker: Kafka 4.x in KRaft mode, one JVM acting as broker and controller, on 127.0.0.1.

Built from the Maven Central jars listed in ``d3stream/dev/jvm/pom.xml`` (:mod:`d3stream.dev.infra.jars`).
A real broker rather than a fake, because the service's correctness rests on what fakes do not reproduce:
transactions and ``read_committed``, consumer-group rebalances, a broker restarting under a running consumer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Self, TypeVar

import structlog

from d3stream.dev.infra.class_data import server_archive
from d3stream.dev.infra.jars import _java, _jvm_options, _kafka_classpath, ensure_jars
from d3stream.dev.infra.processes import (
    InfraError,
    _LocalServer,
    _port_open,
    _run_sync,
    _tail,
    _workdir,
    _write_properties,
    free_ports,
)

log = structlog.get_logger(__name__)

_T = TypeVar("_T")



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
        # A broker whose heartbeats to its own controller stop for the session timeout is fenced, and the only
        # broker fenced refuses everything ("All brokers are currently fenced"): 4 s was too short for a
        # loaded 2-core machine (the test suite, five JVMs starting at once: a load average of 47), and so was
        # 12 s once. The cost is after a crash (kill()), when the controller refuses the new incarnation until the
        # old one's session expires (DUPLICATE_BROKER_REGISTRATION): up to 30 s here; a clean stop deregisters
        # at once.
        "broker.heartbeat.interval.ms": "500",
        "broker.session.timeout.ms": "30000",
        "num.network.threads": "2",
        "num.io.threads": "4",
    }
    props.update(extra or {})
    return props


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
        ]
        archive = server_archive("kafka", java, classpath)
        started = time.monotonic()
        if not (self.data_dir / "meta.properties").is_file():
            self._format([*jvm, *archive.reuse_only(), "-cp", classpath], props_path)
        self._launch([*jvm, *archive.options(), "-cp", classpath, "kafka.Kafka", str(props_path)], started,
                     on_exit=archive.exited, bootstrap=self.bootstrap_servers)
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
            from d3stream.kafka.connection import raw_client

            admin = raw_client(
                "admin", bootstrap_servers=self.bootstrap_servers, request_timeout_ms=5000, **self.client_options
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
        from aiokafka.admin.new_topic import NewTopic
        from aiokafka.errors import for_code

        from d3stream.kafka.connection import raw_client

        count = partitions or self.partitions
        admin = raw_client("admin", bootstrap_servers=self.bootstrap_servers, **self.client_options)
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
