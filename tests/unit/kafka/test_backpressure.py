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
