"""The events in Avro (d3stream_client.avro): schemas generated from the Structs, and each event's JSON document
through Avro binary and back.

The round trips compare with the exact JSON text of both sides (``_exact``) as well as with ``==``: in Python
``True == 1`` and ``1 == 1.0``, and a label's ``true``, ``1`` and ``"1"`` must stay three different answers.
"""

from __future__ import annotations

import io
import json
from typing import Annotated, Any

import fastavro
import msgspec
import pytest
from d3stream_client.avro import NAMESPACE, avro_schema, from_avro, to_avro
from d3stream_client.contract import (
    SCHEMA_VERSION,
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
from d3stream_client.schemas import SCHEMAS
from d3stream_client.validation import decode_request

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
             "criteria": {"billing": "payments, charges, invoices", "tech": "bugs, errors, crashes, login"}},
    "refund": {"type": "noul", "instructions": "Does the customer ask for their money back?"},
    "urgency": {"type": "score", "instructions": "How urgent is the ticket?", "criteria": ["low", "normal", "urgent"]},
}
REQUEST = {
    "id": "ticket-1001",
    "state": {"ticket": 1001, "text": "I was charged twice.", "tags": ["billing", None], "score": 0.5, "vip": True},
    "questions": QUESTIONS,
    "images": ["s3://tickets/1001.png?versionId=3", "data:image/png;base64,iVBORw0KGgo="],
    "metadata": {"queue": "support-eu", "attempt": 2},
    "deadline": 1_700_000_060_000,
    "priority": "high",
}


def _exact(document: object) -> str:
    return json.dumps(document, sort_keys=True)


def _write(datum: dict[str, object], event: type[msgspec.Struct]) -> bytes:
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(avro_schema(event)), datum)
    return buffer.getvalue()


def _read(value: bytes, event: type[msgspec.Struct]) -> dict[str, object]:
    schema = fastavro.parse_schema(avro_schema(event))
    datum = fastavro.schemaless_reader(io.BytesIO(value), schema, None)
    assert isinstance(datum, dict)
    return datum


def _through_avro(document: dict[str, object], event: type[msgspec.Struct]) -> dict[str, object]:
    """document -> to_avro -> Avro binary -> from_avro."""
    return from_avro(_read(_write(to_avro(document, event), event), event), event)


def _round_trips(event_value: msgspec.Struct) -> None:
    """A Struct's JSON document comes back exactly: the contract's encoder's form (defaults left out where
    the Struct leaves them out), every value of its JSON type. Its datum in fastavro's union form writes
    the same bytes as the plain datum."""
    document = msgspec.to_builtins(event_value)
    event = type(event_value)
    assert _write(to_avro(document, event, fastavro_unions=True), event) == _write(to_avro(document, event), event)
    back = _through_avro(document, event)
    assert back == document
    assert _exact(back) == _exact(document)
    assert msgspec.convert(back, type(event_value)) == event_value


# ------------------------------------------------------------------------------------------ schemas


