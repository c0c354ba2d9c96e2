"""Faults around the service, on the real broker and object store: the store down, failing or slow, and
a model whose forward passes fail.

Object-store faults go through ``tests/support/fault_proxy.py`` (a real HTTP proxy in front of S3Proxy), so each
test can also prove how many calls were made. Timeouts are small (connect 0.5 s, read 1 s, 2 attempts), so
a store that does not answer costs a request a few seconds, never the stream.

The stream helpers (``Stack``, ``Reader``, ``serve``) live in ``tests/support/stream_helpers.py``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.service import Service
from tests.support.fault_proxy import THREAD_PREFIX
from tests.support.media_makers import make_png
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    close_to,
    record,
    run,
    serve,
)

pytestmark = pytest.mark.timeout(240)

# Small object-store timeouts: a store that does not answer costs a request seconds, not minutes.
FAST_S3 = {"s3_connect_timeout": 0.5, "s3_read_timeout": 1.0, "s3_max_attempts": 2}


# =========================================================================================== helpers


def service_threads(baseline: set[threading.Thread], allow: tuple[str, ...] = ()) -> list[str]:
    """Threads alive now that were not before, other than the fault proxy's own and ``allow``ed prefixes."""
    return sorted(
        t.name for t in threading.enumerate()
        if t not in baseline and t.is_alive() and not t.name.startswith((THREAD_PREFIX, *allow))
    )


def assert_no_thread_leak(baseline: set[threading.Thread], settle_s: float = 5.0,
                          allow: tuple[str, ...] = ()) -> None:
    """After a service stopped: no thread of its own is left (given a moment to wind down), and the
    thread count is back to the baseline (within the ``allow``ed threads)."""
    deadline = time.monotonic() + settle_s
    while service_threads(baseline, allow) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = service_threads(baseline, allow)
    assert not left, f"threads left behind by a stopped service: {left}"
    proxy_threads = sum(1 for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t not in baseline)
    assert threading.active_count() - proxy_threads <= len(baseline) + len(allow), [
        t.name for t in threading.enumerate()
    ]


# ===================================================================================== the proxy itself


