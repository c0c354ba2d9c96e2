"""What every Kafka client of this package shares: starting cleanly, and where a key's record lands.

Answers are keyed by request id and the worker's producer places them with the Java client's default
partitioner: murmur2 of the key, modulo the answer topic's partition count. :func:`partition_for` is that
rule (aiokafka's own murmur2), so a caller can read the one answer partition its request's answer will be
written to.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiokafka.partitioner import murmur2


class Startable(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def start_client(client: Startable) -> None:
    """Start an aiokafka client; one that cannot connect is closed before the error goes on (so no
    unclosed-client warning follows the real error)."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


def partition_for(key: bytes, partitions: int) -> int:
    """The partition the Java default partitioner (and aiokafka's) gives a keyed record."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def without(options: dict[str, Any], *names: str) -> dict[str, Any]:
    """``options`` less the keyword arguments this package sets itself."""
    return {name: value for name, value in options.items() if name not in names}
