"""The prompt and answer-code contract (d3stream.runtime.format), with the real Qwen3.5 tokenizer."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3stream.runtime import format as d3_format
from d3stream.runtime.questions import normalize_question

CHOICE = {
    "type": "choice",
    "instructions": "Where should the robot go?",
    "criteria": {"north": "toward the door", "south": "", "east": None, "west": {"cost": 3}},
}

# Its module-scoped tokenizer loads once, on one pytest worker (xdist_group, make test's --dist loadgroup).
pytestmark = pytest.mark.xdist_group("format-tokenizer")


@pytest.fixture(scope="module")
def tokenizer(qwen35_text_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen35_text_checkpoint))


@pytest.fixture(scope="module")
def codes(tokenizer):
    return d3_format.answer_codes(tokenizer)[0]


# ------------------------------------------------------------------------------------------ answer codes


def test_answer_codes_are_255_distinct_single_tokens(tokenizer, qwen35_text_checkpoint):
    codes, ids = d3_format.answer_codes(tokenizer)
    assert len(codes) == len(ids) == d3_format.MAX_OPTIONS == 255
    assert len(set(codes)) == 255 and len(set(ids)) == 255
    for code, token in zip(codes, ids, strict=True):
        assert tokenizer.encode(code, add_special_tokens=False) == [token]
        assert tokenizer.decode([token]) == code
    # Upper-case letters first, then lower-case, then two-letter codes.
    assert codes[:3] == ["A", "B", "C"] and codes[25] == "Z" and codes[26] == "a" and codes[51] == "z"
    assert all(len(code) == 2 and code.isupper() for code in codes[52:])
    # The checkpoint records exactly these.
    config = json.loads((qwen35_text_checkpoint / "decision_config.json").read_text())
    assert config["codes"] == codes and config["token_ids"] == ids


def test_answer_codes_refuses_a_tokenizer_without_enough_codes():
    class SplitsEverything:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]  # only the 52 single letters are one token

    with pytest.raises(ValueError, match="only 52 single-token answer codes; 255 are needed"):
        d3_format.answer_codes(SplitsEverything())


# ----------------------------------------------------------------------------------------------- layout


def test_user_prompt_layout_choice(codes):
    text = d3_format.user_prompt({"speed": 3, "goal": "exit"}, CHOICE, codes)
    assert text == (
        "State:\n"
        '{"speed": 3, "goal": "exit"}\n'
        "\n"
        "Question: Where should the robot go?\n"
        "Options:\n"
        "A. north: toward the door\n"
        "B. south\n"
        "C. east\n"
        'D. west: {"cost": 3}\n'
        "Answer with the code of one option."
    )


def test_user_prompt_noul_defaults_and_descriptions(codes):
    plain = d3_format.user_prompt("  a wet floor  ", {"type": "noul", "instructions": None}, codes)
    assert plain.splitlines() == [
        "State:",
        "a wet floor",
        "",
        "Question: Which option fits the state best?",
        "Options:",
        "A. no",
        "B. yes",
        "Answer with the code of one option.",
    ]
    described = d3_format.user_prompt(
        "s", {"type": "noul", "instructions": "Slippery?", "criteria": {"true": "it is slippery"}}, codes
    )
    assert "A. no\nB. it is slippery\n" in described
    assert "Question: Slippery?\n" in described


def test_score_levels_render_as_ordered_options(codes):
    question = normalize_question({"type": "score", "criteria": ["low", {"level": "mid"}, "high"]})
    text = d3_format.user_prompt("s", question.rendered, codes)
    assert 'A. low\nB. {"level": "mid"}\nC. high\n' in text


def test_state_comes_before_the_question_so_questions_share_a_prefix(tokenizer, codes):
    state = {"camera": "front", "objects": ["cup", "plate"], "note": "the cup is near the edge"}
    first = d3_format.render(tokenizer, state, {"type": "noul", "instructions": "Will it fall?"}, codes)
    second = d3_format.render(tokenizer, state, CHOICE, codes)
    state_end = first.index("the cup is near the edge") + len("the cup is near the edge")
    assert first[:state_end] == second[:state_end]
    assert first.index("State:") < first.index("Question:")
    # Also as tokens: everything up to the end of the state is a shared prefix of both prompts.
    a = tokenizer(first, add_special_tokens=False)["input_ids"]
    b = tokenizer(second, add_special_tokens=False)["input_ids"]
    prefix = tokenizer(first[:state_end], add_special_tokens=False)["input_ids"]
    assert a[: len(prefix)] == b[: len(prefix)] == prefix
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared >= len(prefix)


def test_render_wraps_the_user_prompt_in_the_chat_template(tokenizer, codes):
    question = {"type": "noul", "instructions": "Open?"}
    text = d3_format.render(tokenizer, "door", question, codes)
    assert text == (
        f"<|im_start|>system\n{d3_format.SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{d3_format.user_prompt('door', question, codes)}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert d3_format.messages("door", question, codes)[0] == {
        "role": "system",
        "content": d3_format.SYSTEM_PROMPT,
    }


def test_codes_follow_option_order_up_to_255(codes):
    criteria = {f"k{i}": "" for i in range(255)}
    text = d3_format.user_prompt("s", {"type": "choice", "criteria": criteria}, codes)
    lines = [line for line in text.splitlines() if ". k" in line]
    assert len(lines) == 255
    assert lines[0] == "A. k0" and lines[52] == f"{codes[52]}. k52" and lines[-1] == f"{codes[254]}. k254"
    with pytest.raises(ValueError, match="at most 255 options"):
        d3_format.user_prompt("s", {"type": "choice", "criteria": {**criteria, "one more": ""}}, codes)


def test_options_refuses_unrenderable_questions():
    with pytest.raises(ValueError, match="choice and noul"):
        d3_format.options({"type": "score", "criteria": ["a", "b"]})
    with pytest.raises(ValueError, match="criteria"):
        d3_format.options({"type": "choice", "criteria": {}})


def test_describe():
    assert d3_format.describe(None) == ""
    assert d3_format.describe("  padded \n") == "padded"
    assert d3_format.describe({"b": 1, "a": [1, 2.5, None]}) == '{"b": 1, "a": [1, 2.5, null]}'
    assert d3_format.describe("ünïcode ✓") == "ünïcode ✓"
    with pytest.raises(ValueError):
        d3_format.describe({"x": float("nan")})


# ------------------------------------------------------------------------------------------------ answers


def test_to_answer_choice_shape():
    answer = d3_format.to_answer({"type": "choice", "criteria": {"a": "", "b": "", "c": ""}}, [0.1, 0.6, 0.3])
    assert answer == {"type": "choice", "choice": "b", "probabilities": {"a": 0.1, "b": 0.6, "c": 0.3}}


def test_to_answer_noul_shape_and_renormalizes():
    answer = d3_format.to_answer({"type": "noul"}, [0.2, 0.6])
    assert set(answer) == {"type", "noul", "probabilities"}
    assert answer["type"] == "noul"
    assert answer["noul"] == pytest.approx(0.75)
    assert answer["probabilities"] == {"false": pytest.approx(0.25), "true": pytest.approx(0.75)}


def test_to_answer_uses_only_the_question_options():
    # Extra trailing values (a row longer than the option count) are ignored, the rest renormalized.
    answer = d3_format.to_answer({"type": "choice", "criteria": {"x": "", "y": ""}}, [0.3, 0.1, 0.6])
    assert answer["probabilities"] == {"x": pytest.approx(0.75), "y": pytest.approx(0.25)}
    assert answer["choice"] == "x"


@pytest.mark.parametrize(
    "values, message",
    [
        ([float("nan"), 0.5], "non-finite or negative"),
        ([float("inf"), 0.5], "non-finite or negative"),
        ([-0.1, 1.1], "non-finite or negative"),
        ([0.0, 0.0], "sum to zero"),
        ([1.0], "expected 2 option probabilities"),
    ],
)
def test_normalized_refuses_what_cannot_be_an_answer(values, message):
    with pytest.raises(ValueError, match=message):
        d3_format.normalized(values, 2)
    with pytest.raises(ValueError):
        d3_format.to_answer({"type": "noul"}, values)


def test_normalized_refuses_zero_count():
    with pytest.raises(ValueError):
        d3_format.normalized([0.5, 0.5], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=40))
def test_normalized_and_choice_properties(values):
    if not math.fsum(values) > 0:
        with pytest.raises(ValueError):
            d3_format.normalized(values, len(values))
        return
    shares = d3_format.normalized(values, len(values))
    assert math.fsum(shares) == pytest.approx(1.0, abs=1e-12)
    assert all(0 <= p <= 1 for p in shares)
    keys = [f"o{i}" for i in range(len(values))]
    answer = d3_format.to_answer({"type": "choice", "criteria": dict.fromkeys(keys, "")}, values)
    assert list(answer["probabilities"]) == keys
    assert answer["probabilities"][answer["choice"]] == max(shares)
