"""Avro written and read by compiled code (d3stream_client.avro_binary) against the general path it stands in for:
``to_avro`` and fastavro's writer, fastavro's reader and ``from_avro``.

The compiled code must write byte for byte what fastavro writes, read the document ``from_avro`` makes, and
leave to the general path whatever it does not take, so that what a registry user sees (bytes, documents,
refusals) does not depend on which path ran.
"""

from __future__ import annotations

import io
import json
import random

import fastavro
import msgspec
import pytest
from d3stream_client import avro_binary
from d3stream_client.avro import avro_schema, from_avro, to_avro
from d3stream_client.contract import (
    Answer,
    BatchRecord,
    Cost,
    DeadLetter,
    ErrorInfo,
    Evaluation,
    Label,
    LabelledQuestion,
    MediaRecord,
    ModelRecord,
    Provenance,
    Request,
    Source,
    Timings,
    Worker,
)
from d3stream_client.registry import AvroCodec
from d3stream_client.validation import EventError, decode_request

from tests.unit.client.test_avro import QUESTIONS, REQUEST, _answer


def parsed(schema: object) -> dict[str, object]:
    result = fastavro.parse_schema(schema)
    assert isinstance(result, dict)
    return result


def fastavro_bytes(document: dict[str, object], event: type[msgspec.Struct], schema: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema, to_avro(document, event, fastavro_unions=True))
    return out.getvalue()


def fastavro_document(value: bytes, event: type[msgspec.Struct], schema: dict[str, object],
                      lean: bool = False) -> dict[str, object]:
    datum = fastavro.schemaless_reader(io.BytesIO(value), schema, None)
    assert isinstance(datum, dict)
    return from_avro(datum, event, lean=lean)


def exact(document: object) -> str:
    return json.dumps(document, sort_keys=True)


def document_of(read: dict[str, object]) -> object:
    """A compiled reader's document as its JSON says (a lean one holds JSON text as ``msgspec.Raw``)."""
    return msgspec.json.decode(msgspec.json.encode(read))


def random_answer(rng: random.Random) -> Answer:
    """An answer with a spread of values: small and huge longs, negative ones, unicode, strings past the
    two-byte length, empty and many-entry maps, absent optional parts."""
    def text(longest: int) -> str:
        alphabet = "abcxyz ÉéßΩ漢字🙂\"\\\n"
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, longest)))

    def long() -> int:
        return rng.choice([0, 1, -1, 63, 64, -65, 8191, 8192, 2**31, -(2**40), 2**63 - 1, -(2**63),
                           rng.randint(-(2**62), 2**62)])

    def size() -> int:
        return rng.choice([0, 1, 63, 64, 8191, 8192, 2**31, 2**63 - 1, rng.randint(0, 2**62)])

    options = {text(8) or "o": rng.random() for _ in range(rng.choice([0, 1, 3, 40]))}
    media = [MediaRecord(uri=text(30), etag=rng.choice([None, text(32)]), version=rng.choice([None, "3"]),
                         bytes=size(), sha256="ab" * 32) for _ in range(rng.choice([0, 1, 3]))]
    return Answer(
        id=text(rng.choice([20, 9000])) or "id",
        answer_id=rng.choice(["", text(32)]),
        source=Source(topic=text(20) or "t", partition=rng.randint(0, 300), offset=size(),
                      timestamp=rng.choice([None, 1_796_442_984_206, long()])),
        model=rng.choice([None, text(12)]),
        answers=rng.choice([None, {}, {"q": {"type": "choice", "probabilities": options, "confidence": rng.random()}}]),
        usage=rng.choice([None, {"input_tokens": size(), "output_tokens": 0}]),
        error=rng.choice([None, ErrorInfo(code="media_missing", message=text(200), late_ms=rng.choice([None, long()]))]),
        provenance=Provenance(
            model=rng.choice([None, ModelRecord(name=text(10), runtime="r", provenance_sha256="cd" * 32)]),
            media=media,
            batch=BatchRecord(passes=rng.randint(0, 9), rows=rng.randint(0, 9000), real_tokens=size(),
                              padded_tokens=4096, shared_prefix=rng.random() < 0.5, saved_tokens=0),
            timings=Timings(queued=rng.random() * 1e3, fetch=0.0, decode=-1.5, prepare=1e300, forward=5e-324,
                            total=rng.random()),
            cost=rng.choice([None, Cost(tenant=rng.choice([None, "acme"]), prompt_tokens=192, padded_tokens=192,
                                        device_seconds=rng.random(), media_bytes=size(),
                                        vision_seconds=rng.choice([None, 0.5]))]),
            worker=rng.choice([None, Worker(host=text(10), pid=rng.randint(1, 4_000_000), version="0.1.0")]),
            replay_id=rng.choice([None, text(12)]),
        ),
        metadata=rng.choice([None, {"trace": [1, 2.5, None, True, "x"]}, "plain", 7]),
    )