def _named(schema: object, names: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The records a schema defines, by name."""
    if isinstance(schema, list):
        for branch in schema:
            _named(branch, names)
    elif isinstance(schema, dict):
        if schema["type"] == "record":
            names[schema["name"]] = schema
            for field in schema["fields"]:
                _named(field["type"], names)
        else:
            _named(schema.get("items", schema.get("values")), names)
    return names


def _valid_default(value: object, schema: object, names: dict[str, dict[str, Any]]) -> bool:
    """Whether ``value`` is a valid Avro default of ``schema``, by the spec's strictest reading (a union's
    default is of its first branch). fastavro does not check defaults; a Schema Registry does."""
    if isinstance(schema, list):
        return _valid_default(value, schema[0], names)
    if isinstance(schema, str):
        if schema in names:
            schema = names[schema]
        else:
            return {
                "null": value is None,
                "boolean": isinstance(value, bool),
                "long": isinstance(value, int) and not isinstance(value, bool),
                "double": isinstance(value, int | float) and not isinstance(value, bool),
                "string": isinstance(value, str),
            }[schema]
    assert isinstance(schema, dict)
    if schema["type"] == "array":
        return isinstance(value, list) and all(_valid_default(item, schema["items"], names) for item in value)
    if schema["type"] == "map":
        return isinstance(value, dict) and all(_valid_default(item, schema["values"], names) for item in value.values())
    assert schema["type"] == "record"
    return isinstance(value, dict) and set(value) <= {field["name"] for field in schema["fields"]} and all(
        _valid_default(value[field["name"]], field["type"], names) if field["name"] in value else "default" in field
        for field in schema["fields"]
    )


def test_the_default_check_can_fail():
    assert not _valid_default(5, ["null", "long"], {})
    assert not _valid_default(True, "long", {})
    assert not _valid_default({"passes": "0"}, {"type": "record", "name": "R", "fields": [
        {"name": "passes", "type": "long", "default": 0}]}, {})


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_event_schema_parses_and_its_defaults_are_valid(name):
    event = SCHEMAS[name]
    schema = avro_schema(event)
    parsed = fastavro.parse_schema(schema)
    assert parsed["name"] == f"d3stream.v{SCHEMA_VERSION}.{event.__name__}"
    assert schema["namespace"] == NAMESPACE == f"d3stream.v{SCHEMA_VERSION}"
    # every field of the Struct, in order, by the name its JSON form carries
    assert [field["name"] for field in schema["fields"]] == [
        field.encode_name for field in msgspec.structs.fields(event)
    ]
    names = _named(schema, {})
    for record in names.values():
        for field in record["fields"]:
            if "default" in field:
                assert _valid_default(field["default"], field["type"], names), (record["name"], field)
    assert json.loads(json.dumps(schema)) == schema  # plain JSON, as the .avsc file holds it


def test_request_schema_maps_the_contract_types():
    fields = {field["name"]: field for field in avro_schema(Request)["fields"]}
    assert fields["id"] == {"name": "id", "type": "string", "doc": "request id; also the Kafka key"}
    assert fields["state"]["type"] == ["null", "string"] and fields["state"]["default"] is None
    assert "JSON text" in fields["state"]["doc"] and "JSON text" in fields["metadata"]["doc"]
    assert fields["questions"]["type"] == {"type": "map", "values": "string"}
    assert "JSON text" in fields["questions"]["doc"] and "noul" in fields["questions"]["doc"]
    assert fields["images"]["type"] == {"type": "array", "items": "string"} and fields["images"]["default"] == []
    assert fields["deadline"]["type"] == ["null", "long"] and "epoch milliseconds" in fields["deadline"]["doc"]
    assert fields["priority"]["type"] == "string" and fields["priority"]["default"] == "normal"
    assert "one of high, low or normal" in fields["priority"]["doc"]


def test_nested_records_are_defined_once_then_named():
    fields = {field["name"]: field for field in avro_schema(Evaluation)["fields"]}
    assert fields["answer"]["type"]["type"] == "record" and fields["answer"]["type"]["name"] == "Source"
    assert fields["label"]["type"] == "Source"
    labelled = fields["questions"]["type"]["values"]
    assert labelled["name"] == "LabelledQuestion"
    label = next(field for field in labelled["fields"] if field["name"] == "label")
    assert label["type"] == ["string", "boolean", "long"]


def test_struct_defaults_are_the_default_records():
    provenance = next(f for f in avro_schema(Answer)["fields"] if f["name"] == "provenance")
    assert provenance["type"]["name"] == "Provenance"
    assert provenance["default"]["batch"] == msgspec.to_builtins(BatchRecord())
    assert provenance["default"]["timings"] == msgspec.to_builtins(Timings())
    assert provenance["default"]["media"] == [] and provenance["default"]["model"] is None


def test_dead_letter_fields_carry_their_encode_names():
    fields = [field["name"] for field in avro_schema(DeadLetter)["fields"]]
    assert "value_base64" in fields and "value" not in fields


# --------------------------------------------------------------------------- the generator is not hard-wired


class Part(msgspec.Struct, kw_only=True):
    """A part of a probe."""

    size: int = 0


class Probe(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A probe of the generator."""

    name: Annotated[str, msgspec.Meta(description="what it is called")]
    part: Part = msgspec.field(default_factory=Part)
    spare: Part | None = None
    blob: Any = None
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    either: str | int = 3
    raw: str = msgspec.field(default="", name="raw_base64")
    mark: str | bool | int = 0
    maybe: int | None


