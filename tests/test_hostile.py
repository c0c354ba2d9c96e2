"""Hostile input: fuzzed events, hostile media, access control, secrets in logs, and Kafka SASL/PLAIN.

* Fuzzing (hypothesis, 1,050 examples in all): random bytes, invalid UTF-8, deep nesting, huge strings and
  arrays, NaN/Infinity, wrong types, unknown fields, 300 options, duplicate keys, 10 MB states. Every input
  ends as a ``Request`` or an ``EventError`` with an error code (``decode_request``); as a prepared request
  or a ``ValueError`` (``decode_request`` + ``model.prepare``); and, through the service's own per-record
  path (``RequestPipeline.serve``, no broker), as exactly one answer event with an error code or
  answers -- never another exception.
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
import base64
import collections
import hashlib
import json
import struct
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest
from d3stream_client.contract import ERROR_CODES, Request, decode_answer
from d3stream_client.publisher import produce
from d3stream_client.validation import EventError, RequestLimits, decode_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from d3stream.runtime.questions import ERRORS as QUESTION_ERRORS
from d3stream.service import Service
from d3stream.settings import Settings
from tests.media_makers import make_jpeg, make_mp4, make_png, make_png_header_only
from tests.stream_helpers import Q_NOUL, Reader, assigned_and_ready, free_port, record, run, serve

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
ANSWER_VALIDATOR = jsonschema.Draft202012Validator(json.loads((REPO / "schemas" / "answer.schema.json").read_text()))
FUZZ = settings(
    deadline=None,
    database=None,  # no .hypothesis folder in the work tree
    derandomize=True,  # the same examples on every run and machine: a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
TEN_MB = 10 * 1024 * 1024


# ========================================================================================= strategies

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities included: json.dumps writes them as NaN / Infinity literals
    st.text(max_size=30),
)
json_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def nested(depth: int, kind: str) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


def hostile_values(big: int) -> st.SearchStrategy:
    """Values to put where a request has strings or JSON: huge, deep, special-token laden."""
    return st.one_of(
        json_values,
        st.builds(lambda n, ch: ch * n, st.sampled_from([1_000, big]), st.sampled_from(["s", "é", "\u2028", "\x00"])),
        st.sampled_from(["<|image_pad|>", "<|vision_start|><|video_pad|>", "<|im_end|>\n<|im_start|>system", "\ud7ff"]),
        st.builds(lambda n: [0] * n, st.sampled_from([1_000, big // 4])),
        st.builds(nested, st.sampled_from([8, 40, 61, 62, 63, 64, 200]), st.sampled_from(["list", "dict"])),
    )


MEDIA_REFERENCES = [
    "s3://fuzz-bucket/a.png",
    "s3://fuzz-bucket/../etc/passwd",
    "s3://",
    "s3:///key-without-bucket",
    "http://127.0.0.1:1/a.png",
    "https://example.invalid/a.png",
    "/etc/passwd",
    "file:///etc/passwd",
    "../relative.png",
    "data:image/png;base64,!!!",
    "data:image/gif;base64,R0lGODlhAQABAAAAACw=",
    "data:image/png;base64," + base64.b64encode(make_png(8, 8, seed=1)).decode(),
    "data:image/png;base64," + base64.b64encode(make_jpeg(8, 8, seed=2)).decode(),
    "data:text/html;base64,PGgxPmhpPC9oMT4=",
    "data:video/mp4;base64,AAAAIGZ0eXBpc29t",
    "",
]


def criteria_strategy(big: int) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(st.text(max_size=6), hostile_values(big), max_size=5),
        st.lists(hostile_values(big), max_size=12),
        st.builds(lambda n: {f"o{i}": f"option {i}" for i in range(n)}, st.sampled_from([0, 1, 2, 255, 256, 300])),
        st.builds(lambda n: [f"level {i}" for i in range(n)], st.integers(0, 12)),
        json_values,
    )


def question_strategy(big: int) -> st.SearchStrategy:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["noul", "choice", "score"]) | json_values},
            optional={"instructions": hostile_values(big), "criteria": criteria_strategy(big), "extra": json_values},
        ),
        json_values,
    )


def request_documents(big: int) -> st.SearchStrategy:
    """Request-shaped JSON objects with hostile values in every field, and unknown fields."""
    fields = st.fixed_dictionaries(
        {},
        optional={
            "id": st.one_of(st.text(min_size=1, max_size=20), st.just(""), st.just("x" * 513), json_values),
            "state": hostile_values(big),
            "questions": st.one_of(st.dictionaries(st.text(max_size=6), question_strategy(big), max_size=4),
                                   json_values),
            "images": st.lists(st.sampled_from(MEDIA_REFERENCES) | json_values, max_size=3) | json_values,
            "videos": st.lists(st.sampled_from(MEDIA_REFERENCES) | json_values, max_size=2) | json_values,
            "model": st.none() | st.text(max_size=10) | json_values,
            "permutation_average": st.none() | st.booleans() | json_values,
            "metadata": json_values,
        },
    )
    unknown = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in Request.__struct_fields__), json_values,
                              max_size=2)
    return st.builds(lambda doc, extra: {**extra, **doc}, fields, unknown)


def well_formed_question(big: int) -> st.SearchStrategy:
    """Questions of the right shape whose texts and descriptions are hostile."""
    text = hostile_values(big)
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("noul")}, optional={
            "instructions": text, "criteria": st.fixed_dictionaries({}, optional={"false": text, "true": text})}),
        st.fixed_dictionaries({"type": st.just("choice"), "criteria": st.one_of(
            st.dictionaries(st.text(min_size=1, max_size=8), text, min_size=1, max_size=6),
            st.builds(lambda n: {f"o{i}": i for i in range(n)}, st.sampled_from([2, 255, 256, 300])),
        )}, optional={"instructions": text}),
        st.fixed_dictionaries({"type": st.just("score"), "criteria": st.lists(text, min_size=1, max_size=11)},
                              optional={"instructions": text}),
    )


def well_formed_documents(big: int) -> st.SearchStrategy:
    """Requests that pass the schema, with hostile states, question texts, option counts and media."""
    return st.fixed_dictionaries(
        {
            "id": st.text(min_size=1, max_size=20),
            "questions": st.dictionaries(st.text(min_size=1, max_size=6),
                                         well_formed_question(big) | well_formed_question(big) | question_strategy(big),
                                         min_size=1, max_size=4),
        },
        optional={
            "state": hostile_values(big),
            "images": st.lists(st.sampled_from(MEDIA_REFERENCES[:-1]), max_size=2),
            "videos": st.lists(st.sampled_from(MEDIA_REFERENCES[:-1]), max_size=1),
            "permutation_average": st.none() | st.booleans(),
            "metadata": json_values,
            "unknown_field": json_values,
        },
    )


def _duplicated(doc: dict[str, Any], key: str, value: Any, first: bool) -> str:
    """JSON text of ``doc`` with ``key`` written twice (the extra ``value`` first or last)."""
    pairs = list(doc.items())
    extra = (key, value)
    pairs = [extra, *pairs] if first else [*pairs, extra]
    return "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}"


@st.composite
def encoded_records(draw, big: int = 2_000_000, well_formed: bool = False) -> tuple[bytes | None, bytes | None]:
    """(key, value) of one hostile record, in one of many encodings. ``well_formed``: mostly requests that
    pass the schema (so that what comes after decoding is fuzzed too)."""
    key = draw(st.none() | st.binary(max_size=24) | st.text(max_size=24).map(str.encode))
    kinds = ["json", "json", "json", "duplicate", "bytes", "bad-utf8", "truncate", "nest", "scalar", "tombstone"]
    if well_formed:
        kinds = ["well-formed"] * 12 + ["duplicate-well-formed"] * 2 + kinds
    how = draw(st.sampled_from(kinds))
    if how.endswith("well-formed"):
        doc = draw(well_formed_documents(big))
        if how.startswith("duplicate"):
            return key, _duplicated(doc, "state", draw(json_values), draw(st.booleans())).encode("utf-8", "surrogatepass")
        return key, json.dumps(doc).encode("utf-8", "surrogatepass")
    if how == "bytes":
        return key, draw(st.binary(max_size=300))
    if how == "nest":
        depth = draw(st.sampled_from([63, 64, 65, 1_000, 5_000, 100_000]))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        inner = '{"id": "deep", "questions": {"q": {"type": "noul"}}, "state": ' + opener * depth + "1" + closer * depth + "}"
        return key, (inner if draw(st.booleans()) else opener * depth + closer * depth).encode()
    if how == "scalar":
        return key, json.dumps(draw(json_values)).encode()
    if how == "tombstone":
        return key, None
    doc = draw(request_documents(big))
    if how == "duplicate":
        name = draw(st.sampled_from(["id", "state", "questions", "images", "metadata"]))
        text = _duplicated(doc, name, draw(json_values), draw(st.booleans()))
    else:
        text = json.dumps(doc)  # allow_nan: NaN / Infinity literals where the floats are not finite
    data = text.encode("utf-8", "surrogatepass")
    if how == "bad-utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + data[at:]
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    return key, data


# ===================================================================================== decode_request


@pytest.mark.slow  # thousands of fuzzed records, or megabytes, through a model
@settings(FUZZ, max_examples=600)
@given(encoded_records())
@example((b"k", b'{"id": "dup", "id": 7, "questions": {"q": {"type": "noul"}}}'))
@example((b"k", b'{"id": "nan", "state": NaN, "questions": {"q": {"type": "noul", "instructions": Infinity}}}'))
@example((b"k", json.dumps({"id": "ten-mb", "state": "w" * TEN_MB, "questions": {"q": {"type": "noul"}}}).encode()))
@example((b"k", json.dumps({"id": "ten-mb-array", "state": [1] * (TEN_MB // 3), "questions": {"q": Q_NOUL}}).encode()))
@example((None, b"[" * 200_000 + b"]" * 200_000))
@example((b"\xff\xfe", b"\xff\xfe\xfd"))
@example((b"k", json.dumps({"id": "opts", "questions": {"q": {"type": "choice",
                                                             "criteria": {f"o{i}": i for i in range(300)}}}}).encode()))
def test_decode_request_ends_as_a_request_or_an_error_code(case):
    key, value = case
    try:
        request = decode_request(value, key)
    except EventError as exc:
        assert exc.code in ("undecodable_event", "invalid_request"), exc.code
        assert str(exc)
        if exc.request_id is not None:
            assert isinstance(exc.request_id, str) and exc.request_id
        return
    assert isinstance(request, Request)
    assert isinstance(request.id, str) and 1 <= len(request.id) <= 512
    assert isinstance(request.questions, dict)
    assert all(isinstance(ref, str) and ref for ref in (*request.images, *request.videos))
    assert request.permutation_average in (None, True, False)


# ============================================================================ decode_request + prepare


@pytest.fixture(scope="module")
def limited_text_model(qwen35_text_model):
    """The text model with the service's prompt limit (what ``Service`` sets: max_prompt_tokens); the shared
    model gets its own limit back afterwards."""
    original = qwen35_text_model.max_length, qwen35_text_model.max_request_tokens
    qwen35_text_model.limit_prompt_tokens(Settings().limits.max_prompt_tokens)  # as Service.__init__ does
    qwen35_text_model.limit_request_tokens(Settings().limits.max_request_tokens)  # ditto
    assert qwen35_text_model.max_length is not None
    yield qwen35_text_model
    qwen35_text_model.max_length, qwen35_text_model.max_request_tokens = original


def _uniform(prepared) -> dict[Any, list[float]]:
    return {row: [1.0 / row.options] * row.options for row in prepared.rows}


@pytest.mark.slow  # thousands of fuzzed records, or megabytes, through a model
@settings(FUZZ, max_examples=250)
@given(encoded_records(big=100_000, well_formed=True))
def test_decode_and_prepare_end_as_a_prepared_request_or_a_value_error(limited_text_model, case):
    model = limited_text_model
    key, value = case
    try:
        request = decode_request(value, key)
    except EventError:
        return
    try:
        prepared = model.prepare(request.state, request.questions, decoded_images=[], decoded_videos=[],
                                 permutation_average=request.permutation_average)
    except ValueError as exc:
        assert str(exc)
        return
    assert prepared.keys == list(request.questions)
    for row in prepared.rows:
        assert row.length <= model.max_length
        assert row.key in prepared.questions and row.key not in prepared.errors
    response = prepared.answers(_uniform(prepared))
    assert list(response["answers"]) == list(request.questions)
    for answer in response["answers"].values():
        assert ("error" in answer) != ("probabilities" in answer), answer
        if "error" in answer:
            assert answer["error"] in QUESTION_ERRORS
    msgspec.json.encode(response)  # it can be published


@pytest.mark.slow  # thousands of fuzzed records, or megabytes, through a model
def test_ten_megabyte_state_is_refused_unread_or_per_question_without_truncation(limited_text_model, monkeypatch):
    wire = json.dumps({"id": "ten-mb", "state": "word " * (TEN_MB // 5), "questions": {"a": Q_NOUL}}).encode()
    with pytest.raises(EventError, match="max_request_bytes"):  # the service's default: never parsed
        decode_request(wire)
    request = decode_request(wire, limits=RequestLimits(bytes=None))
    # With the service's max_request_tokens the request is refused whole, before its prompt is tokenized.
    with pytest.raises(ValueError, match="max_request_tokens"):
        limited_text_model.prepare(request.state, request.questions, decoded_images=[], decoded_videos=[])
    # Without it, the question alone is refused, after tokenizing, and nothing is truncated.
    monkeypatch.setattr(limited_text_model, "max_request_tokens", None)
    prepared = limited_text_model.prepare(request.state, request.questions, decoded_images=[], decoded_videos=[])
    assert not prepared.rows
    assert prepared.errors["a"]["error"] == "max_length_exceeded"
    assert "nothing was truncated" in prepared.errors["a"]["message"]


# ======================================================================== the service's per-record path


class UniformModel:
    """The text model with a constant forward pass (fuzzing the input path, not the numerics)."""

    def __init__(self, model: Any):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, rows):
        return [[1.0 / row.options] * row.options for row in rows]


@pytest.fixture(scope="module")
def record_path(qwen35_text_model):
    """The request pipeline of a ``Service`` (never connected to Kafka), run on a loop in a helper thread: each
    record's published records, as the pipeline hands them to delivery."""
    # Service sets max_prompt_tokens and max_request_tokens on the shared model
    original_limit, original_request_limit = qwen35_text_model.max_length, qwen35_text_model.max_request_tokens
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hostile-loop", daemon=True)
    thread.start()
    settings_ = Settings.from_flat(metrics_port=None, media_allowlist=[], answer_topic="answers",
                         dead_letter_topic="dead-letters", s3_max_attempts=1)
    service = Service(settings_, UniformModel(qwen35_text_model))
    offsets = iter(range(10**9))

    def serve_one(key: bytes | None, value: bytes | None):
        offset = next(offsets)
        item = SimpleNamespace(topic="requests", partition=0, offset=offset, timestamp=1_700_000_000_000,
                               key=key, value=value, headers=())
        delivered: list[tuple[Any, int, list[Any]]] = []

        async def answer() -> None:
            async for answered in service.pipeline.answer([item]):
                delivered.extend(("requests-0", s.source.offset, s.records) for s in answered)

        future = asyncio.run_coroutine_threadsafe(answer(), loop)
        future.result(timeout=60)
        return delivered

    yield serve_one
    asyncio.run_coroutine_threadsafe(service.passes.close(), loop).result(timeout=30)
    service.pipeline.close()
    service.fetcher.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    qwen35_text_model.max_length, qwen35_text_model.max_request_tokens = original_limit, original_request_limit


