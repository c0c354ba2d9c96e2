"""Backpressure without a broker (d3stream/kafka/consume.py): at the in-flight limits only the partitions holding
their share are paused, up to the reserve."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(240)


def test_backpressure_pauses_the_flooded_partitions_and_keeps_a_light_one_flowing_up_to_the_reserve():
    """At the limits, a partition holding its share of max_inflight_requests is paused, one below it is still
    read (a light interactive stream beside a flood), until the work passes the limits by RESERVE: then all."""
    from d3stream.kafka.consume import RESERVE, backpressure_pauses

    flood_and_light = {"flood-0": 150, "flood-1": 104, "light": 2}  # share: 256 / 3 partitions
    assert backpressure_pauses(flood_and_light, 256, 20_000, 256, 262_144) == {"flood-0", "flood-1"}
    over = int(256 * (1 + RESERVE))
    assert backpressure_pauses({**flood_and_light, "light": 30}, over, 20_000, 256, 262_144) == set(flood_and_light)
    assert backpressure_pauses(flood_and_light, 256, 300_000, 256, 262_144) == set(flood_and_light)  # tokens too
    assert backpressure_pauses({"only": 256}, 256, 0, 256, 262_144) == {"only"}  # one partition: as before


def test_a_worker_lets_the_broker_hold_an_empty_fetch_briefly_so_resumed_partitions_are_read_soon():
    """A consumer has one fetch in flight per broker: partitions resumed from backpressure wait for the fetch that
    is waiting on a caught-up partition. The worker's consumer lets the broker hold such a fetch FETCH_MAX_WAIT_MS,
    not aiokafka's 500 ms (which outlasted the work in flight: bench kafka stood idle for a seventh of a run), and
    ``kafka_options`` ``fetch_max_wait_ms=...`` sets another."""
    import asyncio

    from d3stream.kafka.connection import accepted_parameters
    from d3stream.kafka.consume import FETCH_MAX_WAIT_MS, group_consumer
    from d3stream.settings import load_settings

    assert FETCH_MAX_WAIT_MS <= 100 < int(accepted_parameters()["consumer"]["fetch_max_wait_ms"])  # aiokafka's: 500

    async def waits(options: list[str]) -> int:
        settings = load_settings({"bootstrap_servers": "127.0.0.1:1", "kafka_options": options}, environ={})
        consumer = group_consumer(settings.connection, settings.delivery)
        try:
            return int(consumer._fetch_max_wait_ms)  # never started: no broker is asked
        finally:
            await consumer.stop()

    assert asyncio.run(waits([])) == FETCH_MAX_WAIT_MS
    assert asyncio.run(waits(["fetch_max_wait_ms=250"])) == 250