ANSWER_SCHEMA = parsed(avro_schema(Answer))


@pytest.mark.parametrize("seed", range(60))
def test_compiled_answers_are_fastavros_bytes_and_read_back_as_from_avro_reads_them(seed):
    answer = random_answer(random.Random(seed))
    document = msgspec.to_builtins(answer)
    expected = fastavro_bytes(document, Answer, ANSWER_SCHEMA)
    assert avro_binary.compile_writer(ANSWER_SCHEMA, Answer)(document) == expected
    assert avro_binary.compile_writer(ANSWER_SCHEMA, Answer, from_struct=True)(answer) == expected
    for lean in (False, True):
        read = avro_binary.compile_reader(ANSWER_SCHEMA, Answer, lean=lean)
        assert exact(document_of(read(expected))) == exact(fastavro_document(expected, Answer, ANSWER_SCHEMA, lean))
    assert msgspec.json.decode(msgspec.json.encode(avro_binary.compile_reader(ANSWER_SCHEMA, Answer)(expected)),
                               type=Answer) == msgspec.json.decode(msgspec.json.encode(answer), type=Answer)


def examples() -> list[msgspec.Struct]:
    """One of every event, with its optional parts present and absent."""
    request = msgspec.convert(REQUEST, Request)
    return [
        request, Request(id="r", questions={"q": QUESTIONS["refund"]}), _answer(),
        Answer(id="r", source=Source(topic="t", partition=0, offset=0)),
        DeadLetter(reason="not JSON", source=Source(topic="t", partition=1, offset=5, timestamp=7), key="k1",
                   value="e30=", value_bytes=9000, value_sha256="ab" * 32, value_truncated=True),
        Label(id="r", labels={"refund": True, "urgency": 2, "team": "billing", "digit": "1", "zero": 0},
              labeled_at=1_700_000_100_000, source="agent", metadata={"ticket": 1}),
        Evaluation(id="r", model="tiny", role="shadow", answer=Source(topic="a", partition=2, offset=41),
                   label=Source(topic="l", partition=2, offset=3), labeled_at=5, lag_ms=-250,
                   questions={"refund": LabelledQuestion(type="noul", label=True, label_option="true",
                                                         predicted="true", p_label=0.8, confidence=0.8, correct=True,
                                                         brier=0.08, log_loss=0.22)}),
    ]


@pytest.mark.parametrize("event_value", examples(), ids=lambda value: type(value).__name__)
def test_every_event_compiles_and_matches_the_general_path(event_value):
    event = type(event_value)
    schema = parsed(avro_schema(event))
    document = msgspec.to_builtins(event_value)
    expected = fastavro_bytes(document, event, schema)
    assert avro_binary.compile_writer(schema, event)(document) == expected
    assert avro_binary.compile_writer(schema, event, from_struct=True)(event_value) == expected
    for lean in (False, True):
        assert exact(document_of(avro_binary.compile_reader(schema, event, lean=lean)(expected))) == \
            exact(fastavro_document(expected, event, schema, lean))


def test_a_lean_request_leaves_its_defaults_out_and_decodes_to_the_same_request():
    request = Request(id="r", questions={"q": QUESTIONS["refund"]})
    schema = parsed(avro_schema(Request))
    value = avro_binary.compile_writer(schema, Request, from_struct=True)(request)
    lean = avro_binary.compile_reader(schema, Request, lean=True)(value)
    assert set(lean) == {"id", "questions"}  # state None, no images, priority normal...: all left out
    assert msgspec.json.decode(msgspec.json.encode(lean), type=Request) == msgspec.convert(
        avro_binary.compile_reader(schema, Request)(value), Request) == request


