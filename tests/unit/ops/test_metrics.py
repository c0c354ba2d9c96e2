"""The metrics endpoint: real HTTP on a free port, probes, and counters that move when the service counts."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

import d3stream
from d3stream.core.batching import PassRecord
from d3stream.ops.metrics import ERROR_CODES, STAGES, Metrics, MetricsPortTaken, MetricsServer, serve_metrics
from d3stream.settings import Settings
from tests.support.stream_helpers import scrape


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _value(samples: dict, metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


@pytest.fixture
def state() -> dict[str, bool]:
    return {"ready": False}


@pytest.fixture
def served(state: dict[str, bool]):
    metrics = Metrics(ready=lambda: state["ready"])
    server = MetricsServer(metrics, host="127.0.0.1", port=0)
    port = server.start()
    assert port > 0 and port == server.port
    yield metrics, server
    server.stop()


def test_health_and_readiness(served, state) -> None:
    _, server = served
    assert _status(server.url + "/healthz") == 200
    assert _status(server.url + "/readyz") == 503
    assert _value(scrape(server.url), "d3stream_ready") == 0
    state["ready"] = True
    assert _status(server.url + "/readyz") == 200
    assert _status(server.url + "/healthz") == 200
    assert _value(scrape(server.url), "d3stream_ready") == 1
    state["ready"] = False  # shutting down: no longer ready, still alive
    assert _status(server.url + "/readyz") == 503
    assert _status(server.url + "/healthz") == 200
    assert _status(server.url + "/nowhere") == 404


def test_a_failing_readiness_check_is_not_ready() -> None:
    def broken() -> bool:
        raise RuntimeError("no service yet")

    metrics = Metrics(ready=broken)
    assert metrics.is_ready() is False
    metrics.set_ready_check(lambda: True)
    assert metrics.is_ready() is True
    assert Metrics().is_ready() is False  # no check: not ready


def test_a_watched_task_that_dies_makes_the_worker_not_ready_naming_it(served, state) -> None:
    """A background task that dies of an exception: logged with its traceback, 503 on /readyz naming it, for
    good; one that ends, or is cancelled (how the worker stops its tasks), changes nothing."""
    metrics, server = served
    state["ready"] = True

    async def fine() -> None:
        return None

    async def forever() -> None:
        await asyncio.sleep(3600)

    async def dies(n: int) -> None:
        raise RuntimeError(f"simulated fault {n}")

    async def go() -> None:
        ended, cancelled = asyncio.ensure_future(fine()), asyncio.ensure_future(forever())
        metrics.watch(ended, "a task that ends")
        metrics.watch(cancelled, "a task that is cancelled")
        await ended
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert metrics.is_ready() and metrics.why_not_ready() is None
        for n in range(5):
            task = asyncio.ensure_future(dies(n))
            metrics.watch(task, f"task {n}")
            await asyncio.gather(task, return_exceptions=True)

    with capture_logs() as logs:
        asyncio.run(go())
    assert metrics.is_ready() is False and metrics.tasks_died == 5
    assert _status(server.url + "/readyz") == 503
    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as response:
        assert response.status == 200  # alive: a restart is the operator's call, the log says why
    why = metrics.why_not_ready()
    assert why == ("background task died: task 0 (RuntimeError: simulated fault 0); task 1 (RuntimeError: "
                   "simulated fault 1); task 2 (RuntimeError: simulated fault 2) (and 2 more)")
    died = [entry for entry in logs if entry["event"] == "background task died; the worker is not ready"]
    assert [entry["task"] for entry in died] == [f"task {n}" for n in range(5)]
    assert all(isinstance(entry["exc_info"], RuntimeError) for entry in died)  # rendered as its traceback
    assert _value(scrape(server.url), "d3stream_ready") == 0


def test_counters_move(served) -> None:
    metrics, server = served
    before = scrape(server.url)
    assert _value(before, "d3stream_answers_total", code="ok") == 0
    for code in ERROR_CODES:  # pre-created, so rate() works from the first error on
        assert _value(before, "d3stream_answers_total", code=code) == 0
    for stage in STAGES:
        assert _value(before, "d3stream_stage_seconds_count", stage=stage) == 0
    assert _value(before, "d3stream_build_info", version=d3stream.__version__) == 1

    metrics.set_read_lag("d3.requests", 3, 42)
    metrics.set_read_lag("d3.requests", 4, -1)  # a racy negative reads as zero
    metrics.set_in_flight(requests=7, questions=19, tokens=5000)
    metrics.set_paused(True)
    metrics.observe_pass(rows=8, real_tokens=900, padded_tokens=1024, seconds=0.25)
    metrics.observe_pass_record(PassRecord(rows=2, real_tokens=100, padded_tokens=128, seconds=0.05))
    metrics.observe_stage("fetch", 0.012)
    metrics.observe_stage("forward", 0.3)
    metrics.observe_stage("end_to_end", 0.5)
    metrics.count_answer(None)
    metrics.count_answer(None)
    metrics.count_answer("ok")
    metrics.count_answer("media_missing")
    metrics.count_dead_letter()
    metrics.count_publish_retry("d3.answers")
    metrics.add_media_bytes(48_211)
    metrics.add_media_bytes(0)
    metrics.count_media_cache(hit=True)
    metrics.count_media_cache(hit=False)
    metrics.count_media_cache(hit=False)
    metrics.count_commit()
    metrics.count_commit(ok=False)
    metrics.count_transaction_abort()
    metrics.set_model("d3-tiny", "9f2c" * 16, "cuda:0")

    after = scrape(server.url)
    assert _value(after, "d3stream_consumer_read_lag", topic="d3.requests", partition="3") == 42
    assert _value(after, "d3stream_consumer_read_lag", topic="d3.requests", partition="4") == 0
    assert _value(after, "d3stream_requests_in_flight") == 7
    assert _value(after, "d3stream_questions_in_flight") == 19
    assert _value(after, "d3stream_tokens_in_flight") == 5000
    assert _value(after, "d3stream_partitions_paused") == 1
    assert _value(after, "d3stream_pass_rows_count") == 2
    assert _value(after, "d3stream_pass_rows_sum") == 10
    assert _value(after, "d3stream_pass_real_tokens_sum") == 1000
    assert _value(after, "d3stream_pass_padded_tokens_sum") == 1152
    assert _value(after, "d3stream_pass_padded_tokens_bucket", le="1024.0") == 2
    assert _value(after, "d3stream_pass_seconds_sum") == pytest.approx(0.3)
    assert _value(after, "d3stream_last_pass_rows") == 2
    assert _value(after, "d3stream_last_pass_real_tokens") == 100
    assert _value(after, "d3stream_last_pass_padded_tokens") == 128
    assert _value(after, "d3stream_last_pass_seconds") == pytest.approx(0.05)
    assert _value(after, "d3stream_stage_seconds_count", stage="fetch") == 1
    assert _value(after, "d3stream_stage_seconds_sum", stage="forward") == pytest.approx(0.3)
    assert _value(after, "d3stream_stage_seconds_bucket", stage="end_to_end", le="0.5") == 1
    assert _value(after, "d3stream_stage_seconds_bucket", stage="end_to_end", le="0.25") == 0
    assert _value(after, "d3stream_answers_total", code="ok") == 3
    assert _value(after, "d3stream_answers_total", code="media_missing") == 1
    assert _value(after, "d3stream_dead_letters_total") == 1
    assert _value(after, "d3stream_publish_retries_total", topic="d3.answers") == 1
    assert _value(after, "d3stream_media_fetched_bytes_total") == 48_211
    assert _value(after, "d3stream_media_cache_lookups_total", result="hit") == 1
    assert _value(after, "d3stream_media_cache_lookups_total", result="miss") == 2
    assert _value(after, "d3stream_commits_total") == 1
    assert _value(after, "d3stream_commit_failures_total") == 1
    assert _value(after, "d3stream_transaction_aborts_total") == 1
    assert _value(after, "d3stream_model_info", name="d3-tiny", provenance_sha256="9f2c" * 16, device="cuda:0") == 1

    metrics.forget_partitions([("d3.requests", 3), ("d3.requests", 99)])  # 99 was never seen: no error
    gone = scrape(server.url)
    assert ("d3stream_consumer_read_lag", (("partition", "3"), ("topic", "d3.requests"))) not in gone
    assert _value(gone, "d3stream_consumer_read_lag", topic="d3.requests", partition="4") == 0


def test_metrics_are_documented_and_prefixed(served) -> None:
    _, server = served
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    assert families
    for family in families:
        assert family.name.startswith("d3stream_"), family.name
        assert len(family.documentation) > 20, f"{family.name} needs a HELP text an operator can act on"


def test_kernels_are_published_and_replaced(served) -> None:
    """``set_kernels`` shows which Gated DeltaNet kernels run, one series per op; a second call (another
    model loaded) replaces the first call's series instead of leaving stale ones beside them."""
    metrics, server = served
    metrics.set_kernels({"path": "mixed", "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
                         "causal_conv1d_fn": "torch-reference"})
    first = scrape(server.url)
    assert _value(first, "d3stream_kernel_info", op="path", implementation="mixed") == 1
    assert _value(first, "d3stream_kernel_info", op="causal_conv1d_fn", implementation="torch-reference") == 1
    assert _value(
        first, "d3stream_kernel_info", op="torch_chunk_gated_delta_rule",
        implementation="fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
    ) == 1
    metrics.set_kernels({"path": "reference", "torch_chunk_gated_delta_rule": "torch-reference"})
    second = scrape(server.url)
    kernel_series = {labels for name, labels in second if name == "d3stream_kernel_info"}
    assert kernel_series == {
        (("implementation", "reference"), ("op", "path")),
        (("implementation", "torch-reference"), ("op", "torch_chunk_gated_delta_rule")),
    }


