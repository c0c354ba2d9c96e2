"""The event contract (d3stream_client: contract, validation, schemas): checked-in schemas, request decoding, answer round trips, fuzzing."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import jsonschema
import msgspec
import pytest
from d3stream_client.contract import (
    ERROR_CODES,
    SCHEMA_VERSION,
    Answer,
    BatchRecord,
    DeadLetter,
    ErrorInfo,
    MediaRecord,
    ModelRecord,
    Provenance,
    Request,
    Source,
    Timings,
    Worker,
    decode_answer,
    encode,
)
from d3stream_client.schemas import SCHEMAS, event_avro_schema, json_schema, write_schemas
from d3stream_client.validation import (
    DEFAULT_LIMITS,
    MAX_NESTING,
    EventError,
    RequestLimits,
    decode_document,
    decode_request,
    validate_request,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "schemas"
DECODE_CODES = {"undecodable_event", "invalid_request"}
QUESTIONS = {"q": {"type": "noul", "instructions": "Is it raining?"}}


def _schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text(encoding="utf-8"))


def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = _schema(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _refused(value: bytes | None, key: bytes | None = None) -> EventError:
    with pytest.raises(EventError) as caught:
        decode_request(value, key)
    return caught.value


def _doc(**fields) -> bytes:
    return json.dumps(fields).encode()


# ------------------------------------------------------------------------------------------ schemas


@pytest.mark.parametrize("name", ["request", "answer", "dead-letter", "label", "evaluation"])
def test_checked_in_schema_matches_the_structs(name):
    path = SCHEMA_DIR / f"{name}.schema.json"
    assert path.is_file(), f"{path} is missing; run `python -m d3stream_client.schemas schemas`"
    generated = json.loads(json.dumps(json_schema(name)))
    assert _schema(name) == generated, f"{path} drifted from the d3stream_client Structs; run `python -m d3stream_client.schemas schemas`"


@pytest.mark.parametrize("name", ["request", "answer", "dead-letter", "label", "evaluation"])
def test_schema_is_a_valid_2020_12_schema_with_version(name):
    schema = _schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["x-d3stream-schema-version"] == SCHEMA_VERSION
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", ["request", "answer", "dead-letter", "label", "evaluation"])
def test_checked_in_avro_schema_matches_the_structs(name):
    path = SCHEMA_DIR / f"{name}.avsc"
    assert path.is_file(), f"{path} is missing; run `python -m d3stream_client.schemas schemas`"
    checked_in = json.loads(path.read_text(encoding="utf-8"))
    # == on the parsed JSON: an Avro record's field order matters, and dict equality ignores only key order
    assert checked_in == event_avro_schema(name), f"{path} drifted from the d3stream_client Structs; run `python -m d3stream_client.schemas schemas`"
    assert [field["name"] for field in checked_in["fields"]] == [
        field.encode_name for field in msgspec.structs.fields(SCHEMAS[name])
    ]


def test_write_schemas_writes_every_checked_in_file(tmp_path):
    written = write_schemas(tmp_path / "out")
    checked_in = [*SCHEMA_DIR.glob("*.schema.json"), *SCHEMA_DIR.glob("*.avsc")]
    assert sorted(p.name for p in written) == sorted(p.name for p in checked_in)
    assert sorted(p.name for p in written) == sorted(f"{name}{suffix}" for name in SCHEMAS
                                                     for suffix in (".schema.json", ".avsc"))
    for path in written:
        assert path.read_text(encoding="utf-8") == (SCHEMA_DIR / path.name).read_text(encoding="utf-8")


def test_request_schema_accepts_what_the_decoder_accepts_and_refuses_what_it_refuses():
    validator = _validator("request")
    good = {
        "id": "r1",
        "state": {"a": [1, 2]},
        "questions": QUESTIONS,
        "images": ["s3://b/k.png"],
        "videos": ["data:video/mp4;base64,AAAA"],
        "model": "m",
        "permutation_average": True,
        "metadata": {"trace": "x"},
    }
    validator.validate(good)
    decode_request(json.dumps(good).encode())
    for bad in (
        {"id": "r1"},  # no questions
        {"questions": QUESTIONS},  # no id
        {"id": "", "questions": QUESTIONS},
        {"id": "r1", "questions": []},
        {"id": "r1", "questions": QUESTIONS, "images": "s3://b/k.png"},
        {"id": "r1", "questions": QUESTIONS, "images": [""]},
        {"id": "r1", "questions": QUESTIONS, "permutation_average": "yes"},
        {"id": "x" * 513, "questions": QUESTIONS},
    ):
        assert not validator.is_valid(bad), bad
        assert _refused(json.dumps(bad).encode()).code == "invalid_request"


# ------------------------------------------------------------------------------------ decode_request


def test_valid_request_decodes_with_defaults():
    request = decode_request(_doc(id="r1", questions=QUESTIONS))
    assert request == Request(id="r1", questions=QUESTIONS)
    assert request.images == [] and request.videos == [] and request.state is None
    assert request.model is None and request.permutation_average is None and request.metadata is None


def test_unknown_fields_are_tolerated():
    document = {"id": "r1", "questions": QUESTIONS, "rank": 3, "extra": {"nested": [1]}}
    request = decode_request(json.dumps(document).encode())
    assert request.id == "r1" and request.questions == QUESTIONS
    _validator("request").validate(document)  # the published schema tolerates them too


@pytest.mark.parametrize(
    "value",
    [b"{not json", b"", b"\xff\xfe\x00", b'{"id": "r1", "questions": {}} trailing', b"{'id': 'single'}",
     b'{"id": "\\ud800", "questions": {}}'],
)
def test_invalid_json_is_undecodable(value):
    error = _refused(value, b"the-key")
    assert error.code == "undecodable_event"
    assert error.request_id == "the-key"
    assert "JSON" in str(error)


@pytest.mark.parametrize("value", [b"[]", b"[1, 2]", b'"a string"', b"42", b"null", b"true", b"3.5"])
def test_json_that_is_not_an_object_is_undecodable(value):
    error = _refused(value, b"k")
    assert error.code == "undecodable_event"
    assert "JSON object" in str(error)
    assert error.request_id == "k"


def test_tombstone_is_undecodable():
    error = _refused(None, b"gone")
    assert error.code == "undecodable_event" and error.request_id == "gone"


def test_missing_questions_is_invalid_with_the_id():
    error = _refused(_doc(id="has-id", state="s"), b"key-id")
    assert error.code == "invalid_request"
    assert error.request_id == "has-id"  # the document's id wins over the key
    assert "questions" in str(error)


@pytest.mark.parametrize(
    "document",
    [{"questions": QUESTIONS}, {"id": "", "questions": QUESTIONS}, {"id": 17, "questions": QUESTIONS},
     {"id": ["a"], "questions": QUESTIONS}, {"id": None}],
)
def test_request_id_falls_back_to_the_key(document):
    error = _refused(json.dumps(document).encode(), b"from-key")
    assert error.code == "invalid_request"
    assert error.request_id == "from-key"


def test_no_id_and_no_key_gives_no_request_id():
    assert _refused(_doc(questions=QUESTIONS)).request_id is None
    assert _refused(b"[]").request_id is None


def test_undecodable_key_bytes_are_replaced_not_raised():
    error = _refused(b"nope", b"\xff\xfekey")
    assert error.code == "undecodable_event"
    assert error.request_id.endswith("key")


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"id": "r", "questions": ["q"]}, "questions"),
        ({"id": "r", "questions": QUESTIONS, "images": "s3://b/k"}, "images"),
        ({"id": "r", "questions": QUESTIONS, "images": [3]}, "images"),
        ({"id": "r", "questions": QUESTIONS, "videos": [""]}, "videos"),
        ({"id": "r", "questions": QUESTIONS, "model": 5}, "model"),
        ({"id": "r", "questions": QUESTIONS, "permutation_average": "true"}, "permutation_average"),
        ({"id": "r" * 513, "questions": QUESTIONS}, "id"),
    ],
)
def test_schema_violations_are_invalid_and_name_the_field(document, where):
    error = _refused(json.dumps(document).encode(), b"k")
    assert error.code == "invalid_request"
    assert where in str(error)


def test_a_request_without_questions_is_invalid():
    # The schema allows {}: decode_request refuses it, so the client and the worker answer it alike.
    error = _refused(_doc(id="r", questions={}), b"k")
    assert (error.code, error.request_id) == ("invalid_request", "r")
    assert "the request has no questions" in str(error)


@pytest.mark.parametrize(
    ("wire", "where"),
    [
        ('{"id": "r", "state": {"x": NaN}, "questions": {"q": {"type": "noul"}}}', "NaN at state.x"),
        ('{"id": "r", "questions": {"q": {"type": "noul"}}, "metadata": [1, [2, Infinity]]}', "Infinity at metadata[1][1]"),
        ('{"id": "r", "questions": {"q": {"type": "noul"}}, "metadata": {"a": -Infinity}}', "-Infinity at metadata.a"),
        ('{"id": "r", "state": {"x": 1e400}, "questions": {"q": {"type": "noul"}}}', "1e400 at state.x"),
        ('{"id": "r", "questions": {"q": {"type": "choice", "criteria": {"a": -2E+999}}}}', "-2E+999 at questions.q.criteria.a"),
    ],
)
def test_nan_and_infinities_in_json_text_are_invalid_requests_naming_where(wire, where):
    # Not JSON (NaN, Infinity) or not a double (1e400), but a request all the same: answered invalid_request, not
    # dead-lettered as undecodable.
    error = _refused(wire.encode(), b"k")
    assert (error.code, error.request_id) == ("invalid_request", "r")
    assert f"the request has {where}: numbers must be finite" in str(error)


def test_a_nan_id_is_answered_under_the_key():
    error = _refused(b'{"id": NaN, "questions": {"q": {"type": "noul"}}}', b"the-key")
    assert (error.code, error.request_id) == ("invalid_request", "the-key")
    assert "NaN at id" in str(error)


@pytest.mark.parametrize(
    "value",
    [b'[NaN]', b'NaN', b'{"id": "r", "state": NaN', b'{"id": "\\ud800", "state": NaN}', b'{"id": "r", "state": -NaN}',
     b'{"id": "r", "state": NaN, "x": \'single\'}'],
)
def test_nan_in_what_is_no_json_object_otherwise_stays_undecodable(value):
    assert _refused(value, b"k").code == "undecodable_event"


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "document",
    [
        {"id": "r", "state": {"x": float("nan")}, "questions": QUESTIONS},
        {"id": "r", "questions": QUESTIONS, "metadata": [1.0, {"a": float("-inf")}]},
        {"id": float("inf"), "questions": QUESTIONS},
        {"id": "r", "questions": {}},
        {"id": "r", "questions": {}, "state": float("nan")},
        {"id": "r", "questions": QUESTIONS, "metadata": _nested(MAX_NESTING + 1)},
        {"id": "r", "state": float("nan"), "questions": QUESTIONS, "metadata": _nested(MAX_NESTING + 1)},
        {"id": "r", "questions": ["q"], "state": float("nan")},
        {"id": "r", "questions": ["q"]},
        {"id": "r", "questions": QUESTIONS, "state": {"x": 1.5}},
    ],
    ids=["nan", "-inf", "inf id", "no questions", "no questions and nan", "too deep", "too deep and nan",
         "schema and nan", "schema", "valid"],
)
def test_a_document_from_another_framing_gets_the_answer_its_json_text_gets(document):
    """decode_document (a record another framing decoded: a float or an Avro double can be NaN) answers what
    decode_request answers for the same document as JSON text (``json.dumps`` writes NaN and Infinity)."""
    def outcome(decode, value):
        try:
            return decode(value, b"k")
        except EventError as exc:
            return exc.code, str(exc), exc.request_id

    text = json.dumps(document).encode()
    assert outcome(decode_document, document) == outcome(decode_request, text)


def test_a_document_that_is_no_object_is_undecodable():
    with pytest.raises(EventError) as caught:
        decode_document([1, 2], b"k")
    assert (caught.value.code, caught.value.request_id) == ("undecodable_event", "k")


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 200, 5_000, 200_000])
@pytest.mark.parametrize("opener", ["[", '{"a": '])
def test_deep_nesting_is_an_invalid_request_naming_the_limit(depth, opener):
    # Deeper than msgspec's own limit (~1,000 levels) too: valid JSON, so not "not UTF-8 JSON" and no dead letter.
    closer = "]" if opener == "[" else "}"
    value = ('{"id": "deep", "questions": {}, "metadata": ' + opener * depth + "1" + closer * depth + "}").encode()
    with pytest.raises(EventError) as caught:
        decode_request(value, b"k", limits=RequestLimits(bytes=None))
    assert caught.value.code == "invalid_request" and caught.value.request_id == "deep"
    assert f"nested deeper than {MAX_NESTING}" in str(caught.value)


def test_deep_nesting_without_a_leading_id_is_answered_under_the_key():
    value = b'{"questions": {}, "metadata": ' + b"[" * 5_000 + b"]" * 5_000 + b', "id": "late"}'
    error = _refused(value, b"the-key")
    assert (error.code, error.request_id) == ("invalid_request", "the-key")
    assert f"nested deeper than {MAX_NESTING}" in str(error)


@pytest.mark.parametrize(
    "value",
    [b"[" * 5_000 + b"]" * 5_000, b'{"id": "x", "state": ' + b"[" * 5_000 + b"\xff" + b"]" * 5_000 + b"}"],
    ids=["a deep array", "deep and not UTF-8"],
)
def test_deep_records_that_are_no_request_stay_undecodable(value):
    assert _refused(value, b"k").code == "undecodable_event"


def test_nesting_at_the_limit_is_accepted():
    depth = MAX_NESTING - 2  # the request object and its metadata field count as levels
    value = b'{"id": "ok", "questions": {"q": {}}, "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    assert decode_request(value).id == "ok"


def test_deeply_nested_state_is_refused_too():
    state = "x"
    for _ in range(MAX_NESTING + 5):
        state = {"k": state}
    assert _refused(_doc(id="r", questions=QUESTIONS, state=state)).code == "invalid_request"


def test_huge_but_flat_request_decodes_when_the_byte_limit_allows():
    value = _doc(id="big", questions=QUESTIONS, state="x" * 2_000_000)
    request = decode_request(value, limits=RequestLimits(bytes=None))
    assert len(request.state) == 2_000_000
    # With the default max_request_bytes it is refused unread, under its key.
    with pytest.raises(EventError, match="max_request_bytes") as refused:
        decode_request(value, b"big-key")
    assert refused.value.code == "invalid_request" and refused.value.request_id == "big-key"


def test_error_codes_are_the_documented_ones():
    assert set(ERROR_CODES) >= {
        "undecodable_event", "invalid_request", "model_not_served", "media_not_allowed", "media_missing",
        "media_too_large", "media_unreadable", "media_unavailable",
    }


# ------------------------------------------------------------------------------------------ answers


def _full_answer() -> Answer:
    return Answer(
        id="r1",
        source=Source(topic="d3.requests", partition=2, offset=41, timestamp=1_700_000_000_000),
        model="tiny",
        answers={"q": {"type": "noul", "noul": 0.7, "probabilities": {"false": 0.3, "true": 0.7}}},
        usage={"input_tokens": 120, "output_tokens": 0},
        provenance=Provenance(
            model=ModelRecord(name="tiny", runtime="d3-runtime", provenance_sha256="ab" * 32),
            media=[
                MediaRecord(uri="s3://b/k.png", etag="e" * 32, version=None, bytes=1234, sha256="cd" * 32),
                MediaRecord(uri="data:image/png", bytes=10, sha256="ef" * 32),
            ],
            batch=BatchRecord(passes=2, rows=9, real_tokens=700, padded_tokens=900),
            timings=Timings(queued=1.5, fetch=3.0, decode=2.0, prepare=4.0, forward=20.0, total=31.0),
            worker=Worker(host="h", pid=123, version="0.1.0"),
        ),
        metadata={"trace": [1, 2, 3]},
    )


def _error_answer() -> Answer:
    return Answer(
        id="bad",
        source=Source(topic="t", partition=0, offset=0),
        model="tiny",
        error=ErrorInfo(code="media_missing", message="s3://b/k does not exist"),
        provenance=Provenance(
            model=ModelRecord(name="tiny", runtime="r", provenance_sha256="00" * 32),
            worker=Worker(host="h", pid=1, version="v"),
        ),
    )


@pytest.mark.parametrize("make", [_full_answer, _error_answer])
def test_answers_round_trip_through_the_checked_in_schema(make):
    answer = make()
    wire = encode(answer)
    document = json.loads(wire)
    _validator("answer").validate(document)
    assert decode_answer(wire) == answer
    assert document["provenance"]["model"]["provenance_sha256"] == answer.provenance.model.provenance_sha256
    if answer.error:
        assert "answers" not in document and "usage" not in document
        assert document["error"] == {"code": answer.error.code, "message": answer.error.message}
    else:
        assert "error" not in document


def test_answer_schema_refuses_malformed_answers():
    validator = _validator("answer")
    document = json.loads(encode(_full_answer()))
    for broken in (
        {k: v for k, v in document.items() if k != "source"},
        {**document, "usage": {"input_tokens": "many"}},
        {**document, "error": {"code": "x"}},
        {**document, "provenance": {**document["provenance"], "worker": {"host": "h"}}},
    ):
        assert not validator.is_valid(broken)


def test_dead_letter_round_trip_through_the_checked_in_schema():
    raw = b"\x00\xffnot json"
    letter = DeadLetter(
        reason="the record is not UTF-8 JSON",
        source=Source(topic="t", partition=1, offset=7, timestamp=5),
        key="k",
        value=base64.b64encode(raw).decode(),
    )
    document = json.loads(encode(letter))
    _validator("dead-letter").validate(document)
    assert base64.b64decode(document["value_base64"]) == raw
    assert msgspec.json.decode(encode(letter), type=DeadLetter) == letter


# ------------------------------------------------------------------------------------------ fuzzing

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
huge_text = st.integers(min_value=10_000, max_value=600_000).map(lambda n: "\u00e9x" * (n // 2))
field_value = st.one_of(json_value, huge_text, st.just(QUESTIONS), st.lists(st.text(max_size=20), max_size=3))
request_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(max_size=600), json_value, huge_text),
        "state": field_value,
        "questions": field_value,
        "images": field_value,
        "videos": field_value,
        "model": field_value,
        "permutation_average": field_value,
        "metadata": field_value,
    },
)
keys = st.one_of(st.none(), st.binary(max_size=20))


def _check_contract(value: bytes | None, key: bytes | None) -> None:
    try:
        request = decode_request(value, key)
    except EventError as exc:
        assert exc.code in DECODE_CODES, exc.code
        assert exc.request_id is None or isinstance(exc.request_id, str)
        assert str(exc)
        return
    # Anything accepted satisfies the schema the answer depends on.
    assert isinstance(request, Request)
    assert isinstance(request.id, str) and 1 <= len(request.id) <= 512
    assert isinstance(request.questions, dict) and request.questions
    assert all(isinstance(m, str) and m for m in (*request.images, *request.videos))
    assert request.model is None or isinstance(request.model, str)
    assert request.permutation_average in (None, True, False)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(value=st.binary(max_size=300), key=keys)
def test_fuzz_random_bytes(value, key):
    _check_contract(value, key)


@FUZZ
@given(value=json_value, key=keys)
def test_fuzz_random_json_values(value, key):
    _check_contract(json.dumps(value).encode(), key)


@FUZZ
@given(document=request_like, key=keys)
def test_fuzz_request_shaped_objects_with_wrong_types(document, key):
    _check_contract(json.dumps(document).encode(), key)


@FUZZ
@given(document=request_like, cut=st.integers(min_value=0, max_value=400), junk=st.binary(max_size=8))
def test_fuzz_truncated_and_corrupted_requests(document, cut, junk):
    wire = json.dumps(document).encode()
    _check_contract(wire[: cut % (len(wire) + 1)] + junk, None)


non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
value_with_non_finite = st.recursive(
    st.one_of(json_leaf, non_finite),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _outcome(check, value) -> tuple[str, str, str | None] | None:
    try:
        check(value)
    except EventError as exc:
        return exc.code, str(exc), exc.request_id
    return None


@FUZZ
@given(state=value_with_non_finite, metadata=value_with_non_finite)
def test_fuzz_the_client_and_the_worker_answer_nan_and_infinities_alike(state, metadata):
    """A document with NaN or an infinity anywhere: the client's check of it (before encoding) and the worker's of the
    JSON text ``json.dumps`` makes of it (NaN, Infinity) give the same answer; without one, both accept it."""
    document = {"id": "r", "state": state, "questions": QUESTIONS, "metadata": metadata}
    client = _outcome(validate_request, document)
    assert client == _outcome(decode_request, json.dumps(document).encode())
    assert (client is None) == (not _holds_non_finite([state, metadata]))


def _holds_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_holds_non_finite(item) for item in items)


# ----------------------------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize(
    ("wire", "key"),
    [
        ('{"id": "a", "id": "b", "questions": {"q": {"type": "noul"}}}', "id"),
        ('{"id": "r", "questions": {"q": {"type": "noul"}, "q": {"type": "choice"}}}', "q"),
        ('{"id": "r", "questions": {"q": {"type": "noul", "type": "score"}}}', "type"),
        ('{"id": "r", "state": {"a": {"b": [{"c": 1, "c": 2}]}}, "questions": {"q": {"type": "noul"}}}', "c"),
        ('{"id": "r", "questions": {"q": {"type": "choice", "criteria": {"x": 1, "x": 2}}}}', "x"),
        ('{"id": "r", "metadata": {"m:n": 1, "m:n": 2}, "questions": {"q": {"type": "noul"}}}', "m:n"),
    ],
)
def test_duplicate_keys_are_refused_naming_the_key(wire, key):
    refused = _refused(wire.encode())
    assert refused.code == "invalid_request"
    assert f"key {key!r} twice" in str(refused)


def test_colons_in_strings_and_escaped_colons_are_not_duplicates():
    wire = (
        '{"id": "r:1", "state": {"url": "http://x:80/a:b", "k\\u003ay": "v\\u003a", "a": "\\"b\\":c"},'
        ' "questions": {"q:1": {"type": "noul", "instructions": "at 10:30?"}}}'
    )
    request = decode_request(wire.encode())
    assert request.state == {"url": "http://x:80/a:b", "k:y": "v:", "a": '"b":c'}


@FUZZ
@given(document=json_value, name=st.text(max_size=8))
def test_fuzz_a_duplicated_key_anywhere_is_refused(document, name):
    """Insert the same key twice into the state (at the top or inside the document): always refused."""
    state = json.dumps(document)
    twice = f'{{{json.dumps(name)}: 1, "inner": {state}, {json.dumps(name)}: 2}}'
    wire = f'{{"id": "r", "state": {twice}, "questions": {json.dumps(QUESTIONS)}}}'.encode()
    refused = _refused(wire)
    assert refused.code == "invalid_request" and "twice" in str(refused)
    # Without the duplicate the same document is a request.
    once = f'{{"id": "r", "state": {{"inner": {state}}}, "questions": {json.dumps(QUESTIONS)}}}'.encode()
    assert decode_request(once).state == {"inner": document}


# ------------------------------------------------------------------------------------- request limits


def test_each_request_limit_refuses_naming_its_setting():
    limits = RequestLimits(bytes=2_000, questions=3, options=10)
    cases = {
        "max_request_bytes": _doc(id="r", questions=QUESTIONS, state="x" * 2_000),
        "max_request_questions": _doc(id="r", questions={f"q{i}": QUESTIONS["q"] for i in range(4)}),
        "max_request_options": _doc(
            id="r", questions={"a": {"type": "score", "criteria": list("abcdefghi")}, "b": {"type": "noul"}}
        ),
    }
    for setting, value in cases.items():
        with pytest.raises(EventError, match=setting) as refused:
            decode_request(value, b"k", limits)
        assert refused.value.code == "invalid_request"
    # At each limit exactly, accepted.
    decode_request(_doc(id="r", questions={f"q{i}": QUESTIONS["q"] for i in range(3)}), None, limits)
    decode_request(_doc(id="r", questions={"a": {"type": "choice", "criteria": dict.fromkeys("abcdefgh")},
                                           "b": {"type": "noul"}}), None, limits)


def test_request_limits_come_from_the_settings():
    from d3stream.settings import Settings

    limits = RequestLimits.from_settings(
        Settings.from_flat(max_request_bytes=None, max_request_questions=5, max_request_options=7)
    )
    assert limits == RequestLimits(bytes=None, questions=5, options=7, media_references=32)
    assert RequestLimits.from_settings(Settings()) == DEFAULT_LIMITS