def test_a_lean_document_keeps_json_text_as_it_came_for_its_reader_to_check():
    """Lean JSON text is checked for syntax and passed on unparsed: the request checks that follow see it as a
    JSON producer wrote it (a duplicate key in a question is refused there, as in a plain JSON request)."""
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    datum = to_avro(dict(REQUEST), Request)
    datum["questions"]["refund"] = '{"type": "noul", "type": "choice"}'
    out = io.BytesIO()
    fastavro.schemaless_writer(out, REQUEST_SCHEMA, datum)
    assert b'{"type": "noul", "type": "choice"}' in codec.read(out.getvalue(), lean=True)
    assert b'{"type":"choice"}' in codec.read(out.getvalue())  # parsed: the first "type" silently lost
    with pytest.raises(EventError, match="the key 'type' twice"):
        decode_request(codec.read(out.getvalue(), lean=True))


# ------------------------------------------------------------------------------------ other writer schemas


def later_answer_schema() -> dict[str, object]:
    """The Answer schema a registry holds after a producer added a field with a default at the front, and a
    nested one in Source."""
    schema = avro_schema(Answer)
    fields = schema["fields"]
    assert isinstance(fields, list)
    fields.insert(0, {"name": "region", "type": "string", "default": "eu-west"})
    source = next(field for field in fields if field["name"] == "source")
    source["type"]["fields"].append({"name": "lag_ms", "type": ["null", "long"], "default": None})
    return parsed(schema)


def test_a_later_writer_schema_gets_its_defaults_and_its_records_read_as_the_contract_reads_them():
    schema = later_answer_schema()
    answer = random_answer(random.Random(7))
    document = msgspec.to_builtins(answer)
    expected = fastavro_bytes(document, Answer, schema)
    assert avro_binary.compile_writer(schema, Answer, from_struct=True)(answer) == expected
    assert expected.startswith(b"\x0eeu-west")  # the added field, written as its default
    read = avro_binary.compile_reader(schema, Answer)(expected)
    assert "region" not in read and exact(read) == exact(fastavro_document(expected, Answer, schema))


def test_an_earlier_writer_schema_without_a_field_reads_it_as_its_default():
    schema = avro_schema(Request)
    fields = schema["fields"]
    assert isinstance(fields, list)
    schema["fields"] = [field for field in fields if field["name"] not in ("priority", "tenant")]
    earlier = parsed(schema)
    value = fastavro_bytes(dict(REQUEST), Request, earlier)
    read = avro_binary.compile_reader(earlier, Request)(value)
    assert read["priority"] == "normal" and read["tenant"] is None
    assert exact(read) == exact(fastavro_document(value, Request, earlier))


def test_a_schema_the_compiled_writer_does_not_cover_is_written_by_fastavro_and_read_compiled():
    schema = avro_schema(Request)
    fields = schema["fields"]
    assert isinstance(fields, list)
    priority = next(field for field in fields if field["name"] == "priority")
    priority["type"] = {"type": "enum", "name": "Priority", "symbols": ["low", "normal", "high"]}
    with_enum = parsed(schema)
    with pytest.raises(avro_binary.NotCompilable, match="enum"):
        avro_binary.compile_writer(with_enum, Request)
    codec = AvroCodec(with_enum, Request)
    value = codec.write(dict(REQUEST))
    assert value == fastavro_bytes(dict(REQUEST), Request, with_enum)
    assert json.loads(codec.read(value))["priority"] == "high"


# ------------------------------------------------------------------------------------ what it leaves to fastavro


REQUEST_SCHEMA = parsed(avro_schema(Request))


def test_a_value_the_compiled_code_does_not_take_gets_fastavros_bytes_or_refusal():
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    writer = avro_binary.compile_writer(REQUEST_SCHEMA, Request)
    lenient = {**REQUEST, "images": ("s3://b/k.png",)}  # a tuple: to_avro takes it for an array
    with pytest.raises(Exception):  # noqa: B017, PT011 - not the compiled code's to decide
        writer(lenient)
    assert codec.write(lenient) == fastavro_bytes(lenient, Request, REQUEST_SCHEMA)
    with pytest.raises(ValueError, match="'soon'.*do not match.*deadline"):  # fastavro's refusal, naming the field
        codec.write({**REQUEST, "deadline": "soon"})
    with pytest.raises(ValueError, match=r"\$\.questions.*required"):
        codec.write({"id": "r1"})


