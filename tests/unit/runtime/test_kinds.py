"""The question types and media kinds are defined once (``runtime/kinds.py``) and the rest reads them.

Each question type goes the whole way: validated and rendered, answered, read back by ``compare`` and
scored against a label; the event schema and the request limits name and count what the registry says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from d3stream_client import contract, validation
from d3stream_client.schemas import json_schema

from d3stream.core import agreement
from d3stream.core.storage import MediaError, inline_media
from d3stream.runtime import kinds
from d3stream.runtime.questions import answer_object, normalize_question, reversed_question

PACKAGE = Path(kinds.__file__).resolve().parents[1]

# One question of each type, the probabilities the model gives its options, and a label naming the best one.
EXAMPLES = {
    "choice": ({"type": "choice", "criteria": {"a": "first", "b": "second", "c": None}}, [0.2, 0.7, 0.1], "b"),
    "noul": ({"type": "noul", "instructions": "Is it red?"}, [0.25, 0.75], True),
    "score": ({"type": "score", "criteria": ["low", "mid", "high"]}, [0.1, 0.2, 0.7], 2),
}


def test_each_kind_is_defined_once_in_order() -> None:
    assert kinds.QUESTION_TYPE_NAMES == ("choice", "noul", "score")
    assert set(EXAMPLES) == set(kinds.QUESTION_TYPE_NAMES)
    assert [(k.name, k.request_attribute, k.unavailable_attribute) for k in kinds.MEDIA_KINDS] == [
        ("image", "images", "image_unavailable"),
        ("video", "videos", "video_unavailable"),
    ]
    # No module keeps a list of the kinds of its own (the prompt contract's rendered types aside).
    for path in PACKAGE.rglob("*.py"):
        if path.name == "kinds.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^QUESTION_TYPES\s*=", text, re.MULTILINE), path
        assert not re.search(r'\(\s*"choice",\s*"noul",\s*"score"\s*\)', text), path


@pytest.mark.parametrize("name", kinds.QUESTION_TYPE_NAMES)
def test_a_question_type_round_trips_through_answer_compare_and_labels(name: str) -> None:
    question, probabilities, label = EXAMPLES[name]
    validated = normalize_question(question)
    answer = answer_object(validated, probabilities)
    assert answer["type"] == name
    slot = agreement.parse_slot(answer)
    assert slot is not None and slot.type == name
    best = validated.keys[max(range(len(probabilities)), key=probabilities.__getitem__)]
    assert slot.decision == best
    assert agreement.label_key(slot, label) == best
    assert slot.probabilities == pytest.approx(dict(zip(validated.keys, probabilities, strict=True)))
    # Only choice options may be shown in reverse: a score's levels are ordered, a noul's are fixed.
    assert (reversed_question(validated) is not None) == kinds.question_type(name).permutable


def test_unknown_types_are_refused_naming_the_registry() -> None:
    with pytest.raises(ValueError, match=r"unsupported question type 'rank' \(choice, noul or score\)"):
        normalize_question({"type": "rank"})
    assert kinds.question_type(["choice"]) is None  # a request's type may be any JSON value
    assert agreement.parse_slot({"type": "rank", "probabilities": {"a": 1.0}}) is None
    with pytest.raises(ValueError, match="image or video"):
        kinds.media_kind("audio")


def test_the_event_contract_names_the_registrys_kinds() -> None:
    """The client's contract (which cannot import the runtime) names the same question types, fixed option
    counts and media kinds as the runtime's registry, in the same order."""
    assert contract.QUESTION_TYPE_NAMES == kinds.QUESTION_TYPE_NAMES
    assert contract.FIXED_OPTIONS == {kind.name: kind.fixed_options for kind in kinds.QUESTION_TYPES
                                      if kind.fixed_options is not None}
    assert [(media.name, media.field) for media in contract.MEDIA_FIELDS] == [
        (kind.name, kind.request_attribute) for kind in kinds.MEDIA_KINDS]
    schema = json_schema("request")
    properties = schema["$defs"]["Request"]["properties"]
    described = properties["questions"]["description"]
    assert all(name in described for name in kinds.QUESTION_TYPE_NAMES)
    for kind in kinds.MEDIA_KINDS:
        assert kind.request_attribute in properties
        assert f"data:{kind.name}/" in str(properties[kind.request_attribute])
    # A noul question counts its fixed two options against max_request_options, whatever its criteria.
    nouls = b'{"id": "r", "questions": {"a": {"type": "noul"}, "b": {"type": "noul", "criteria": {}}}}'
    limit = kinds.NOUL.fixed_options
    assert limit == 2
    validation.decode_request(nouls, limits=validation.RequestLimits(options=2 * limit))
    with pytest.raises(validation.EventError, match="4 options in all"):
        validation.decode_request(nouls, limits=validation.RequestLimits(options=2 * limit - 1))


@pytest.mark.parametrize("kind", kinds.MEDIA_KINDS, ids=lambda kind: kind.name)
def test_inline_media_limits_come_from_the_kind(kind: kinds.MediaKind) -> None:
    subtype = kind.data_url_types[0]
    too_long = "A" * (4 * (kind.max_bytes // 3 + 2))
    with pytest.raises(MediaError) as refused:
        inline_media(f"data:{kind.name}/{subtype};base64,{too_long}", kind.name)
    assert refused.value.code == "media_too_large"
    with pytest.raises(MediaError, match=f"{kind.name} data URLs take the types"):
        inline_media(f"data:{kind.name}/gif;base64,AAAA", kind.name)
    assert kind.references({kind.request_attribute: ["s3://b/k"]}) == ["s3://b/k"]
    assert kind.unavailable(type("Model", (), {kind.unavailable_attribute: "no vision tower"})()) == "no vision tower"


def test_score_levels_that_are_one_object_in_two_key_orders_are_a_duplicate() -> None:
    levels = [{"band": "low", "max": 3}, {"max": 3, "band": "low"}, {"band": "high", "max": 9}]
    with pytest.raises(ValueError, match="same keys and values in another order is the same level"):
        normalize_question({"type": "score", "criteria": levels})
    distinct = normalize_question({"type": "score", "criteria": [levels[0], levels[2]]})
    assert distinct.keys == ["0", "1"]
