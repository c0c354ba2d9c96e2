"""The delivery-cost pacer of ``d3stream chaos`` (``d3stream.benchmarks.chaos.publish_paced``) on the real
broker: everything is published, a tick at a time."""


from __future__ import annotations

import asyncio
import json
import time

import pytest

from d3stream.benchmarks.chaos import count_topic

pytestmark = pytest.mark.timeout(300)


def test_the_delivery_cost_pacer_publishes_everything_a_tick_at_a_time(kafka_broker, topic_names):
    """``chaos.publish_paced`` (the paced stream of ``chaos --delivery-costs``): every record, in order, spread
    over ticks of a tenth of a second (25 records at 100/s: ticks at 0, 0.1 and 0.2 s)."""
    from d3stream.benchmarks.chaos import publish_paced

    topic = topic_names("paced")
    kafka_broker.create_topic(topic, 1)
    stream = [(f"k{n}".encode(), json.dumps({"id": f"p{n:02d}"}).encode()) for n in range(25)]
    started = time.monotonic()
    asyncio.run(publish_paced(kafka_broker.bootstrap_servers, topic, stream, rate=100))
    assert time.monotonic() - started >= 0.2
    records = asyncio.run(count_topic(kafka_broker.bootstrap_servers, topic))
    assert [r["id"] for r in records] == [f"p{n:02d}" for n in range(25)]