@pytest.mark.parametrize("cut", [1, 10, 40, -1])
def test_a_truncated_payload_is_a_value_error(cut):
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    value = codec.write(dict(REQUEST))
    with pytest.raises(ValueError):
        codec.read(value[:cut])


def test_a_union_index_past_its_branches_is_a_value_error():
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    value = bytearray(codec.write({"id": "r", "questions": {"q": QUESTIONS["refund"]}}))
    state_index = 1 + len(b"r")  # after the id's length and text
    value[state_index] = 0x08  # union branch 4 of ["null", "string"]
    with pytest.raises(ValueError):
        codec.read(bytes(value))


@pytest.mark.parametrize("lean", [False, True])
def test_json_text_that_does_not_parse_is_refused_naming_the_field(lean):
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    datum = to_avro(dict(REQUEST), Request)
    datum["state"] = "charged twice"
    out = io.BytesIO()
    fastavro.schemaless_writer(out, REQUEST_SCHEMA, datum)
    with pytest.raises(ValueError, match=r"\$\.state.* not JSON text"):
        codec.read(out.getvalue(), lean=lean)


# ------------------------------------------------------------------------------------ bounded by the bytes given


def test_a_count_beyond_the_bytes_left_is_refused_before_any_item_is_read():
    """An array that claims 2^31 items in a handful of bytes: refused at once, naming the field and the claim."""
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    value = codec.write({"id": "r", "questions": {"q": QUESTIONS["refund"]}})
    # The questions map's count is the byte after the id ("r") and the state's null branch.
    claim = bytes([0x80, 0x80, 0x80, 0x80, 0x10])  # zigzag 2^31
    forged = value[:3] + claim + value[4:]
    with pytest.raises(avro_binary.PayloadError, match=r"\$\.questions: 2,147,483,648 entries claimed at byte 3"):
        codec.read(forged)


@pytest.mark.parametrize(("cut", "where"), [(0, r"\$\.id: the payload is empty where a string's length was expected"),
                                            (2, r"\$\.id: the payload ends at byte 2 where a string of \d+ bytes was expected \(at byte 1")])
def test_a_truncated_payload_says_what_was_expected_and_at_which_byte(cut, where):
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    value = codec.write(dict(REQUEST))
    with pytest.raises(avro_binary.PayloadError, match=where):
        codec.read(value[:cut])


def test_json_text_nested_past_any_reader_is_too_deep_not_a_crash():
    codec = AvroCodec(REQUEST_SCHEMA, Request)
    marker = b'{"m":1}'
    value = codec.write({**REQUEST, "state": {"m": 1}})
    deep = b"[" * 20_000 + b"]" * 20_000
    size = avro_binary._varlong(len(deep))  # noqa: SLF001 - the length prefix of the forged text
    forged = value.replace(avro_binary._varlong(len(marker)) + marker, size + deep)  # noqa: SLF001
    with pytest.raises(avro_binary.PayloadError) as refused:
        codec.read(forged, lean=True)
    assert refused.value.too_deep and "$.state" in str(refused.value)


def test_enum_fixed_and_bytes_in_a_later_writer_schema_are_read_by_the_compiled_reader():
    schema = avro_schema(Request)
    fields = schema["fields"]
    assert isinstance(fields, list)
    schema["fields"] = [*fields,
                        {"name": "tier", "type": {"type": "enum", "name": "Tier", "symbols": ["a", "b"]}, "default": "a"},
                        {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}, "default": "abcd"},
                        {"name": "blob", "type": "bytes", "default": ""},
                        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}, "default": 0}]
    later = parsed(schema)
    datum = {**to_avro(dict(REQUEST), Request), "tier": "b", "digest": b"wxyz", "blob": b"\x00\x01", "at": 5}
    out = io.BytesIO()
    fastavro.schemaless_writer(out, later, datum)
    read = avro_binary.compile_reader(later, Request)(out.getvalue())
    assert msgspec.convert(read, Request) == msgspec.convert(dict(REQUEST), Request)
    with pytest.raises(avro_binary.PayloadError, match="symbol index"):  # an enum index past its symbols
        AvroCodec(later, Request).read(out.getvalue().replace(b"\x02wxyz", b"\x08wxyz"))
