"""The service end to end, against a real Kafka broker, a real S3 store (S3Proxy) and a tiny real model.

Each test uses its own topics, consumer group and bucket. The model is the session's ``qwen35_model``
(tiny, random, sharpened weights: answers really depend on the inputs). Nothing here is mocked except
the speed of ``forward`` in the tests that need work to pile up (``SlowModel`` delegates to the real model).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from d3stream_client.contract import decode_answer
from d3stream_client.publisher import produce

import d3stream
from d3stream.core.storage import MediaError, MediaFetcher
from d3stream.kafka.consume import BACKPRESSURE_POLL_MS, POLL_MS
from d3stream.service import Service, answer_identity, provenance_digest
from tests.support.media_makers import data_url, make_jpeg, make_mp4, make_png, make_png_header_only
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    Reader,
    SlowModel,
    close_to,
    committed,
    read_all,
    record,
    run,
    serve,
    stop,
)

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- helpers


ANSWER_VALIDATOR = jsonschema.Draft202012Validator(json.loads((REPO / "schemas" / "answer.schema.json").read_text()))
DEAD_LETTER_VALIDATOR = jsonschema.Draft202012Validator(
    json.loads((REPO / "schemas" / "dead-letter.schema.json").read_text())
)


# ------------------------------------------------------------------------------------ mixed stream


def test_mixed_stream_answers_match_system_one_with_provenance(stack, qwen35_model):
    model = qwen35_model
    png_a, png_b = make_png(64, 48, seed=11), make_png(96, 64, seed=12)
    jpeg = make_jpeg(72, 56, seed=13)
    mp4_a, mp4_b = make_mp4(8, 64, 48, seed=14), make_mp4(6, 48, 48, seed=15)
    inline_png = make_png(40, 40, seed=16)
    uri = {
        "png_a": stack.put("img/a.png", png_a),
        "png_b": stack.put("img/b.png", png_b),
        "jpeg": stack.put("img/c.jpg", jpeg),
        "mp4_a": stack.put("vid/a.mp4", mp4_a),
        "mp4_b": stack.put("vid/b.mp4", mp4_b),
    }
    data = {"png_a": png_a, "png_b": png_b, "jpeg": jpeg, "mp4_a": mp4_a, "mp4_b": mp4_b}
    inline_url = data_url(inline_png, "image/png")
    inline_video_url = data_url(mp4_b, "video/mp4")

    requests: list[dict[str, Any]] = []
    for n in range(8):  # text
        questions = {"noul": Q_NOUL} if n % 3 == 0 else {"route": Q_CHOICE, "level": Q_SCORE}
        if n == 5:
            questions = {"route": Q_CHOICE, "noul": Q_NOUL, "level": Q_SCORE, "bad": {"type": "score", "criteria": ["x"]}}
        requests.append({"id": f"text-{n}", "state": f"State number {n}: " + "word " * (3 * n), "questions": questions,
                         "metadata": {"n": n}})
    requests.append({"id": "text-pa", "state": "Permutation averaged.", "questions": {"route": Q_CHOICE},
                     "permutation_average": True})
    for n, name in enumerate(("png_a", "png_b", "jpeg", "png_a")):  # s3 images
        requests.append({"id": f"image-{n}", "state": f"Camera {n}", "questions": {"noul": Q_NOUL, "route": Q_CHOICE},
                         "images": [uri[name]]})
    requests.append({"id": "image-two", "state": "Two cameras", "questions": {"noul": Q_NOUL},
                     "images": [uri["png_a"], uri["png_b"]]})
    requests.append({"id": "image-inline", "state": "Inline", "questions": {"noul": Q_NOUL, "level": Q_SCORE},
                     "images": [inline_url]})
    requests.append({"id": "video-0", "state": "Clip", "questions": {"noul": Q_NOUL}, "videos": [uri["mp4_a"]]})
    requests.append({"id": "video-1", "state": "Clip 2", "questions": {"route": Q_CHOICE, "noul": Q_NOUL},
                     "videos": [uri["mp4_b"]]})
    requests.append({"id": "video-inline", "state": "Inline clip", "questions": {"noul": Q_NOUL},
                     "videos": [inline_video_url]})
    requests.append({"id": "mixed", "state": "Still and clip", "questions": {"noul": Q_NOUL, "level": Q_SCORE},
                     "images": [uri["jpeg"]], "videos": [uri["mp4_a"]]})
    requests.append({"id": "text-last", "state": "The last one.", "questions": {"noul": Q_NOUL}})
    assert len(requests) == 20

    def media_bytes(reference: str) -> bytes | str:
        for name, value in uri.items():
            if value == reference:
                return data[name]
        return reference  # data: URL, read as-is in strict mode

    settings = stack.settings(linger_ms=50)
    by_id = {r["id"]: r for r in requests}

    async def scenario():
        await produce(stack.broker.bootstrap_servers, stack.requests, [record(r) for r in requests])
        service = Service(settings, model)
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait_ids(set(by_id), 120, task)
            finally:
                await stop(service, task)
            await reader.caught_up()
            return service, list(reader.records)

    service, records = run(scenario())
    answers = {}
    for item in records:
        answer = json.loads(item.value)
        assert item.key == answer["id"].encode(), "answers are keyed by request id"
        assert ("content-type", b"application/json") in list(item.headers)
        answers.setdefault(answer["id"], []).append(answer)
    assert set(answers) == set(by_id)
    assert all(len(v) == 1 for v in answers.values()), {k: len(v) for k, v in answers.items() if len(v) > 1}
    # The worker's provenance: the model's, plus how it shares prompt prefixes (on by default: causal).
    assert service.default.provenance == {**model.provenance(), "shared_prefix_reuse": service.default.provenance["shared_prefix_reuse"]}
    sha = provenance_digest(service.default.provenance)
    # Deterministic answer ids: a function of the request record and the model.
    answer_ids = [answer_identity(decode_answer(item.value), sha) for item in records]
    assert [json.loads(item.value)["answer_id"] for item in records] == answer_ids
    assert len(set(answer_ids)) == len(answer_ids)

    # Cross-event batching really happened ...
    assert service.default.passes.rows.passes_run < service.default.passes.rows.rows_run
    own_rows = {
        rid: len([q for q in by_id[rid]["questions"] if q != "bad"]) * (2 if by_id[rid].get("permutation_average") else 1)
        for rid in by_id
    }
    assert any(a[0]["provenance"]["batch"]["rows"] > own_rows[rid] for rid, a in answers.items())

    # ... and changed no answer: each equals system_one on the same inputs, run alone.
    for rid, (answer,) in answers.items():
        request = by_id[rid]
        ANSWER_VALIDATOR.validate(answer)
        assert "error" not in answer, answer.get("error")
        images = [media_bytes(x) for x in request.get("images", [])] or None
        videos = [media_bytes(x) for x in request.get("videos", [])] or None
        if request.get("permutation_average"):
            prepared = model.prepare(request["state"], request["questions"], images, videos, strict=True,
                                     permutation_average=True)
            expected = prepared.answers(model.run(prepared))
        else:
            expected = model.system_one(state=request["state"], questions=request["questions"], images=images,
                                        videos=videos, strict=True)
        close_to(answer["answers"], expected["answers"], rid)
        assert answer["usage"] == expected["usage"], rid
        assert answer["model"] == model.model_name
        assert answer.get("metadata") == request.get("metadata")

        # Provenance.
        source = answer["source"]
        assert source["topic"] == stack.requests and 0 <= source["partition"] < 4 and source["offset"] >= 0
        assert source["timestamp"] > 1_600_000_000_000
        prov = answer["provenance"]
        assert prov["model"] == {"name": model.model_name, "runtime": service.default.provenance["runtime"],
                                 "provenance_sha256": sha}
        assert prov["worker"] == {"host": socket.gethostname(), "pid": os.getpid(), "version": d3stream.__version__}
        batch = prov["batch"]
        assert batch["passes"] >= 1 and batch["rows"] >= own_rows[rid]
        # A shared prompt prefix runs once: the tokens it saved are not run again.
        assert batch.get("shared_prefix", False) == (own_rows[rid] >= 2), rid
        assert answer["usage"]["input_tokens"] - batch.get("saved_tokens", 0) <= batch["real_tokens"]
        assert batch["real_tokens"] <= batch["padded_tokens"]
        timings = prov["timings"]
        assert set(timings) == {"queued", "fetch", "decode", "prepare", "forward", "total"}
        assert all(value >= 0 for value in timings.values()), timings
        assert timings["forward"] > 0 and timings["total"] >= max(timings["forward"], timings["prepare"]) - 1
        references = [*request.get("images", []), *request.get("videos", [])]
        assert len(prov.get("media", [])) == len(references), rid
        for reference, media in zip(references, prov.get("media", []), strict=True):
            raw = media_bytes(reference)
            if isinstance(raw, str):  # inline
                raw = base64.b64decode(reference.split(",", 1)[1])
                assert media["uri"].startswith("data:") and media.get("etag") is None
            else:
                assert media["uri"] == reference
                head = stack.store.client().head_object(Bucket=stack.bucket, Key=reference.split("/", 3)[3])
                assert media["etag"] == head["ETag"].strip('"')
                assert media.get("version") == head.get("VersionId")
            assert media["bytes"] == len(raw)
            assert media["sha256"] == hashlib.sha256(raw).hexdigest()

    # The provenance record: published once, keyed by its digest, on a compacted topic.
    async def provenance_records():
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

        records = await read_all(stack.broker.bootstrap_servers, stack.provenance, 1)
        admin = AIOKafkaAdminClient(bootstrap_servers=stack.broker.bootstrap_servers)
        await admin.start()
        try:
            (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, stack.provenance)])
        finally:
            await admin.close()
        return records, response

    prov_records, config_response = run(provenance_records())
    assert [r.key for r in prov_records] == [sha.encode()]
    stored = json.loads(prov_records[0].value)
    assert stored == json.loads(json.dumps(service.default.provenance))
    assert provenance_digest(stored) == sha
    config = {entry[0]: entry[1] for entry in config_response.resources[0][4]}
    assert config.get("cleanup.policy") == "compact"


# ------------------------------------------------------------------------- shared prefixes, media cache


def test_questions_share_their_prompt_prefix_and_repeated_media_is_encoded_once(stack, qwen35_model):
    """Multi-question requests run their common prefix once (and answer as full prompts would); every
    question is verified against its full prompt (prefix_verify_every=1); the same image in several
    requests is encoded once."""
    model = qwen35_model
    shared_image = stack.put("img/shared.png", make_png(64, 48, seed=21))
    requests = [
        {"id": f"long-{n}", "state": f"Report {n}. " + "The line is moving slowly today. " * 12,
         "questions": {"noul": Q_NOUL, "route": Q_CHOICE, "level": Q_SCORE}}
        for n in range(4)
    ] + [
        {"id": f"cam-{n}", "state": f"Camera {n}", "questions": {"noul": Q_NOUL, "route": Q_CHOICE},
         "images": [shared_image]}
        for n in range(3)
    ] + [{"id": "single", "state": "One question only.", "questions": {"noul": Q_NOUL}}]
    settings = stack.settings(prefix_verify_every=1)
    by_id = {r["id"]: r for r in requests}
    service, reader = run(serve(stack, settings, model, [record(r) for r in requests], by_id, timeout=120))
    answers = reader.by_id()
    for rid, request in by_id.items():
        answer = answers[rid]
        images = [make_png(64, 48, seed=21)] * len(request.get("images", [])) or None
        expected = model.system_one(state=request["state"], questions=request["questions"], images=images, strict=True)
        close_to(answer["answers"], expected["answers"], rid)
        batch = answer["provenance"]["batch"]
        if rid == "single":  # nothing to share: a full prompt, batched with others
            assert not batch.get("shared_prefix") and not batch.get("saved_tokens")
        else:
            assert batch["shared_prefix"] and batch["saved_tokens"] > 0, (rid, batch)
            assert answer["usage"]["input_tokens"] - batch["saved_tokens"] <= batch["real_tokens"]

    value = service.metrics.registry.get_sample_value
    questions = sum(len(r["questions"]) for r in requests if r["id"] != "single")
    assert value("d3stream_prefix_requests_total", {"path": "shared"}) == len(requests) - 1
    assert value("d3stream_prefix_checks_total", {"result": "passed"}) == questions
    assert value("d3stream_prefix_checks_total", {"result": "failed"}) == 0
    assert 0 < value("d3stream_prefix_max_abs_dp") <= settings.batching.prefix_tolerance
    # Three requests, one image: encoded once. Requests in the same pass share one vision-tower call (no
    # cache lookup for the copies); ones in later passes find it in the cache. Either way: one miss.
    assert value("d3stream_media_cache_lookups_total", {"result": "miss"}) == 1
    assert service.default.provenance["shared_prefix_reuse"]["verify_every"] == 1
    assert model.media_cache is None  # the service's cache went with it: a later caller of the model sees none


def test_a_failing_shared_prefix_call_falls_back_to_full_prompts(stack, qwen35_model):
    model = qwen35_model
    requests = [{"id": f"fb-{n}", "state": f"Fallback {n}", "questions": {"noul": Q_NOUL, "route": Q_CHOICE}}
                for n in range(3)]

    async def scenario():
        await produce(stack.broker.bootstrap_servers, stack.requests, [record(r) for r in requests])
        service = Service(stack.settings(), model)

        def broken(rows, states):
            raise RuntimeError("CUDA out of memory (simulated) in a suffix pass")

        service.default.passes.prefix_runner._suffix_pass = broken  # every shared-prefix call fails
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait_ids({r["id"] for r in requests}, 120, task)
            finally:
                await stop(service, task)
            return service, {a["id"]: a for a in map(json.loads, (r.value for r in reader.records))}

    service, answers = run(scenario())
    # Planned for a shared prefix, failed there, answered from full prompts.
    assert service.metrics.registry.get_sample_value("d3stream_prefix_requests_total", {"path": "shared"}) == 3
    assert service.default.passes.rows.rows_run >= 6
    for request in requests:
        answer = answers[request["id"]]
        assert not answer["provenance"]["batch"].get("shared_prefix"), answer["provenance"]["batch"]
        expected = model.system_one(state=request["state"], questions=request["questions"])
        close_to(answer["answers"], expected["answers"], request["id"])


def test_prefix_reuse_on_is_refused_for_a_noncausal_checkpoint(stack, qwen35_noncausal_model):
    with pytest.raises(ValueError, match="prefix_reuse"):
        Service(stack.settings(prefix_reuse="on"), qwen35_noncausal_model)
    service = Service(stack.settings(), qwen35_noncausal_model)  # auto: full prompts, nothing to refuse
    assert service.default.passes.prefix_runner is None and "shared_prefix_reuse" not in service.default.provenance


# ------------------------------------------------------------------------------------- error codes


def test_every_request_error_is_answered_and_the_stream_continues(stack, qwen35_model, object_store):
    model = qwen35_model
    stack.broker.create_topic(stack.requests + "-1p", 1)
    stack.requests += "-1p"  # one partition: "after" means after
    good_png = make_png(48, 48, seed=21)
    good = stack.put("ok/good.png", good_png)
    stack.put("secret/good.png", good_png)
    large = stack.put("ok/large.png", b"\x89PNG\r\n\x1a\n" + bytes(8_000_001))
    corrupt = bytearray(make_png(64, 64, seed=22))
    corrupt[60:400] = bytes(340)  # IDAT garbled: the signature still says PNG
    corrupt_png = stack.put("ok/corrupt.png", bytes(corrupt))
    truncated_png = stack.put("ok/truncated.png", make_png(64, 64, seed=23)[:150])
    corrupt_mp4 = stack.put("ok/corrupt.mp4", make_mp4(6, 48, 48, seed=24)[:300])
    bomb = stack.put("ok/bomb.png", make_png_header_only(6000, 6000))  # tiny file, 36 Mpx claimed
    other_bucket = stack.unique("other")
    object_store.create_bucket(other_bucket)
    object_store.client().put_object(Bucket=other_bucket, Key="ok/good.png", Body=good_png)
    questions = {"noul": Q_NOUL}

    def req(rid: str, **fields: Any) -> tuple[bytes, bytes]:
        return record({"id": rid, "state": "s", "questions": questions, **fields})

    bad_records: list[tuple[bytes | None, bytes]] = [
        (b"e-undecodable", b"{this is not json"),
        (None, b"\xff\x00 binary, no key"),
        (b"e-array", b"[1, 2, 3]"),
        (b"e-schema", json.dumps({"id": "e-schema", "questions": ["q"]}).encode()),
        (b"e-schema-key", json.dumps({"questions": questions}).encode()),  # no id: the key names it
        req("e-empty", questions={}),
        req("e-bad-state", state=None, questions={"q": "not a question object"}),
        req("e-model", model="some-other-model", metadata={"trace": "t-1"}),
        req("e-http", images=["https://example.com/a.png"]),
        req("e-path", images=["/etc/passwd"]),
        req("e-file-url", videos=["file:///etc/passwd"]),
        req("e-bucket", images=[f"s3://{other_bucket}/ok/good.png"]),
        req("e-prefix", images=[f"s3://{stack.bucket}/secret/good.png"]),
        req("e-missing", images=[f"s3://{stack.bucket}/ok/missing.png"]),
        req("e-missing-bucket", images=[f"s3://{stack.bucket}-nope/elsewhere/x.png"]),
        req("e-large", images=[large]),
        req("e-corrupt", images=[corrupt_png]),
        req("e-truncated", images=[truncated_png]),
        req("e-corrupt-video", videos=[corrupt_mp4]),
        req("e-bomb", images=[bomb]),
        req("e-data-gif", images=["data:image/gif;base64,R0lGODlhAQABAAAAACw="]),
        req("e-data-garbage", images=["data:image/png;base64,!!!notbase64"]),
        req("e-good-1", images=[good]),
    ]
    expected = {
        "e-undecodable": "undecodable_event",
        "e-array": "undecodable_event",
        "e-schema": "invalid_request",
        "e-schema-key": "invalid_request",
        "e-empty": "invalid_request",
        "e-bad-state": None,  # question-level error only
        "e-model": "model_not_served",
        "e-http": "media_not_allowed",
        "e-path": "media_not_allowed",
        "e-file-url": "media_not_allowed",
        "e-bucket": "media_not_allowed",
        "e-prefix": "media_not_allowed",
        "e-missing": "media_missing",
        "e-missing-bucket": "media_missing",  # allowed, but the bucket does not exist
        "e-large": "media_too_large",
        "e-corrupt": "media_unreadable",
        "e-truncated": "media_unreadable",
        "e-corrupt-video": "media_unreadable",
        "e-bomb": "media_unreadable",
        "e-data-gif": "media_unreadable",
        "e-data-garbage": "media_unreadable",
        "e-good-1": None,
    }
    keyless_id = f"{stack.requests}/0/1"
    expected[keyless_id] = "undecodable_event"
    settings = stack.settings(
        media_allowlist=[f"{stack.bucket}/ok/", f"{stack.bucket}-nope/elsewhere/"],
        s3_max_attempts=2,
        s3_connect_timeout=1.0,
        s3_read_timeout=3.0,
    )

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        await produce(bootstrap, stack.requests, bad_records)
        service = Service(settings, model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait_ids(set(expected), 90, task)
                # The object store goes away: media_unavailable, then it comes back and the stream goes on.
                object_store.stop()
                try:
                    await produce(bootstrap, stack.requests, [req("e-unavailable", images=[good])])
                    await reader.wait_ids({"e-unavailable"}, 90, task)
                finally:
                    object_store.start()
                await produce(bootstrap, stack.requests, [req("e-good-2", images=[good])])
                await reader.wait_ids({"e-good-2"}, 90, task)
            finally:
                await stop(service, task)
            await reader.caught_up()
            answers = reader.answers()
            assert all(r.key == json.loads(r.value)["id"].encode() for r in reader.records), "keyed by id"
        dead = await read_all(bootstrap, stack.dead_letters, 4)
        offsets = await committed(bootstrap, settings.delivery.group_id, stack.requests, 1)
        return service, answers, dead, offsets

    service, answers, dead, offsets = run(scenario())
    expected["e-unavailable"] = "media_unavailable"
    expected["e-good-2"] = None
    by_id = {a["id"]: a for a in answers}
    assert collections.Counter(a["id"] for a in answers) == collections.Counter(set(expected)), "one answer each"
    sha = service.default.provenance_sha256
    for rid, code in expected.items():
        answer = by_id[rid]
        ANSWER_VALIDATOR.validate(answer)
        assert answer["provenance"]["model"]["provenance_sha256"] == sha
        assert answer["provenance"]["worker"]["pid"] == os.getpid()
        assert answer["source"]["topic"] == stack.requests
        if code is None:
            assert "error" not in answer, (rid, answer.get("error"))
            assert answer["answers"] and "usage" in answer
            continue
        assert answer.get("error", {}).get("code") == code, (rid, answer.get("error"))
        assert answer["error"]["message"], rid
        assert "answers" not in answer and "usage" not in answer, rid
    # Specifics.
    assert by_id["e-model"]["metadata"] == {"trace": "t-1"}
    assert "some-other-model" in by_id["e-model"]["error"]["message"]
    assert "media_allowlist" in by_id["e-prefix"]["error"]["message"]
    assert by_id["e-bad-state"]["answers"]["q"]["error"] == "invalid_question"
    assert by_id["e-good-1"]["usage"]["input_tokens"] > 0 and by_id["e-good-2"]["answers"]["noul"]["noul"] >= 0
    assert by_id["e-good-1"]["provenance"]["media"][0]["sha256"] == hashlib.sha256(good_png).hexdigest()
    assert by_id["e-large"]["provenance"]["media"] == []
    assert service.fetcher.bytes_fetched < 1_000_000, "the oversized object was refused from HEAD, never read"
    assert service.counts["dead_letters"] == 3
    assert service.counts["errors"] == sum(1 for c in expected.values() if c)
    # Every record's offset is committed, errors included.
    assert offsets == {0: len(bad_records) + 2}

    # Dead letters: the three records that are not JSON objects, with the reason and the exact bytes.
    letters = [json.loads(r.value) for r in dead]
    assert len(letters) == 3
    originals = {(k.decode() if k else None): v for k, v in bad_records[:3]}
    for item, letter in zip(dead, letters, strict=True):
        DEAD_LETTER_VALIDATOR.validate(letter)
        assert letter["key"] in originals
        assert item.key == (letter["key"].encode() if letter["key"] else None)
        assert base64.b64decode(letter["value_base64"]) == originals[letter["key"]]
        assert letter["reason"]
        answer_id = letter["key"] or keyless_id
        assert letter["source"] == by_id[answer_id]["source"]
        assert letter["reason"] == by_id[answer_id]["error"]["message"]


def test_allowlist_cannot_be_escaped_with_dot_segments(stack):
    stack.put("secret/x.png", b"SECRET")
    stack.put("ok/y.png", b"fine")
    fetcher = MediaFetcher(
        allowlist=[f"{stack.bucket}/ok/"], endpoint_url=stack.store.endpoint_url, region=stack.store.region,
        max_attempts=1,
    )

    async def attempt(reference: str):
        try:
            return await fetcher.fetch(reference, "image")
        except MediaError as exc:
            return exc

    try:
        assert run(attempt(f"s3://{stack.bucket}/ok/y.png")).data == b"fine"
        outcome = run(attempt(f"s3://{stack.bucket}/ok/../secret/x.png"))
    finally:
        fetcher.close()
    assert isinstance(outcome, MediaError), f"read {outcome.data!r} from outside the allowlist"
    assert outcome.code == "media_not_allowed"


# ---------------------------------------------------------------------------------- fault containment


class FaultyModel(SlowModel):
    """The real model, except: a pass holding a question named ``poison`` fails (as an out-of-memory or a
    kernel error would), and preparing the state ``"explode"`` raises a non-ValueError (a worker bug)."""

    def forward(self, rows):
        self.forward_calls += 1
        if any(row.key == "poison" for row in rows):
            raise RuntimeError("simulated kernel failure")
        return self._model.forward(rows)

    def prepare(self, state, *args, **kwargs):
        if state == "explode":
            raise KeyError("simulated worker bug")
        return self._model.prepare(state, *args, **kwargs)


def test_a_failing_pass_costs_only_its_own_question(stack, qwen35_model):
    model = FaultyModel(qwen35_model, 0.0)
    # The fault is injected into D3.forward, the full-prompt path: shared-prefix passes would not see it.
    settings = stack.settings(linger_ms=50, prefix_reuse="off")
    requests = [
        {"id": f"fc-{n}", "state": f"neighbour {n}", "questions": {"noul": Q_NOUL, "route": Q_CHOICE}}
        for n in range(5)
    ]
    requests.insert(2, {"id": "fc-poisoned", "state": "mixed", "questions": {"ok": Q_NOUL, "poison": Q_NOUL}})

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        await produce(bootstrap, stack.requests, [record(r) for r in requests])
        service = Service(settings, model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait_ids({r["id"] for r in requests}, 90, task)
            finally:
                await stop(service, task)
            await reader.caught_up()
            return service, reader.answers()

    service, answers = run(scenario())
    by_id = {a["id"]: a for a in answers}
    assert len(answers) == len(requests) == len(by_id)
    assert service.default.passes.rows.passes_run >= 1
    poisoned = by_id["fc-poisoned"]
    assert "error" not in poisoned
    assert poisoned["answers"]["poison"]["error"] == "invalid_model_output"
    assert "simulated kernel failure" in poisoned["answers"]["poison"]["message"]
    expected = qwen35_model.system_one(state="mixed", questions={"ok": Q_NOUL})
    close_to({"ok": poisoned["answers"]["ok"]}, expected["answers"], "fc-poisoned")
    for request in requests:
        if request["id"] != "fc-poisoned":
            assert "error" not in by_id[request["id"]]
            want = qwen35_model.system_one(state=request["state"], questions=request["questions"])
            close_to(by_id[request["id"]]["answers"], want["answers"], request["id"])


def test_a_worker_fault_is_answered_under_the_request_id(stack, qwen35_model):
    model = FaultyModel(qwen35_model, 0.0)
    requests = [
        {"id": "fc-explode", "state": "explode", "questions": {"ok": Q_NOUL}, "metadata": {"trace": "x"}},
        {"id": "fc-after", "state": "after the fault", "questions": {"ok": Q_NOUL}},
    ]

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        await produce(bootstrap, stack.requests, [record(r) for r in requests])
        service = Service(stack.settings(), model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: len(reader.records) >= 2, 60, task, what="two answers")
            finally:
                await stop(service, task)
            return [(r.key, json.loads(r.value)) for r in reader.records]

    answers = run(scenario())
    by_id = {a["id"]: (key, a) for key, a in answers}
    assert by_id["fc-after"][1]["answers"]["ok"]["type"] == "noul"  # the stream goes on
    assert "fc-explode" in by_id, f"the fault was answered as {sorted(by_id)}"
    key, answer = by_id["fc-explode"]
    assert key == b"fc-explode"
    assert answer["error"]["code"] == "internal_error" and "KeyError" in answer["error"]["message"]
    assert answer["metadata"] == {"trace": "x"}


# ------------------------------------------------------------------------------------- backpressure


def test_backpressure_bounds_inflight_requests(stack, qwen35_model):
    limit = 4
    model = SlowModel(qwen35_model, 0.05)
    settings = stack.settings(max_inflight_requests=limit, linger_ms=5)
    requests = [{"id": f"bp-{n:02d}", "state": f"flood {n}", "questions": {"noul": Q_NOUL}} for n in range(40)]

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        await produce(bootstrap, stack.requests, [record(r) for r in requests])
        service = Service(settings, model)
        samples: list[tuple[int, int, bool]] = []
        looks: list[tuple[bool, int]] = []  # (paused, how long the consume loop let the consumer wait for records)

        def watch_looks(loop) -> None:
            asked = loop.consumer.getmany  # the worker's real consumer, its calls noted on their way

            async def getmany(*args, **kwargs):
                looks.append((loop.paused, kwargs["timeout_ms"]))
                return await asked(*args, **kwargs)

            loop.consumer.getmany = getmany

        async def sample():
            while service.loop is None:
                await asyncio.sleep(0.002)
            watch_looks(service.loop)
            while True:
                samples.append((service.in_flight.requests, service.tracker.in_flight(), service.loop.paused))
                await asyncio.sleep(0.002)

        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            sampler = asyncio.create_task(sample())
            try:
                await reader.wait_ids({r["id"] for r in requests}, 120, task)
            finally:
                sampler.cancel()
                await stop(service, task)
            await reader.caught_up()
            return samples, looks, reader.counts(), reader.answers()

    samples, looks, counts, answers = run(scenario())
    # While paused, the loop looks at the draining work every BACKPRESSURE_POLL_MS (10 ms), sooner than while reading:
    # a look every 100 ms held a worker at 256 requests in flight to about 2,600 requests a second, idle two thirds
    # of the time.
    assert any(paused for paused, _ in looks), "no look while the partitions were paused"
    assert {wait for paused, wait in looks if paused} == {BACKPRESSURE_POLL_MS} and BACKPRESSURE_POLL_MS <= 20
    assert {wait for paused, wait in looks if not paused} == {POLL_MS}
    assert set(counts) == {r["id"] for r in requests} and max(counts.values()) == 1
    assert all("error" not in a for a in answers)
    most = max(s[0] for s in samples)
    most_tracked = max(s[1] for s in samples)
    assert most <= limit + 1, f"{most} requests in flight with max_inflight_requests={limit}"
    assert most_tracked <= limit + 1
    assert most >= limit - 1, f"the flood never filled the window (max {most})"
    assert any(paused for *_, paused in samples), "partitions were never paused"
    assert model.forward_calls >= 40 // (limit + 1)


# --------------------------------------------------------------------------- clean shutdown + restart


@pytest.mark.parametrize("delivery", ["exactly_once", "at_least_once"])
def test_clean_shutdown_mid_stream_then_restart_answers_each_request_once(stack, qwen35_model, delivery):
    model = SlowModel(qwen35_model, 0.05)
    settings = stack.settings(max_inflight_requests=6, max_batch_rows=2, linger_ms=5, delivery=delivery)
    requests = [{"id": f"sd-{n:02d}", "state": f"shutdown {n}", "questions": {"noul": Q_NOUL, "level": Q_SCORE}}
                for n in range(30)]
    ids = {r["id"] for r in requests}

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        await produce(bootstrap, stack.requests, [record(r) for r in requests])
        async with Reader(bootstrap, stack.answers) as reader:
            first = Service(settings, model)
            task = asyncio.create_task(first.run())
            try:
                await reader.wait(lambda: len(reader.counts()) >= 10, 90, task, what="10 answers")
            finally:
                await stop(first, task)
            offsets_after_first = await committed(bootstrap, settings.delivery.group_id, stack.requests, 4)
            await reader.caught_up()
            answered_by_first = len(reader.records)
            second = Service(settings, model)
            task = asyncio.create_task(second.run())
            try:
                await reader.wait_ids(ids, 90, task)
            finally:
                await stop(second, task)
            await reader.caught_up()
            return first, second, answered_by_first, offsets_after_first, reader.counts()

    first, second, answered_by_first, offsets, counts = run(scenario())
    assert set(counts) == ids
    duplicates = {k: v for k, v in counts.items() if v != 1}
    assert not duplicates, f"answered more than once after a clean shutdown: {duplicates}"
    done_first = first.counts["answered"] + first.counts["errors"]
    assert 10 <= done_first < 30, f"the first worker answered {done_first}: not stopped mid-stream"
    assert answered_by_first == done_first
    assert second.counts["answered"] == 30 - done_first
    # The first worker committed exactly what it answered (offsets count records per partition).
    assert sum(offsets.values()) == done_first


# -------------------------------------------------------------------------------------- two workers


def test_two_workers_in_one_group_answer_everything(stack, qwen35_model, qwen35_checkpoint, capsys):
    from tests.support.model_fixtures import load_model

    second_model = load_model(qwen35_checkpoint)  # each worker its own model, as two processes would have
    settings = stack.settings(max_inflight_requests=8, max_batch_rows=2, linger_ms=5)
    requests = [{"id": f"two-{n:02d}", "state": f"worker split {n}", "questions": {"noul": Q_NOUL}} for n in range(30)]
    ids = {r["id"] for r in requests}

    async def scenario():
        bootstrap = stack.broker.bootstrap_servers
        workers = [Service(settings, SlowModel(qwen35_model, 0.03)), Service(settings, SlowModel(second_model, 0.03))]
        async with Reader(bootstrap, stack.answers) as reader:
            tasks = [asyncio.create_task(workers[0].run())]
            try:
                # Half the stream to the first worker alone, then the second joins mid-stream (a rebalance).
                for request in requests[:15]:
                    await produce(bootstrap, stack.requests, [record(request)])
                await reader.wait(lambda: len(reader.counts()) >= 5, 60, *tasks, what="the first answers")
                tasks.append(asyncio.create_task(workers[1].run()))
                await reader.wait(lambda: bool(workers[1].consumer and workers[1].consumer.assignment()), 60,
                                  *tasks, what="the second worker's partitions")
                await produce(bootstrap, stack.requests, [record(r) for r in requests[15:]])
                await reader.wait_ids(ids, 90, *tasks)
            finally:
                for worker in workers:
                    worker.stop()
                await asyncio.wait_for(asyncio.gather(*tasks), 90)
            await reader.caught_up()
            return workers, reader.counts()

    workers, counts = run(scenario())
    assert set(counts) == ids, f"unanswered: {sorted(ids - set(counts))}"
    duplicates = {k: v for k, v in counts.items() if v > 1}
    per_worker = [w.counts["answered"] for w in workers]
    with capsys.disabled():
        print(f"\n[two workers] answers per worker {per_worker}, duplicates {duplicates or 'none'}")
    assert sum(per_worker) == sum(counts.values())
    assert per_worker[1] > 0, "the second worker never answered"
