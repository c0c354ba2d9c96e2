"""Validated questions recognised by content (``runtime.questions.QuestionCache``): the same answer as
validating again, every time."""

from __future__ import annotations

import math

import pytest

from d3stream.runtime.questions import QuestionCache, normalize_question

ASKED = [
    {"type": "noul", "instructions": "Is the request urgent?"},
    {"type": "noul", "criteria": {"false": "calm", "true": "urgent"}},
    {"type": "choice", "criteria": {"approve": "approve it", "reject": "reject it"}},
    {"type": "choice", "criteria": {"reject": "reject it", "approve": "approve it"}},  # other order, other codes
    {"type": "score", "criteria": ["none", "low", "high"]},
    {"type": "score", "criteria": [1, 2, 3]},
    {"type": "score", "criteria": [1.0, 2.0, 3.0]},
    {"type": "choice", "instructions": {"focus": "refunds"}, "criteria": {"a": 1, "b": True}},
    {"type": "choice", "criteria": {"a": 1, "b": 1.0}},
]


def test_a_recognised_question_is_the_question_validation_gives_and_is_validated_once() -> None:
    cache = QuestionCache()
    first = [cache.normalize(question) for question in ASKED]
    again = [cache.normalize(dict(question)) for question in ASKED]  # equal content, other objects
    assert first == [normalize_question(question) for question in ASKED]
    assert all(a is b for a, b in zip(first, again, strict=True))
    # Level 1 and level 1.0, true and 1: shown differently, so never taken for each other.
    assert first[5].descriptions == [1, 2, 3] and first[6].descriptions == [1.0, 2.0, 3.0]
    assert first[5] is not first[6]


def test_a_question_json_text_would_confuse_with_a_valid_one_is_still_refused() -> None:
    cache = QuestionCache()
    valid = {"type": "choice", "criteria": {"a": None, "b": "yes"}}
    cache.normalize(valid)
    with pytest.raises(ValueError):  # NaN encodes as null in JSON text; it is no JSON value
        cache.normalize({"type": "choice", "criteria": {"a": math.nan, "b": "yes"}})


def test_an_invalid_question_raises_every_time_and_is_not_kept() -> None:
    cache = QuestionCache()
    wrong = {"type": "score", "criteria": ["only one"]}
    for _ in range(2):
        with pytest.raises(ValueError, match="score criteria"):
            cache.normalize(wrong)
    with pytest.raises(ValueError, match="a question is an object"):
        cache.normalize(object())  # not plain data: validation says what it is not
    assert cache.normalize(ASKED[0]) == normalize_question(ASKED[0])


def test_past_its_capacity_the_oldest_question_is_validated_again() -> None:
    cache = QuestionCache(capacity=2)
    oldest = cache.normalize(ASKED[0])
    cache.normalize(ASKED[1])
    assert cache.normalize(ASKED[0]) is oldest  # still known
    cache.normalize(ASKED[2])  # three asked: the first-kept one goes
    again = cache.normalize(ASKED[0])
    assert again == oldest and again is not oldest


def test_a_large_question_is_validated_each_time_and_not_kept() -> None:
    cache = QuestionCache(largest=200)
    large = {"type": "choice", "criteria": {f"option {n}": "a description " * 4 for n in range(8)}}
    first = cache.normalize(large)
    assert first == normalize_question(large)
    assert cache.normalize(large) is not first
    small = ASKED[0]
    assert cache.normalize(small) is cache.normalize(small)


def test_true_and_1_are_different_questions() -> None:
    cache = QuestionCache()
    with_true = cache.normalize({"type": "choice", "criteria": {"a": True, "b": "x"}})
    with_one = cache.normalize({"type": "choice", "criteria": {"a": 1, "b": "x"}})
    assert with_true is not with_one
    assert with_true.descriptions[0] is True and with_one.descriptions[0] == 1


def test_only_a_flat_json_question_is_kept_so_what_requests_share_is_immutable() -> None:
    cache = QuestionCache()
    nested = {"type": "noul", "instructions": {"focus": ["refunds", "returns"]}}
    as_tuple = {"type": "score", "criteria": ("low", "high")}
    for question in (nested, as_tuple):
        first = cache.normalize(question)
        assert first == normalize_question(question)
        assert cache.normalize(question) is not first  # validated again: the caller's objects are not kept
    with pytest.raises(ValueError, match="at least one question"):
        QuestionCache(capacity=0)
