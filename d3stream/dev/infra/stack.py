"""The servers together: a Kafka broker, an S3 store and (when asked for) a Schema Registry, started as one.

What ``d3stream demo``, ``d3stream stack`` and the benchmarks start (the test session's fixtures start each
server on its own, tests/support/infra_fixtures.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from d3stream.dev.infra.jars import ensure_jars
from d3stream.dev.infra.kafka import KafkaBroker
from d3stream.dev.infra.object_store import ObjectStore
from d3stream.dev.infra.registry import SchemaRegistry, ensure_registry


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