def test_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown stage"):
        Metrics().observe_stage("fetc", 0.1)


def test_registries_are_private() -> None:
    """Several Metrics in one process (tests, embedded workers) never collide or leak into the default."""
    first, second = Metrics(), Metrics()
    first.count_answer(None)
    assert first.registry is not second.registry
    assert first.registry.get_sample_value("d3stream_answers_total", {"code": "ok"}) == 1
    assert second.registry.get_sample_value("d3stream_answers_total", {"code": "ok"}) == 0
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("d3stream_answers_total", {"code": "ok"}) is None
    shared = CollectorRegistry()
    assert Metrics(registry=shared).registry is shared


def test_two_servers_and_concurrent_scrapes() -> None:
    servers = [MetricsServer(Metrics(ready=lambda: True), host="127.0.0.1", port=0) for _ in range(2)]
    try:
        ports = {server.start() for server in servers}
        assert len(ports) == 2
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda s=s: results.append(_status(s.url + "/metrics")))
            for s in servers
            for _ in range(5)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert results == [200] * 10
    finally:
        for server in servers:
            server.stop()


def test_stop_releases_the_port() -> None:
    server = MetricsServer(Metrics(), host="127.0.0.1", port=0)
    port = server.start()
    assert server.start() == port  # idempotent
    server.stop()
    server.stop()  # idempotent
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free again
    with pytest.raises(RuntimeError):
        _ = server.port


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsPortTaken, match=f"port {port} on 127.0.0.1 is taken") as taken_error:
            MetricsServer(Metrics(), host="127.0.0.1", port=port).start()
    assert isinstance(taken_error.value, OSError)  # what a caller catching the bind's own error still catches
    assert "--metrics-port" in str(taken_error.value) and "[Errno" not in str(taken_error.value)


