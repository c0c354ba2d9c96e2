"""Hostile input, fuzzed (hypothesis, 1,050 examples in all): random bytes, invalid UTF-8, deep nesting, huge
strings and arrays, NaN/Infinity, wrong types, unknown fields, 300 options, duplicate keys, 10 MB records, 2 MB
states.

Every input ends as a ``Request`` or an ``EventError`` with an error code (``decode_request``); as a prepared
request or a ``ValueError`` (``decode_request`` + ``model.prepare``); and, through the service's own per-record
path (``RequestPipeline.serve``, no broker), as exactly one answer event with an error code or answers --
never another exception. Hostile media, access and SASL on the real broker: tests/integration/test_hostile.py.
"""


from __future__ import annotations

import asyncio
import base64
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest
from d3stream_client.contract import ERROR_CODES, Request, decode_answer
from d3stream_client.validation import EventError, RequestLimits, decode_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from d3stream.runtime.questions import ERRORS as QUESTION_ERRORS
from d3stream.service import Service
from d3stream.settings import Settings
from tests.support.media_makers import make_jpeg, make_png
from tests.support.stream_helpers import Q_NOUL

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
ANSWER_VALIDATOR = jsonschema.Draft202012Validator(json.loads((REPO / "schemas" / "answer.schema.json").read_text()))
FUZZ = settings(
    deadline=None,
    database=None,  # no .hypothesis folder in the work tree
    derandomize=True,  # the same examples on every run and machine: a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
TEN_MB = 10 * 1024 * 1024
# Eight times max_request_bytes' default, and 420,000 prompt tokens (max_request_tokens: 262,144): past every limit
# a state can meet, at a fifth of the tokenizing that ten megabytes took.
TWO_MB = 2 * 1024 * 1024


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
    qwen35_text_model.limit_prompt_tokens(Settings().limits.max_prompt_tokens)  # as the service's hosting does
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
def test_a_two_megabyte_state_is_refused_unread_or_per_question_without_truncation(limited_text_model, monkeypatch):
    wire = json.dumps({"id": "two-mb", "state": "word " * (TWO_MB // 5), "questions": {"a": Q_NOUL}}).encode()
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
    asyncio.run_coroutine_threadsafe(service.default.passes.close(), loop).result(timeout=30)
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