def test_fault_proxy_forwards_signed_requests_and_keeps_the_signature_check(stack, proxy):
    """SigV4 signs the Host header: forwarded verbatim, S3Proxy accepts the client's signature through the
    proxy -- and still refuses a wrong one (authorization stays on)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    stack.put("p/one.txt", b"one")
    config = Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"max_attempts": 0})
    good = boto3.client("s3", endpoint_url=proxy.endpoint_url, aws_access_key_id=stack.store.access_key,
                        aws_secret_access_key=stack.store.secret_key, region_name=stack.store.region, config=config)
    assert good.get_object(Bucket=stack.bucket, Key="p/one.txt")["Body"].read() == b"one"
    bad = boto3.client("s3", endpoint_url=proxy.endpoint_url, aws_access_key_id=stack.store.access_key,
                       aws_secret_access_key="not-the-secret", region_name=stack.store.region, config=config)
    with pytest.raises(ClientError) as refused:
        bad.head_object(Bucket=stack.bucket, Key="p/one.txt")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    proxy.fail_next(1, status=503, code="SlowDown")
    with pytest.raises(ClientError) as injected:
        good.head_object(Bucket=stack.bucket, Key="p/one.txt")
    assert injected.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert proxy.log == [("GET", stack.path("p/one.txt"))] + [("HEAD", stack.path("p/one.txt"))] * 2
    assert [e.status for e in proxy.entries] == [200, 403, 503]


# ================================================================================ object store faults


def _mixed(prefix: str, image_uri: str | None, texts: int, images: int) -> list[dict[str, Any]]:
    requests = [{"id": f"{prefix}-text-{n}", "state": f"{prefix} text {n}", "questions": {"noul": Q_NOUL}}
                for n in range(texts)]
    requests += [{"id": f"{prefix}-image-{n}", "state": f"{prefix} image {n}", "questions": {"noul": Q_NOUL},
                  "images": [image_uri]} for n in range(images)]
    return requests


def test_store_stopped_gives_media_unavailable_and_the_stream_flows(stack, proxy, qwen35_model):
    image = stack.put("img/a.png", make_png(48, 48, seed=31))
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, **FAST_S3)
    before = _mixed("before", image, 1, 1)
    during = _mixed("down", image, 6, 3)
    after = _mixed("after", image, 1, 1)
    baseline = set(threading.enumerate())

    async def outage(service: Service, reader: Reader, task: asyncio.Task) -> None:
        bootstrap = stack.broker.bootstrap_servers
        await reader.wait_ids([r["id"] for r in before], 60, task)
        await asyncio.to_thread(stack.store.stop)
        try:  # answered while the store is still down: it comes back only after
            await produce(bootstrap, stack.requests, [record(r) for r in during])
            await reader.wait_ids([r["id"] for r in during], 60, task)
        finally:
            await asyncio.to_thread(stack.store.start)
        await produce(bootstrap, stack.requests, [record(r) for r in after])

    everything = before + during + after
    service, reader = run(serve(stack, settings, qwen35_model, [record(r) for r in before],
                                [r["id"] for r in everything], during=outage))
    assert_no_thread_leak(baseline)
    counts = reader.counts()
    assert set(counts) == {r["id"] for r in everything} and max(counts.values()) == 1
    by_id = reader.by_id()
    for request in everything:
        answer = by_id[request["id"]]
        if request["id"].startswith("down-image"):
            assert answer["error"]["code"] == "media_unavailable", answer.get("error")
            assert "did not answer" in answer["error"]["message"]
        else:
            assert "error" not in answer, (request["id"], answer.get("error"))
            assert answer["answers"]["noul"]["type"] == "noul"


def test_store_500s_are_retried_a_bounded_number_of_times(stack, proxy, qwen35_model):
    png = make_png(48, 48, seed=32)
    flaky = stack.put("img/flaky.png", png)
    transient = stack.put("img/transient.png", png)
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, **FAST_S3)
    proxy.fail_next(1000, path=stack.path("img/flaky.png"))  # every call for this object fails
    proxy.fail_next(1, path=stack.path("img/transient.png"))  # one failure, then the store answers
    requests = _mixed("s500", None, 5, 0)
    requests.append({"id": "s500-flaky", "state": "flaky", "questions": {"noul": Q_NOUL}, "images": [flaky]})
    requests.append({"id": "s500-transient", "state": "transient", "questions": {"noul": Q_NOUL}, "images": [transient]})
    baseline = set(threading.enumerate())

    service, reader = run(serve(stack, settings, qwen35_model, [record(r) for r in requests],
                                [r["id"] for r in requests]))
    assert_no_thread_leak(baseline)
    by_id = reader.by_id()
    assert len(reader.records) == len(requests) == len(by_id)
    flaky_answer = by_id["s500-flaky"]
    assert flaky_answer["error"]["code"] == "media_unavailable"
    assert "object store error 500" in flaky_answer["error"]["message"]  # a HEAD error has no body: the status
    heads = proxy.requests("HEAD", stack.path("img/flaky.png"))
    assert len(heads) == settings.storage.s3_max_attempts, [e.status for e in heads]
    assert all(e.status == 500 for e in heads)
    assert not proxy.requests("GET", stack.path("img/flaky.png")), "no GET after a failed HEAD"
    # A single 500 is retried and the request is answered from the object.
    assert "error" not in by_id["s500-transient"], by_id["s500-transient"].get("error")
    assert [e.status for e in proxy.requests(None, stack.path("img/transient.png"))] == [500, 200, 200]
    assert by_id["s500-transient"]["provenance"]["media"][0]["bytes"] == len(png)
    for n in range(5):
        assert "error" not in by_id[f"s500-text-{n}"]


def test_s3_max_attempts_is_the_number_of_attempts(stack, proxy, qwen35_model):
    """s3_max_attempts counts every attempt, the first one included (botocore's max_attempts counts retries)."""
    flaky = stack.put("img/always-500.png", make_png(32, 32, seed=33))
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, **FAST_S3)
    proxy.fail_next(1000, path=stack.path("img/always-500.png"))
    requests = [{"id": "attempts", "state": "s", "questions": {"noul": Q_NOUL}, "images": [flaky]}]
    _, reader = run(serve(stack, settings, qwen35_model, [record(r) for r in requests], ["attempts"]))
    assert reader.by_id()["attempts"]["error"]["code"] == "media_unavailable"
    assert len(proxy.requests("HEAD", stack.path("img/always-500.png"))) == settings.storage.s3_max_attempts


def test_slow_store_times_out_per_request_while_other_partitions_flow(stack, proxy, qwen35_model):
    slow = stack.put("img/slow.png", make_png(48, 48, seed=34))
    settings = stack.settings(s3_endpoint_url=proxy.endpoint_url, **FAST_S3)
    proxy.delay(4.0, path=stack.path("img/slow.png"))  # every response for it: 4 s, over the 1 s read timeout
    requests = [{"id": "slow", "state": "slow", "questions": {"noul": Q_NOUL}, "images": [slow]}]
    requests += _mixed("fast", None, 12, 0)
    baseline = set(threading.enumerate())

    service, reader = run(serve(stack, settings, qwen35_model, [record(r) for r in requests],
                                [r["id"] for r in requests]))
    assert_no_thread_leak(baseline)
    by_id = reader.by_id()
    assert len(reader.records) == len(requests)
    answer = by_id["slow"]
    assert answer["error"]["code"] == "media_unavailable", answer.get("error")
    assert "ReadTimeout" in answer["error"]["message"], answer["error"]["message"]
    # Bounded: s3_max_attempts attempts, each cut at the read timeout, then given up -- not the many a
    # patient client would make.
    attempts = proxy.requests("HEAD", stack.path("img/slow.png"))
    assert len(attempts) == settings.storage.s3_max_attempts
    assert not proxy.requests("GET", stack.path("img/slow.png"))
    # The rest of the stream flowed meanwhile: requests on other partitions were answered before it.
    slow_partition = answer["source"]["partition"]
    others = [a for a in by_id.values() if a["id"] != "slow" and a["source"]["partition"] != slow_partition]
    assert others, "no request landed on another partition"
    assert all("error" not in a for a in others)
    early = [a["id"] for a in others if reader.seen_at[a["id"]] < reader.seen_at["slow"]]
    assert len(early) == len(others), f"answered only after the slow request: {sorted(set(a['id'] for a in others) - set(early))}"


