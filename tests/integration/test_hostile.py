"""Hostile input on the real broker and store: hostile media, access control, secrets in logs, Kafka SASL/PLAIN
(fuzzed events: tests/unit/service/test_fuzzing.py).

* Hostile media through the real service (Kafka, S3 behind the fault proxy, strict loading): decompression
  bombs, truncated and corrupt files, a JPEG named ``.png``, videos with zero frames or absurd frame rates,
  objects over the limits (refused from HEAD: the proxy log shows no GET), an object replaced between HEAD
  and GET (``IfMatch`` fails with 412, one more look).
* Access: the allowlist is enforced before any request reaches S3 (the proxy log shows none for a
  disallowed bucket or prefix), ``http(s)`` URLs and local paths are refused, no secret reaches the logs.
* SASL/PLAIN: a second broker with a SASL_PLAINTEXT listener; answers flow with the right password, the
  wrong one is refused with a clear error in bounded time.
"""


from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import struct
import time
import zlib
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.service import Service
from d3stream.settings import Settings
from tests.support.media_makers import make_jpeg, make_mp4, make_png, make_png_header_only
from tests.support.stream_helpers import Q_NOUL, Reader, assigned_and_ready, free_port, record, run, serve

# Its module-scoped broker starts once on one pytest worker (xdist_group, make test's --dist loadgroup), not
# once on each worker that runs one of its tests: in a CI run three such JVMs started at once beside the others.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("sasl-broker")]


# ======================================================================================= hostile media


