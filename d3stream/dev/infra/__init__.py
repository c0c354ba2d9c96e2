"""Real local servers for tests and ``d3stream demo``: an Apache Kafka broker and an S3-compatible store.

Why real servers rather than mocks: the service's correctness rests on broker behaviour that fakes do not
reproduce (transactions and ``read_committed``, consumer-group rebalances, a broker restarting under a
running consumer, S3 ETags and range reads). So tests start the actual programs:

* **Kafka** 4.x in KRaft mode (one JVM acting as broker and controller), built from the Maven Central jars
  listed in ``d3stream/dev/jvm/pom.xml`` -- no tarball download, no Docker.
* **S3Proxy** (same pom, its self-contained jar) with the jclouds ``filesystem`` backend, so objects are
  ordinary files in a temporary folder and survive a stop/start of the server.
* **Apicurio Registry** (Confluent's Schema Registry API), when a test or the demo asks for one.

One module per concern, each saying more of its own: ``jars`` (the pom's jars from Maven Central, once, and
the ``java`` that runs them), ``class_data`` (archives of the servers' classes, so the suite's many starts are
cheaper), ``processes`` (each server a child process with its ports, its log and its
start/stop/restart), ``kafka`` (the broker), ``object_store`` (S3Proxy), ``registry`` (Apicurio, and finding
a Java new enough for it) and ``stack`` (all of them started together). Import from here: the names below
are the package's interface, what the demo, the CLI, the benchmarks and the tests use.

Importing this package imports only the standard library and structlog (aiokafka and boto3 are imported where a
server is probed or a client made): tests/conftest.py reads :data:`JVM_OPTIONS_ENV` (and ``class_data``'s
``ARCHIVES_ENV``) from it before torch loads.
"""

from d3stream.dev.infra.jars import JVM_OPTIONS_ENV, POM_PATH, ensure_jars, java_available
from d3stream.dev.infra.kafka import KafkaBroker, kafka_properties
from d3stream.dev.infra.object_store import ObjectStore
from d3stream.dev.infra.processes import InfraError, PortTaken, free_ports
from d3stream.dev.infra.registry import (
    APICURIO_JAVA17_VERSION,
    APICURIO_VERSION,
    APICURIO_VERSION_ENV,
    SchemaRegistry,
    ensure_registry,
    java_installations,
    registry_java,
)
from d3stream.dev.infra.stack import LocalStack, embedded_stack, local_stack

__all__ = [
    "APICURIO_JAVA17_VERSION",
    "APICURIO_VERSION",
    "APICURIO_VERSION_ENV",
    "JVM_OPTIONS_ENV",
    "POM_PATH",
    "InfraError",
    "KafkaBroker",
    "LocalStack",
    "ObjectStore",
    "PortTaken",
    "SchemaRegistry",
    "embedded_stack",
    "ensure_jars",
    "ensure_registry",
    "free_ports",
    "java_available",
    "java_installations",
    "kafka_properties",
    "local_stack",
    "registry_java",
]
