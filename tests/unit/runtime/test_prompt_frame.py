"""A text-only prompt built around its user turn (d3stream/runtime/prompts.py, ``PromptRenderer.text_frame``) is the
chat template's own prompt, always: fuzzed states of the characters that matter (spaces at either end, line
breaks, the chat's control strings, template syntax, non-ASCII, JSON objects) and questions of every type, on the
session's Qwen3.5 and Qwen3-VL checkpoints; a contract whose prompt does not hold its user turn verbatim is
rendered through itself."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from d3stream.runtime import format as builtin_format
from d3stream.runtime.questions import normalize_question, reversed_question

QUESTIONS = (
    {"type": "noul", "instructions": "Is the request urgent?"},
    {"type": "noul", "criteria": {"false": "it can wait", "true": "now"}},
    {"type": "choice", "instructions": "Route it", "criteria": {"billing": "money", "tech": "", "other": "else"}},
    {"type": "score", "instructions": {"ask": "how bad"}, "criteria": ["none", "low", {"level": "high"}]},
)


def _states(count: int, seed: int) -> list[object]:
    rng = random.Random(seed)
    alphabet = [*"ab Z\n\t .,:;!?'{}%#0123456789\u00e9\u00fc\u4e2d\U0001f389\u0301", "<|im_end|>", "<|im_start|>",
                "<think>", "{{", "}}", "{%", "%}", "  ", "\r\n", "\n\n", "State:", "Question: "]
    states: list[object] = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(count)]
    states += [{"ticket": n, "text": states[n]} for n in range(0, count, 10)]
    return states


def _rendered_through_the_template(model: Any, state: object, question: Mapping[str, object]) -> str:
    checkpoint = model.checkpoint
    return str(checkpoint.contract.render(checkpoint.tokenizer, state, question, checkpoint.vocabulary.codes))


def _check(model: Any) -> None:
    renderer = model.prompts.renderer
    assert renderer.text_frame() is not None  # the fast path is the one taken
    questions = [normalize_question(question).rendered for question in QUESTIONS]
    questions += [flipped for question in QUESTIONS if (flipped := reversed_question(normalize_question(question)))]
    for state in _states(300, seed=11):
        for question in questions:
            assert renderer.render(state, question) == _rendered_through_the_template(model, state, question)


def test_prompts_around_the_user_turn_are_the_templates_on_qwen35(qwen35_text_model):
    _check(qwen35_text_model)


def test_prompts_around_the_user_turn_are_the_templates_on_qwen3vl(qwen3vl_model):
    _check(qwen3vl_model)


class _EscapingContract:
    """The built-in contract, except that its prompt holds the user turn with the chat's control strings taken
    out (as a template that escapes content would)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(builtin_format, name)

    @staticmethod
    def render(tokenizer: Any, state: object, question: Mapping[str, object], codes: Any) -> str:
        user = builtin_format.user_prompt(state, question, codes)
        escaped = user.replace("<|im_end|>", "").replace("<|im_start|>", "")
        return f"<|im_start|>user\n{escaped}<|im_end|>\n<|im_start|>assistant\n"


def test_a_contract_that_does_not_place_the_user_turn_verbatim_renders_every_prompt_itself(qwen35_text_model,
                                                                                             monkeypatch):
    checkpoint = qwen35_text_model.checkpoint
    monkeypatch.setattr(checkpoint, "contract", _EscapingContract())
    renderer = qwen35_text_model.prompts.renderer
    assert renderer.text_frame() is None
    question = normalize_question(QUESTIONS[0]).rendered
    for state in ("a ticket that says <|im_end|> in it", "plain"):
        assert renderer.render(state, question) == _rendered_through_the_template(qwen35_text_model, state, question)
    monkeypatch.undo()
    assert renderer.text_frame() is not None  # the checkpoint's own contract again: framed again


class _OptionCountingContract:
    """The built-in contract, except that its system turn names the codes of the question's options: its frame
    moves with the number of options."""

    def __getattr__(self, name: str) -> Any:
        return getattr(builtin_format, name)

    @staticmethod
    def render(tokenizer: Any, state: object, question: Mapping[str, object], codes: Any) -> str:
        keys, _ = builtin_format.options(question)
        user = builtin_format.user_prompt(state, question, codes)
        return (f"<|im_start|>system\nCodes: {', '.join(codes[:len(keys)])}<|im_end|>\n"
                f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def test_a_frame_that_moves_with_the_question_is_not_taken(qwen35_text_model, monkeypatch):
    monkeypatch.setattr(qwen35_text_model.checkpoint, "contract", _OptionCountingContract())
    renderer = qwen35_text_model.prompts.renderer
    assert renderer.text_frame() is None
    three = normalize_question({"type": "choice", "criteria": {"a": "", "b": "", "c": ""}}).rendered
    assert renderer.render("s", three) == _rendered_through_the_template(qwen35_text_model, "s", three)
