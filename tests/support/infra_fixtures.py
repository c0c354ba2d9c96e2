"""Pytest plugin: real Kafka and S3 servers for the test session (see ``d3stream.dev.infra``).

Enable with ``pytest_plugins = ["tests.support.infra_fixtures"]`` in ``tests/conftest.py`` (or ``-p tests.support.infra_fixtures``).
The servers start lazily -- only when a test asks for a fixture -- once per session, and stop at its
end. Tests share them, so each test should use its own topic names, group ids and buckets; the
``topic_names``, ``unique_name`` and ``s3_bucket`` fixtures hand those out.

Without java (or, before the first jar download, without mvn) the fixtures skip with the reason, unless
``D3STREAM_REQUIRE_INFRA=1`` is set, in which case they fail (use that in CI so a broken setup cannot pass).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator

import pytest

from d3stream.dev.infra import (
    InfraError,
    KafkaBroker,
    ObjectStore,
    SchemaRegistry,
    java_available,
    registry_java,
)


def _require_infra() -> None:
    reason = java_available()
    if reason is None:
        return
    if os.environ.get("D3STREAM_REQUIRE_INFRA") == "1":
        pytest.fail(f"local Kafka/S3 stack unavailable: {reason}")
    pytest.skip(f"local Kafka/S3 stack unavailable: {reason}")


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """One KRaft broker for the session (4 partitions per auto-created topic). Tests may ``restart()`` it."""
    _require_infra()
    with KafkaBroker() as broker:
        yield broker


@pytest.fixture(scope="session")
def object_store() -> Iterator[ObjectStore]:
    """One S3Proxy for the session. Tests may ``stop()``/``start()`` it; data and port survive."""
    _require_infra()
    with ObjectStore() as store:
        yield store


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[SchemaRegistry]:
    """One Apicurio Schema Registry for the session (Confluent's API at ``.url``). Tests may ``stop()``/``start()``
    it (its schemas survive) or ``pause()``/``resume()`` it."""
    _require_infra()
    try:
        registry_java()
    except InfraError as exc:
        if os.environ.get("D3STREAM_REQUIRE_INFRA") == "1":
            pytest.fail(f"Schema Registry unavailable: {exc}")
        pytest.skip(f"Schema Registry unavailable: {exc}")
    with SchemaRegistry() as registry:
        yield registry


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """``unique_name(prefix)`` -> a name no other test (or call) gets, readable in broker logs.

    Lower-case ``[a-z0-9-]`` so it is valid as a Kafka topic, a consumer group id and an S3 bucket name.
    """
    test = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:30].strip("-") or "t"

    def make(prefix: str = "t") -> str:
        clean = re.sub(r"[^a-z0-9]+", "-", prefix.lower()).strip("-") or "t"
        return f"{clean}-{test}-{uuid.uuid4().hex[:8]}"[:63].strip("-")

    return make


@pytest.fixture
def topic_names(unique_name: Callable[[str], str]) -> Callable[[str], str]:
    """``topic_names(prefix="topic")`` -> a fresh topic name for this test (not created)."""

    def make(prefix: str = "topic") -> str:
        return unique_name(prefix)

    return make


@pytest.fixture
def s3_bucket(object_store: ObjectStore, unique_name: Callable[[str], str]) -> str:
    """A freshly created, empty bucket for this test."""
    name = unique_name("bkt")
    object_store.create_bucket(name)
    return name