class GrownProbe(Probe, kw_only=True, omit_defaults=True):
    added: Annotated[float, msgspec.Meta(description="a field added later")] = 1.5


PROBE_FIELDS = [
    {"name": "name", "type": "string", "doc": "what it is called"},
    {"name": "part", "type": {"type": "record", "name": "Part", "doc": "A part of a probe.",
                              "fields": [{"name": "size", "type": "long", "default": 0}]},
     "default": {"size": 0}},
    {"name": "spare", "type": ["null", "Part"], "default": None},
    {"name": "blob", "type": ["null", "string"], "doc": "JSON text", "default": None},
    {"name": "counts", "type": {"type": "map", "values": "long"}, "default": {}},
    {"name": "either", "type": ["long", "string"], "default": 3},  # the default's branch first
    {"name": "raw_base64", "type": "string", "default": ""},
    {"name": "mark", "type": ["long", "string", "boolean"], "default": 0},
    {"name": "maybe", "type": ["null", "long"]},  # required: no default, null first all the same
]


def test_a_small_struct_gets_exactly_its_schema():
    assert avro_schema(Probe) == {
        "type": "record", "name": "Probe", "namespace": NAMESPACE, "doc": "A probe of the generator.",
        "fields": PROBE_FIELDS,
    }


def test_a_field_added_to_a_struct_appears_in_its_schema():
    schema = avro_schema(GrownProbe)
    assert schema["name"] == "GrownProbe"
    assert schema["fields"] == [*PROBE_FIELDS, {"name": "added", "type": "double", "doc": "a field added later",
                                                "default": 1.5}]
    fastavro.parse_schema(schema)
    _round_trips(GrownProbe(name="p", spare=Part(size=2), blob=[1, {"a": None}], counts={"x": 1}, either="e",
                            mark=False, maybe=4, added=2.5))  # False is not the default 0: it is written
    _round_trips(GrownProbe(name="defaults", maybe=None))


class WithBytes(msgspec.Struct):
    data: bytes


class WithTuple(msgspec.Struct):
    pair: tuple[int, int]


class WithTwoRecords(msgspec.Struct):
    either: Part | Probe


class WithIntKeys(msgspec.Struct):
    counts: dict[int, int]


@pytest.mark.parametrize("event", [WithBytes, WithTuple, WithTwoRecords, WithIntKeys])
def test_a_type_without_an_avro_mapping_is_refused(event):
    with pytest.raises(TypeError):
        avro_schema(event)


# ------------------------------------------------------------------------------------------ round trips


def test_request_round_trips_with_its_free_form_json_as_text():
    datum = to_avro(REQUEST, Request)
    assert isinstance(datum["state"], str) and json.loads(datum["state"]) == REQUEST["state"]
    assert json.loads(datum["questions"]["urgency"]) == QUESTIONS["urgency"]
    assert json.loads(datum["metadata"]) == REQUEST["metadata"]
    # the fields the document leaves out, at their defaults
    assert datum["videos"] == [] and datum["tenant"] is None and datum["ttl_ms"] is None
    back = from_avro(_read(_write(datum, Request), Request), Request)
    # A Request's JSON form writes every field: what comes back is the document with the ones it left out
    # at their defaults, exactly.
    omitted = {"videos": [], "model": None, "permutation_average": None, "ttl_ms": None, "tenant": None}
    assert back == {**REQUEST, **omitted}
    assert _exact(back) == _exact({**REQUEST, **omitted})
    assert decode_request(json.dumps(back).encode()) == decode_request(json.dumps(REQUEST).encode())


def test_minimal_request_round_trips_with_null_state():
    document = {"id": "r1", "questions": {"q": QUESTIONS["refund"]}}
    datum = to_avro(document, Request)
    assert datum["state"] is None and datum["metadata"] is None and datum["priority"] == "normal"
    back = _through_avro(document, Request)
    assert back == msgspec.to_builtins(msgspec.convert(document, Request))
    assert back["state"] is None


def test_free_form_json_keeps_its_types():
    document = {"id": "r1", "questions": {"q": QUESTIONS["refund"]},
                "state": [True, 1, 1.5, "1", None, {"nested": [False]}], "metadata": "just text"}
    back = _through_avro(document, Request)
    assert _exact(back["state"]) == _exact(document["state"]) and back["metadata"] == "just text"


