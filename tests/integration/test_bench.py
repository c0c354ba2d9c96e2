"""``d3stream bench``'s Kafka benchmarks (d3stream/benchmarks/bench_service.py) on the session's broker: the
raw-consumer and service runs side by side and the RSS soak report, their structure, never their speed."""

from __future__ import annotations


def test_kafka_overhead_runs_raw_and_service_side_by_side(kafka_broker, schema_registry, unique_name):
    """Every request answered once by each path, the Avro one through the registry too (the figures themselves
    are for the README, not asserted)."""
    import asyncio

    from d3stream.benchmarks.bench_service import kafka_markdown, kafka_overhead
    from d3stream.benchmarks.chaos import count_topic

    prefix = unique_name("kb")
    report = kafka_overhead(300, rounds=2, broker=kafka_broker, prefix=prefix, registry=schema_registry)
    for name in ("raw_at_least_once", "d3stream_at_least_once", "raw_transactional", "d3stream_exactly_once"):
        assert report[name]["events_per_s"] > 0, name
    assert report["at_least_once_ratio"] > 0 and report["exactly_once_ratio"] > 0
    assert report["at_least_once_median_ratio"] > 0 and report["exactly_once_median_ratio"] > 0
    answers = asyncio.run(count_topic(kafka_broker.bootstrap_servers, report["topics"]["answers"]))
    # at_least_once and exactly_once each answered all 300 in each of the 2 rounds (clean runs: no duplicates)
    assert sorted(a["id"] for a in answers) == sorted([f"bench-0-{n:07d}" for n in range(300)] * 4)
    assert all(len(report["by_round"][name]) == 2 for name in report["by_round"])
    assert all("error" not in a for a in answers)
    raw = asyncio.run(count_topic(kafka_broker.bootstrap_servers, report["topics"]["raw-out"]))
    assert len(raw) == 1200  # the warm-up passes write elsewhere (both loops')
    assert "exactly_once ÷ raw transactional" in kafka_markdown(report)
    assert report["d3stream_exactly_once_avro"]["events_per_s"] > 0 and report["registry_ratio"] > 0
    framed = asyncio.run(_values(kafka_broker.bootstrap_servers, report["topics"]["answers-avro"]))
    assert len(framed) == 600 and all(value[:1] == b"\x00" for value in framed)  # 300 in each round, as Avro
    assert "Avro through the registry" in kafka_markdown(report)


async def _values(bootstrap, topic):
    from tests.support.stream_helpers import Reader

    async with Reader(bootstrap, topic) as reader:
        await reader.caught_up()
        return [record.value for record in reader.records]


def test_rss_soak_reports_samples_and_a_verdict(kafka_broker, unique_name, qwen35_text_model):
    from d3stream.benchmarks.bench_service import rss_soak

    report = rss_soak(qwen35_text_model, 400, chunk=100, threads=None, broker=kafka_broker, prefix=unique_name("soak"))
    assert report["requests"] == 400 and report["samples"][-1][0] == 400
    assert len(report["samples"]) >= 4 and report["rss_mb_at_end"] > 100
    assert isinstance(report["flat_within_5pct"], bool)
