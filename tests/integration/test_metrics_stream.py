"""The metrics endpoint scraped during a real stream: the counters an operator watches move."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from d3stream_client.publisher import produce

from d3stream.ops.metrics import Metrics, MetricsServer
from d3stream.service import Service
from d3stream.settings import Settings
from tests.support.stream_helpers import scrape


def status(url: str, path: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_during_a_real_stream(kafka_broker, topic_names, qwen35_text_model):
    requests_topic, answers_topic = topic_names("m-req"), topic_names("m-out")
    kafka_broker.create_topic(requests_topic, partitions=2)
    good = [
        (f"m{n}".encode(), json.dumps({"id": f"m{n}", "state": f"s{n}", "questions": {"q": {"type": "noul"}}}).encode())
        for n in range(20)
    ]
    bad = [(b"broken", b"\x00 not json")]
    asyncio.run(produce(kafka_broker.bootstrap_servers, requests_topic, good + bad))
    settings = Settings.from_flat(
        bootstrap_servers=kafka_broker.bootstrap_servers,
        request_topics=[requests_topic],
        answer_topic=answers_topic,
        dead_letter_topic=f"{answers_topic}-dlq",
        provenance_topic=f"{answers_topic}-prov",
        group_id=topic_names("m-group"),
        commit_interval_ms=100,
        metrics_port=None,
    )
    metrics = Metrics()
    server = MetricsServer(metrics, host="127.0.0.1", port=0)
    server.start()
    url = server.url
    try:
        assert status(url, "/healthz") == 200
        assert status(url, "/readyz") == 503  # no consumer yet

        async def run() -> tuple[int, dict]:
            service = Service(settings, qwen35_text_model, metrics=metrics)
            task = asyncio.create_task(service.run())
            ready = 503
            while service.counts["answered"] + service.counts["errors"] < len(good) + len(bad):
                await asyncio.sleep(0.05)
                if ready != 200:
                    ready = await asyncio.to_thread(status, url, "/readyz")
            # Commits follow answers every commit interval (100 ms); a loaded machine may take longer.
            for _ in range(100):
                await asyncio.sleep(0.1)
                during = await asyncio.to_thread(scrape, url)
                if value(during, "d3stream_commits_total") >= 1:
                    break
            service.stop()
            await task
            return ready, during

        ready, during = asyncio.run(run())
        assert ready == 200
        assert value(during, "d3stream_answers_total", code="ok") == 20
        assert value(during, "d3stream_answers_total", code="undecodable_event") == 1
        assert value(during, "d3stream_dead_letters_total") == 1
        assert value(during, "d3stream_stage_seconds_count", stage="forward") == 20
        assert value(during, "d3stream_stage_seconds_count", stage="end_to_end") == 21
        assert value(during, "d3stream_pass_rows_sum") == 20  # one row per noul question
        assert value(during, "d3stream_pass_padded_tokens_sum") >= value(during, "d3stream_pass_real_tokens_sum") > 0
        assert value(during, "d3stream_commits_total") >= 1
        assert value(during, "d3stream_requests_in_flight") == 0
        info = [key for key in during if key[0] == "d3stream_model_info"]
        assert info and dict(info[0][1])["name"] == qwen35_text_model.model_name
        kernels = {dict(labels)["op"]: dict(labels)["implementation"] for name, labels in during
                   if name == "d3stream_kernel_info"}
        assert kernels["path"] == qwen35_text_model.kernel_record()["path"]  # the served model's kernels
        assert status(url, "/readyz") == 503  # stopped
    finally:
        server.stop()