def test_a_stopped_service_leaves_no_thread_behind(stack, qwen35_model):
    """Model, prepare and S3 threads all end with the service (the model thread once outlived it)."""
    image = stack.put("img/t.png", make_png(32, 32, seed=35))
    requests = [{"id": "threads", "state": "s", "questions": {"noul": Q_NOUL}, "images": [image]}]
    baseline = set(threading.enumerate())
    service, _ = run(serve(stack, stack.settings(), qwen35_model, [record(r) for r in requests], ["threads"]))
    assert service.counts["answered"] == 1
    assert_no_thread_leak(baseline, settle_s=2.0)


# ===================================================================================== model failure


MARKER = "ZQXJ-POISON"


class OomModel:
    """The real model, except its forward pass fails like a GPU out of memory: always for a pass of more
    than 2 rows, and for any pass holding a prompt with ``MARKER`` (a question too big even alone)."""

    def __init__(self, model: Any):
        self._model = model
        self.passes: list[tuple[int, str]] = []  # (rows, "ok" | "oom" | "marker")
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, rows):
        poisoned = any(MARKER in self._model.tokenizer.decode(row.ids) for row in rows)
        with self._lock:
            if poisoned:
                self.passes.append((len(rows), "marker"))
                raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (marker row)")
            if len(rows) > 2:
                self.passes.append((len(rows), "oom"))
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            self.passes.append((len(rows), "ok"))
        return self._model.forward(rows)


def test_oom_in_a_forward_pass_splits_the_batch_and_only_the_poisoned_question_fails(stack, qwen35_model):
    model = OomModel(qwen35_model)
    requests = [
        {"id": f"oom-{n}", "state": f"order {n}: " + "item " * n,
         "questions": {"noul": Q_NOUL, "route": Q_CHOICE, "level": Q_SCORE}}
        for n in range(5)
    ]
    requests.insert(2, {"id": "oom-poisoned", "state": "mixed",
                        "questions": {"ok": Q_NOUL, "bad": {"type": "noul", "instructions": f"Is {MARKER} set?"},
                                      "also": Q_SCORE}})
    # Everything arrives at once and lingers together, so the first passes are wide and fail.
    # The fault is injected into D3.forward, the full-prompt path: shared-prefix passes would not see it.
    settings = stack.settings(linger_ms=300, max_batch_rows=64, prefix_reuse="off")
    service, reader = run(serve(stack, settings, model, [record(r) for r in requests], [r["id"] for r in requests]))
    by_id = reader.by_id()
    assert len(reader.records) == len(requests) == len(by_id)
    kinds = collections.Counter(kind for _, kind in model.passes)
    assert kinds["oom"] >= 1, model.passes
    assert kinds["marker"] >= 1, model.passes
    assert all(rows <= 2 for rows, kind in model.passes if kind == "ok")
    poisoned = by_id["oom-poisoned"]
    assert "error" not in poisoned, poisoned.get("error")
    assert poisoned["answers"]["bad"]["error"] == "invalid_model_output"
    assert "CUDA out of memory" in poisoned["answers"]["bad"]["message"]
    want = qwen35_model.system_one(state="mixed", questions={"ok": Q_NOUL, "also": Q_SCORE})
    close_to({k: poisoned["answers"][k] for k in ("ok", "also")}, want["answers"], "oom-poisoned")
    for request in requests:
        if request["id"] == "oom-poisoned":
            continue
        answer = by_id[request["id"]]
        assert "error" not in answer, answer.get("error")
        want = qwen35_model.system_one(state=request["state"], questions=request["questions"])
        close_to(answer["answers"], want["answers"], request["id"])
    # The service went on: it is not stopped by the failures, and answered everything.
    assert service.counts["answered"] == len(requests) and service.counts["errors"] == 0
    # The marker row failed alone in the end (that is when its question was given up).
    assert (1, "marker") in model.passes