def _answer() -> Answer:
    return Answer(
        id="ticket-1001",
        answer_id="ans-7f3a",
        source=Source(topic="d3.requests", partition=2, offset=41, timestamp=1_700_000_000_000),
        model="tiny",
        answers={
            "team": {"type": "choice", "decision": "billing", "probabilities": {"billing": 0.9, "tech": 0.1}},
            "refund": {"type": "noul", "noul": 0.7, "probabilities": {"false": 0.3, "true": 0.7}},
            "urgency": {"type": "score", "score": 1.2, "levels": ["low", "normal", "urgent"],
                        "probabilities": {"0": 0.1, "1": 0.6, "2": 0.3}},
        },
        usage={"input_tokens": 120, "output_tokens": 0},
        provenance=Provenance(
            model=ModelRecord(name="tiny", runtime="d3-runtime", provenance_sha256="ab" * 32),
            media=[
                MediaRecord(uri="s3://b/k.png", etag="e" * 32, version="3", bytes=1234, sha256="cd" * 32),
                MediaRecord(uri="data:image/png", bytes=10, sha256="ef" * 32),
            ],
            batch=BatchRecord(passes=2, rows=9, real_tokens=700, padded_tokens=900, shared_prefix=True,
                              saved_tokens=80),
            timings=Timings(queued=1.5, fetch=3.0, decode=2.0, prepare=4.0, forward=20.0, total=31.0),
            cost=Cost(tenant="acme", prompt_tokens=120, padded_tokens=128, device_seconds=0.25, media_bytes=1244),
            worker=Worker(host="h", pid=123, version="0.1.0"),
            replay_id="replay-1",
        ),
        metadata={"trace": [1, 2, 3]},
    )


def test_answer_round_trips():
    _round_trips(_answer())
    datum = to_avro(msgspec.to_builtins(_answer()), Answer)
    assert json.loads(datum["answers"]["urgency"])["levels"] == ["low", "normal", "urgent"]
    assert datum["error"] is None


def test_fastavro_union_form_names_the_branch_of_each_record_or_map():
    datum = to_avro(msgspec.to_builtins(_answer()), Answer, fastavro_unions=True)
    assert datum["answers"][0] == "map" and datum["provenance"]["worker"][0] == "d3stream.v2.Worker"
    assert datum["model"] == "tiny" and datum["error"] is None  # scalars and nulls stay as they are


def test_answer_with_defaults_only_round_trips():
    _round_trips(Answer(id="r", source=Source(topic="t", partition=0, offset=0)))


def test_error_answer_round_trips():
    late = Answer(
        id="late", source=Source(topic="t", partition=0, offset=9), model="tiny",
        error=ErrorInfo(code="deadline_exceeded", message="past its deadline", late_ms=1500),
        provenance=Provenance(model=ModelRecord(name="tiny", runtime="r", provenance_sha256="00" * 32),
                              worker=Worker(host="h", pid=1, version="v")),
    )
    _round_trips(late)
    _round_trips(msgspec.structs.replace(late, error=ErrorInfo(code="media_missing", message="s3://b/k is gone")))
    assert to_avro(msgspec.to_builtins(late), Answer)["answers"] is None


def test_dead_letter_round_trips():
    letter = DeadLetter(reason="not JSON", source=Source(topic="d3.requests", partition=1, offset=5, timestamp=7),
                        key="k1", value="e25vdCBqc29u", value_bytes=9000, value_sha256="ab" * 32,
                        value_truncated=True)
    assert "value_base64" in to_avro(msgspec.to_builtins(letter), DeadLetter)
    _round_trips(letter)
    _round_trips(DeadLetter(reason="empty", source=Source(topic="t", partition=0, offset=0)))


def test_label_round_trips_keeping_bool_int_and_str_apart():
    label = Label(id="ticket-1001", labels={"refund": True, "urgency": 2, "team": "billing", "digit": "1",
                                            "off": False, "zero": 0},
                  labeled_at=1_700_000_100_000, source="agent", metadata={"ticket": 1001})
    _round_trips(label)
    datum = _read(_write(to_avro(msgspec.to_builtins(label), Label), Label), Label)
    assert [type(datum["labels"][key]) for key in ("refund", "urgency", "digit", "off", "zero")] == [
        bool, int, str, bool, int]
    _round_trips(Label(id="r", labels={"q": "low"}))