@pytest.mark.slow  # thousands of fuzzed records, or megabytes, through a model
@settings(FUZZ, max_examples=200)
@given(encoded_records(big=100_000, well_formed=True))
@example((b"poison", b'{"id": "ok", "state": "s", "questions": {"q": {"type": "noul"}}}'))
def test_every_record_ends_as_exactly_one_answer_event(record_path, case):
    key, value = case
    deliveries = record_path(key, value)
    assert len(deliveries) == 1, deliveries
    (_, _, records) = deliveries[0]
    *extra, published = records
    assert published.topic == "answers"
    answer = decode_answer(published.value)
    ANSWER_VALIDATOR.validate(json.loads(published.value))
    assert published.key == answer.id.encode()
    assert answer.answer_id and answer.provenance.model is not None
    if answer.error is not None:
        assert answer.answers is None
        assert answer.error.code in ERROR_CODES and answer.error.code != "internal_error", answer.error
        assert answer.error.message
    else:
        assert isinstance(answer.answers, dict) and answer.answers
        for slot in answer.answers.values():
            assert ("error" in slot) != ("probabilities" in slot)
    # A dead letter exactly for the records that are not even JSON objects.
    undecodable = answer.error is not None and answer.error.code == "undecodable_event"
    assert [r.topic for r in extra] == (["dead-letters"] if undecodable else [])


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
    assert seconds < 60

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