def test_serve_metrics_follows_the_settings() -> None:
    assert serve_metrics(Metrics(), Settings.from_flat(metrics_port=None).observability) is None
    server = serve_metrics(Metrics(), Settings.from_flat(metrics_port=0, metrics_host="127.0.0.1").observability)
    assert server is not None
    try:
        assert _status(server.url + "/healthz") == 200
    finally:
        server.stop()


def test_a_shadow_that_disagrees_from_the_start_has_an_agreement_of_zero_not_none():
    """The agreement alert divides agreements by compared questions: both series exist from the first one."""
    metrics = Metrics()
    metrics.count_shadow_question("live-a", "shadow-b", "choice", agree=False, abs_dps=[0.4, 0.4])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    labels = (("live", "live-a"), ("shadow", "shadow-b"), ("type", "choice"))
    assert samples[("d3stream_shadow_agreements_total", labels)] == 0
    assert samples[("d3stream_shadow_questions_total", tuple(sorted((*labels, ("outcome", "compared")))))] == 1



# ------------------------------------------------------------------------------------------ metrics


def test_the_metrics_endpoint_listens_on_the_loopback_address_by_default():
    assert Settings().observability.metrics_host == "127.0.0.1"
    server = serve_metrics(Metrics(), Settings.from_flat(metrics_port=0).observability)
    try:
        assert server._httpd.server_address[0] == "127.0.0.1"
    finally:
        server.stop()