def png_zlib_bomb(width: int, height: int) -> bytes:
    """A complete, valid grayscale PNG of zeros: a few KB that decompress to width x height bytes."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def test_hostile_media_through_the_service(stack, proxy, qwen35_model):
    store = stack.store.client()
    png_a, png_b, png_c = make_png(40, 40, seed=41), make_png(56, 40, seed=42), make_png(40, 56, seed=43)
    jpeg = make_jpeg(48, 48, seed=44)
    corrupt = bytearray(make_png(48, 48, seed=45))
    corrupt[-20] ^= 0xFF  # inside IDAT: the CRC no longer matches
    objects = {
        "m/bomb-header.png": make_png_header_only(6000, 6000),
        "m/bomb-zlib.png": png_zlib_bomb(5000, 5000),  # 25 Mpx of zeros in ~25 KB, complete and valid
        "m/truncated.jpg": jpeg[: len(jpeg) // 3],
        "m/corrupt.png": bytes(corrupt),
        "m/random.png": bytes(range(256)) * 4,
        "m/photo.png": jpeg,  # a JPEG named .png: read by content, and it is a format that is accepted
        "m/image.mp4": png_a,  # a PNG as a video
        "m/zero-frames.mp4": make_mp4(0, 48, 48),
        "m/absurd-fps.mp4": make_mp4(8, 48, 48, fps=10_000),  # not believed: read as 24 fps
        "m/too-long.mp4": make_mp4(100, 32, 32, fps=0.2),  # 500 s
        "m/large.png": b"\x89PNG\r\n\x1a\n" + bytes(8_000_001),
        "m/large.mp4": b"\x00\x00\x00\x18ftypmp42" + bytes(32_000_001),
        "m/swap-once.png": png_a,
        "m/swap-always.png": png_a,
    }
    uri = {key: stack.put(key, data) for key, data in objects.items()}
    # Between HEAD and GET the object is replaced: once (the second look succeeds), or every time.
    proxy.after_head(stack.path("m/swap-once.png"), lambda: store.put_object(Bucket=stack.bucket,
                                                                              Key="m/swap-once.png", Body=png_b))
    swaps = iter([png_b, png_c] * 5)
    proxy.after_head(stack.path("m/swap-always.png"),
                     lambda: store.put_object(Bucket=stack.bucket, Key="m/swap-always.png", Body=next(swaps)), count=None)
    expected = {
        "bomb-header.png": "media_unreadable",
        "bomb-zlib.png": "media_unreadable",
        "truncated.jpg": "media_unreadable",
        "corrupt.png": "media_unreadable",
        "random.png": "media_unreadable",
        "photo.png": None,
        "image.mp4": "media_unreadable",
        "zero-frames.mp4": "media_unreadable",
        "absurd-fps.mp4": None,
        "too-long.mp4": "media_unreadable",
        "large.png": "media_too_large",
        "large.mp4": "media_too_large",
        "swap-once.png": None,
        "swap-always.png": "media_unavailable",
    }
    requests = []
    for name in expected:
        field = "videos" if name.endswith(".mp4") else "images"
        requests.append({"id": f"hm-{name}", "state": f"media {name}", "questions": {"noul": Q_NOUL},
                         field: [uri[f"m/{name}"]]})
    requests.append({"id": "hm-text", "state": "no media at all", "questions": {"noul": Q_NOUL}})
    settings_ = stack.settings(s3_endpoint_url=proxy.endpoint_url, s3_connect_timeout=1.0, s3_read_timeout=5.0,
                               s3_max_attempts=2, linger_ms=20)

    service, reader = run(serve(stack, settings_, qwen35_model, [record(r) for r in requests],
                                [r["id"] for r in requests], timeout=120))
    by_id = reader.by_id()
    assert collections.Counter(a["id"] for a in reader.answers()) == collections.Counter(r["id"] for r in requests)
    for name, code in expected.items():
        answer = by_id[f"hm-{name}"]
        got = (answer.get("error") or {}).get("code")
        assert got == code, (name, answer.get("error"))
    assert "error" not in by_id["hm-text"]
    # Oversized objects: refused from HEAD, never downloaded.
    for name in ("large.png", "large.mp4"):
        assert proxy.log.count(("HEAD", stack.path(f"m/{name}"))) == 1
        assert ("GET", stack.path(f"m/{name}")) not in proxy.log, f"{name} was downloaded"
        assert by_id[f"hm-{name}"]["provenance"]["media"] == []
    assert service.fetcher.bytes_fetched < 2_000_000
    # Pixel bombs: the claimed size is refused before any decoding.
    assert "pixels" in by_id["hm-bomb-zlib.png"]["error"]["message"]
    assert "pixels" in by_id["hm-bomb-header.png"]["error"]["message"]
    # The JPEG named .png is read as what it is.
    media = by_id["hm-photo.png"]["provenance"]["media"][0]
    assert media["sha256"] == hashlib.sha256(jpeg).hexdigest()
    # Replaced once between HEAD and GET: the GET's If-Match fails (412), one more look reads the new object.
    swap_once = [(e.method, e.status) for e in proxy.requests(None, stack.path("m/swap-once.png"))]
    assert swap_once == [("HEAD", 200), ("GET", 412), ("HEAD", 200), ("GET", 200)], swap_once
    media = by_id["hm-swap-once.png"]["provenance"]["media"][0]
    assert media["sha256"] == hashlib.sha256(png_b).hexdigest()
    assert media["etag"] == store.head_object(Bucket=stack.bucket, Key="m/swap-once.png")["ETag"].strip('"')
    expected_answer = qwen35_model.system_one(state="media swap-once.png", questions={"noul": Q_NOUL},
                                              images=[png_b], strict=True)
    assert abs(by_id["hm-swap-once.png"]["answers"]["noul"]["noul"] - expected_answer["answers"]["noul"]["noul"]) < 1e-2
    # Replaced at every look: two tries, then media_unavailable.
    swap_always = [(e.method, e.status) for e in proxy.requests(None, stack.path("m/swap-always.png"))]
    assert swap_always == [("HEAD", 200), ("GET", 412)] * 2, swap_always
    assert "kept changing" in by_id["hm-swap-always.png"]["error"]["message"]


# ============================================================================================= access


def test_allowlist_urls_and_paths_are_refused_before_any_request_to_s3(stack, proxy, qwen35_model):
    other = stack.unique("other")
    stack.store.create_bucket(other)
    png = make_png(40, 40, seed=46)
    stack.store.client().put_object(Bucket=other, Key="ok/x.png", Body=png)
    stack.put("secret/x.png", png)
    allowed = stack.put("ok/x.png", png)
    refused = {
        "other-bucket": f"s3://{other}/ok/x.png",
        "outside-prefix": f"s3://{stack.bucket}/secret/x.png",
        "prefix-lookalike": f"s3://{stack.bucket}/okay/x.png",
        "bucket-lookalike": f"s3://{stack.bucket}x/ok/x.png",
        "http": f"{proxy.endpoint_url}/{stack.bucket}/ok/x.png",
        "https": f"https://127.0.0.1:{proxy.port}/{stack.bucket}/ok/x.png",
        "path": "/etc/passwd",
        "relative": f"{stack.bucket}/ok/x.png",
        "file": "file:///etc/passwd",
        "no-key": f"s3://{stack.bucket}",
        "s3-host-port": f"s3://127.0.0.1:{proxy.port}/ok/x.png",
    }
    requests = [{"id": f"ac-{name}", "state": "s", "questions": {"noul": Q_NOUL}, "images": [reference]}
                for name, reference in refused.items()]
    requests.append({"id": "ac-video-http", "state": "s", "questions": {"noul": Q_NOUL},
                     "videos": [f"http://127.0.0.1:{proxy.port}/{stack.bucket}/ok/v.mp4"]})
    requests.append({"id": "ac-allowed", "state": "s", "questions": {"noul": Q_NOUL}, "images": [allowed]})
    settings_ = stack.settings(s3_endpoint_url=proxy.endpoint_url, media_allowlist=[f"{stack.bucket}/ok/"],
                               s3_max_attempts=1)

    _, reader = run(serve(stack, settings_, qwen35_model, [record(r) for r in requests], [r["id"] for r in requests]))
    by_id = reader.by_id()
    for request in requests:
        answer = by_id[request["id"]]
        if request["id"] == "ac-allowed":
            assert "error" not in answer, answer.get("error")
        else:
            assert answer["error"]["code"] == "media_not_allowed", (request["id"], answer["error"])
    # Only the allowed object was ever asked for: the refusals happened before any request.
    assert proxy.log == [("HEAD", stack.path("ok/x.png")), ("GET", stack.path("ok/x.png"))], proxy.log


def test_no_secret_reaches_the_logs_or_the_topics(stack, proxy, qwen35_model, capfd):
    from d3stream.ops.logs import configure_logging

    secret_key = stack.store.secret_key  # in the environment (AWS_SECRET_ACCESS_KEY), as the stack fixture sets it
    sasl_password = "sasl-password-must-not-leak-3141"  # in the settings (unused with PLAINTEXT)
    good = stack.put("ok/good.png", make_png(40, 40, seed=47))
    proxy.fail_next(1000, path=stack.path("ok/failing.png"))
    stack.put("ok/failing.png", make_png(40, 40, seed=48))
    requests = [
        {"id": "sec-good", "state": "s", "questions": {"noul": Q_NOUL}, "images": [good]},
        {"id": "sec-missing", "state": "s", "questions": {"noul": Q_NOUL}, "images": [f"s3://{stack.bucket}/ok/none.png"]},
        {"id": "sec-failing", "state": "s", "questions": {"noul": Q_NOUL},
         "images": [f"s3://{stack.bucket}/ok/failing.png"]},
        {"id": "sec-nobucket", "state": "s", "questions": {"noul": Q_NOUL},
         "images": [f"s3://{stack.bucket}-x/ok/a.png"]},
    ]
    records = [record(r) for r in requests] + [(b"sec-junk", b"\xff not json")]
    settings_ = stack.settings(s3_endpoint_url=proxy.endpoint_url, sasl_password=sasl_password, s3_max_attempts=1,
                               media_allowlist=[f"{stack.bucket}/ok/", f"{stack.bucket}-x/ok/"],
                               log_level="debug", log_format="json")
    capfd.readouterr()
    restore = configure_logging(settings_.observability.log_format, settings_.observability.log_level)
    try:
        _, reader = run(serve(stack, settings_, qwen35_model, records, [r["id"] for r in requests] + ["sec-junk"]))
        out, err = capfd.readouterr()
    finally:
        restore()
    logs = out + err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "serving" for e in events), err[-2000:]
    assert any(e.get("event") == "request refused" for e in events)
    assert any(e.get("event") == "media fetched" for e in events), "debug logs were on"
    published = json.dumps(reader.answers())
    for value in (secret_key, sasl_password):
        assert value not in logs, f"a secret is in the logs: {value[:6]}..."
        assert value not in published, f"a secret is in an answer: {value[:6]}..."
    codes = {a["id"]: (a.get("error") or {}).get("code") for a in reader.answers()}
    assert codes == {"sec-good": None, "sec-missing": "media_missing", "sec-failing": "media_unavailable",
                     "sec-nobucket": "media_missing", "sec-junk": "undecodable_event"}


# ======================================================================================== SASL/PLAIN


SASL_USER, SASL_PASSWORD = "d3worker", "d3-sasl-password"


@pytest.fixture(scope="module")
def sasl_broker(kafka_broker):
    """A second broker whose only client listener is SASL_PLAINTEXT with PLAIN users admin and d3worker.

    (It asks for ``kafka_broker`` only to share its skip-or-fail rule when java or the jars are missing.)"""
    from d3stream.dev.infra import KafkaBroker

    port, controller = free_port(), free_port()
    jaas = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="admin" password="admin-secret" user_admin="admin-secret" '
        f'user_{SASL_USER}="{SASL_PASSWORD}";'
    )
    extra = {
        "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas,
    }
    admin = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_plain_username": "admin",
             "sasl_plain_password": "admin-secret"}
    with KafkaBroker(extra_properties=extra, client_options=admin, port=port, controller_port=controller) as broker:
        yield broker


def _sasl_settings(broker, topics: dict[str, str], group: str, password: str) -> Settings:
    return Settings.from_flat(bootstrap_servers=broker.bootstrap_servers, request_topics=[topics["req"]],
                    answer_topic=topics["ans"], dead_letter_topic=topics["dlq"], provenance_topic=topics["prov"],
                    group_id=group, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                    sasl_username=SASL_USER, sasl_password=password, commit_interval_ms=100, linger_ms=10,
                    metrics_port=None)


async def _run_with_wrong_password(broker, topics: dict[str, str], group: str, model: Any):
    """(what Service.run raised -- None when it hung for 60 s, "returned" when it returned --, seconds)."""
    service = Service(_sasl_settings(broker, topics, group, "not-the-password"), model)
    started = time.monotonic()
    try:
        await asyncio.wait_for(service.run(), 60)
    except TimeoutError:
        return None, time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
        return exc, time.monotonic() - started
    return "returned", time.monotonic() - started


@pytest.fixture(scope="module")
def sasl_topics(sasl_broker) -> dict[str, str]:
    import uuid

    topics = {name: f"sasl-{name}-{uuid.uuid4().hex[:8]}" for name in ("req", "ans", "dlq", "prov")}
    for name in ("req", "ans", "dlq"):
        sasl_broker.create_topic(topics[name], 2)
    return topics


def test_sasl_plain_answers_flow_with_the_right_password_and_the_wrong_one_is_refused(
        sasl_broker, sasl_topics, qwen35_model, unique_name, capsys):
    bootstrap = sasl_broker.bootstrap_servers
    security = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_plain_username": SASL_USER,
                "sasl_plain_password": SASL_PASSWORD}
    topics = sasl_topics
    requests = [{"id": f"sasl-{n}", "state": f"secured {n}", "questions": {"noul": Q_NOUL}} for n in range(6)]

    async def right():
        service = Service(_sasl_settings(sasl_broker, topics, unique_name("grp"), SASL_PASSWORD), qwen35_model)
        async with Reader(bootstrap, topics["ans"], 2, security=security) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                await produce(bootstrap, topics["req"], [record(r) for r in requests], security=security)
                await reader.wait_ids({r["id"] for r in requests}, 90, task)
            finally:
                service.stop()
                await asyncio.wait_for(task, 60)
            return reader.counts()

    counts = run(right())
    assert counts == {r["id"]: 1 for r in requests}

    # A plaintext client is refused too (the listener speaks SASL only).
    async def plaintext():
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await asyncio.wait_for(admin.start(), 30)
        finally:
            await admin.close()

    with pytest.raises(Exception):  # noqa: B017 - any refusal; what matters is that it is one
        run(plaintext())

    outcome, seconds = run(_run_with_wrong_password(sasl_broker, topics, unique_name("grp"), qwen35_model))
    with capsys.disabled():
        print(f"\n[sasl] wrong password -> {type(outcome).__name__}: {outcome} after {seconds:.1f} s")
    assert outcome is not None, "the service hung with a wrong SASL password"
    assert isinstance(outcome, Exception), f"Service.run {outcome} with a wrong password"

    async def nothing_answered():
        async with Reader(bootstrap, topics["ans"], 2, security=security) as reader:
            await reader.caught_up()
            return reader.counts()

    assert run(nothing_answered()) == counts, "the worker with the wrong password answered something"


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def test_a_wrong_sasl_password_is_reported_as_an_authentication_failure(sasl_broker, sasl_topics, qwen35_model,
                                                                        unique_name):
    outcome, _ = run(_run_with_wrong_password(sasl_broker, sasl_topics, unique_name("grp"), qwen35_model))
    assert isinstance(outcome, Exception)
    text = " <- ".join(f"{type(e).__name__}: {e}" for e in _chain(outcome)).lower()
    assert any(word in text for word in ("authentication", "sasl", "password", "credential")), text