def test_evaluation_round_trips():
    evaluation = Evaluation(
        id="ticket-1001", model="tiny", role="shadow", answer_id="ans-7f3a",
        answer=Source(topic="d3.shadow", partition=2, offset=41, timestamp=1_700_000_000_000),
        label=Source(topic="d3.labels", partition=2, offset=3, timestamp=1_699_999_999_750),
        labeled_by="agent", labeled_at=1_699_999_999_000, lag_ms=-250,
        questions={
            "refund": LabelledQuestion(type="noul", label=True, label_option="true", predicted="true", p_label=0.8,
                                       confidence=0.8, correct=True, brier=0.08, log_loss=0.2231,
                                       expected_brier=0.32),
            "urgency": LabelledQuestion(type="score", label=2, label_option="2", predicted="1", p_label=0.3,
                                        confidence=0.6, correct=False, brier=0.86, log_loss=1.204),
            "team": LabelledQuestion(type="choice", label="billing", label_option="billing", predicted="billing",
                                     p_label=0.9, confidence=0.9, correct=True, brier=0.02, log_loss=0.105),
        },
    )
    _round_trips(evaluation)
    _round_trips(msgspec.structs.replace(evaluation, role="live", answer_id="", labeled_by=None, lag_ms=0))


# ------------------------------------------------------------------------------------------ refusals


def test_a_question_that_is_not_json_text_is_a_value_error_naming_it():
    datum = to_avro(REQUEST, Request)
    questions = datum["questions"]
    assert isinstance(questions, dict)
    questions["urgency"] = '{"type": "score", '
    read = _read(_write(datum, Request), Request)  # Avro carries any string: the JSON is checked on reading
    with pytest.raises(ValueError, match=r"questions\['urgency'\].*not JSON text"):
        from_avro(read, Request)


def test_state_that_is_not_json_text_is_a_value_error_naming_it():
    datum = to_avro(REQUEST, Request)
    datum["state"] = "charged twice"
    with pytest.raises(ValueError, match=r"\$\.state.* not JSON text"):
        from_avro(_read(_write(datum, Request), Request), Request)


def test_answer_metadata_that_is_not_json_text_is_a_value_error_naming_it():
    datum = to_avro(msgspec.to_builtins(_answer()), Answer)
    datum["metadata"] = "{trace"
    with pytest.raises(ValueError, match=r"\$\.metadata"):
        from_avro(datum, Answer)


def test_a_document_without_a_required_field_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"\$\.questions.*required"):
        to_avro({"id": "r1"}, Request)
    with pytest.raises(ValueError, match=r"\$\.source\.offset.*required"):
        to_avro({"id": "r1", "source": {"topic": "t", "partition": 0}}, Answer)


def test_a_value_of_the_wrong_kind_is_refused():
    with pytest.raises(ValueError, match=r"\$\.images"):
        to_avro({**REQUEST, "images": "s3://b/k.png"}, Request)
    with pytest.raises((ValueError, TypeError)):  # fastavro's writer checks the scalars against the schema
        _write(to_avro({**REQUEST, "deadline": "soon"}, Request), Request)


# ------------------------------------------------------------------------------------------ the wire format


def test_confluent_wire_format_round_trip():
    registry = pytest.importorskip("confluent_kafka.schema_registry")
    avro_serde = pytest.importorskip("confluent_kafka.schema_registry.avro")
    serialization = pytest.importorskip("confluent_kafka.serialization")
    client = registry.SchemaRegistryClient.new_client({"url": "mock://d3stream-avro-test"})
    serializer = avro_serde.AvroSerializer(client, json.dumps(avro_schema(Answer)),
                                           to_dict=lambda document, ctx: to_avro(document, Answer))
    deserializer = avro_serde.AvroDeserializer(client, from_dict=lambda datum, ctx: from_avro(datum, Answer))
    context = serialization.SerializationContext("d3.answers", serialization.MessageField.VALUE)
    document = msgspec.to_builtins(_answer())
    value = serializer(document, context)
    schema_id = client.get_latest_version("d3.answers-value").schema_id
    assert value[:5] == b"\x00" + schema_id.to_bytes(4, "big")  # magic byte, then the registry's schema id
    assert deserializer(value, context) == document
