"""The D3 prompt and answer-code contract (``d3_format``), format version 1.

A D3 checkpoint reads one question per prompt. The prompt lists the question's options, each under a
short *answer code* that is exactly one token of the checkpoint's tokenizer; the model's readout scores
those codes at the last prompt position. This module is everything a runtime needs to know about that
contract: which codes exist, how a request becomes prompt text, and how code probabilities become an
answer object.

It is deliberately standalone (only the standard library, and the tokenizer it is handed): a copy of it
travels inside every checkpoint directory as ``d3_format.py``, listed in the manifest, so a checkpoint
always carries the exact contract it was trained with. The runtime loads that copy when present and
falls back to this built-in one.

Layout. The state comes first and the question last, so every question of a request shares the same
prompt prefix (system turn, images and videos, state) and only the tail differs::

    <|im_start|>system
    {SYSTEM_PROMPT}<|im_end|>
    <|im_start|>user
    State:
    {state}

    Question: {instructions}
    Options:
    A. {option key}: {option description}
    B. ...
    Answer with the code of one option.<|im_end|>
    <|im_start|>assistant
    <think>

    </think>

(``docs/FORMAT.md`` shows a rendered example.)
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, TypedDict

FORMAT_ID = "d3-format/1"
MAX_OPTIONS = 255

SYSTEM_PROMPT = (
    "You make typed decisions. Read the state and the question, then answer with the code of exactly "
    "one option."
)

# The labels a noul question shows when it does not describe its two outcomes itself.
NOUL_DEFAULTS = {"false": "no", "true": "yes"}

_STATE_HEADER = "State:\n"
_QUESTION_HEADER = "Question: "
_DEFAULT_INSTRUCTIONS = "Which option fits the state best?"
_ANSWER_LINE = "Answer with the code of one option."


class Tokenizer(Protocol):
    """What the contract asks of a tokenizer (a transformers ``PreTrainedTokenizerBase`` is one)."""

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> object: ...


class ChoiceAnswer(TypedDict):
    """The answer object of a choice question: the chosen option key and every option's probability."""

    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float]


class NoulAnswer(TypedDict):
    """The answer object of a noul question: the probability of ``true``, and of both outcomes."""

    type: Literal["noul"]
    noul: float
    probabilities: dict[str, float]


def _code_candidates() -> list[str]:
    """Upper-case letters, then lower-case letters, then two upper-case letters (AA, AB, ... ZZ)."""
    upper, lower = string.ascii_uppercase, string.ascii_lowercase
    return list(upper) + list(lower) + [a + b for a in upper for b in upper]


def answer_codes(tokenizer: Tokenizer) -> tuple[list[str], list[int]]:
    """The ``MAX_OPTIONS`` answer codes of a tokenizer and their token ids, in option order.

    A code qualifies when the tokenizer encodes it on its own as exactly one token. Option ``i`` of every question is shown under ``codes[i]``; the readout row ``i`` scores it.
    """
    codes: list[str] = []
    ids: list[int] = []
    for candidate in _code_candidates():
        encoded = tokenizer.encode(candidate, add_special_tokens=False)
        if len(encoded) == 1:
            codes.append(candidate)
            ids.append(int(encoded[0]))
            if len(codes) == MAX_OPTIONS:
                return codes, ids
    raise ValueError(
        f"the tokenizer has only {len(codes)} single-token answer codes; {MAX_OPTIONS} are needed"
    )


def describe(value: object) -> str:
    """The text shown for a description, instruction or state value.

    Strings are shown verbatim (surrounding whitespace removed), ``None`` as nothing, and any other JSON
    value as compact JSON with its keys in the order given.
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


def options(question: Mapping[str, object]) -> tuple[list[str], list[str]]:
    """The option keys of a rendered question and the text shown for each, in code order."""
    kind = question.get("type")
    criteria = question.get("criteria")
    if kind == "noul":
        described: Mapping[str, object] = {}
        if isinstance(criteria, Mapping):
            described = criteria
        elif criteria:
            raise ValueError('noul criteria map "false" and "true" to descriptions')
        keys = ["false", "true"]
        return keys, [describe(described.get(key, NOUL_DEFAULTS[key])) or NOUL_DEFAULTS[key] for key in keys]
    if kind == "choice":
        if not isinstance(criteria, Mapping) or not criteria:
            raise ValueError("a choice question needs criteria mapping option keys to descriptions")
        keys = list(criteria)
        return keys, [describe(criteria[key]) for key in keys]
    raise ValueError(f"d3_format renders choice and noul questions, not {kind!r}")


def user_prompt(state: object, question: Mapping[str, object], codes: Sequence[str]) -> str:
    """The user-turn text of one question: the state, then the question and its coded options."""
    keys, texts = options(question)
    if len(keys) > min(MAX_OPTIONS, len(codes)):
        raise ValueError(f"a question takes at most {MAX_OPTIONS} options, got {len(keys)}")
    instructions = describe(question.get("instructions")) or _DEFAULT_INSTRUCTIONS
    lines = [_STATE_HEADER + describe(state), "", _QUESTION_HEADER + instructions, "Options:"]
    for code, key, text in zip(codes, keys, texts, strict=False):  # codes outnumber options
        if question.get("type") == "noul":
            lines.append(f"{code}. {text}")
        else:
            lines.append(f"{code}. {key}: {text}" if text else f"{code}. {key}")
    lines.append(_ANSWER_LINE)
    return "\n".join(lines)


def messages(state: object, question: Mapping[str, object], codes: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages of a text-only prompt."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_prompt(state, question, codes)},
    ]


def render(tokenizer: Tokenizer, state: object, question: Mapping[str, object], codes: Sequence[str]) -> str:
    """The full prompt text of a text-only question, through the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        messages(state, question, codes),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    if not isinstance(text, str):  # tokenize=False: the template's text, never token ids
        raise TypeError(f"the chat template gave {type(text).__name__}, not text")
    return text


def normalized(probabilities: Sequence[float], count: int) -> list[float]:
    """The first ``count`` probabilities rescaled to sum to one; ValueError when they cannot be."""
    if count < 1 or len(probabilities) < count:
        raise ValueError(f"expected {count} option probabilities, got {len(probabilities)}")
    values = list(map(float, probabilities[:count]))
    try:
        total = math.fsum(values)  # nan or inf when any value is
    except ValueError:  # inf and -inf
        total = math.nan
    # Under infinity and not NaN (NaN compares false), with no value below zero (the total is not -inf then).
    if not (total < math.inf and min(values) >= 0):
        raise ValueError("the model produced a non-finite or negative option probability")
    if not total > 0:
        raise ValueError("the model's option probabilities sum to zero")
    return [p / total for p in values]


def option_keys(question: Mapping[str, object]) -> list[str]:
    """The option keys of a rendered question in code order (``options`` without rendering their texts,
    which answering does not need)."""
    kind = question.get("type")
    if kind == "noul":
        return ["false", "true"]
    criteria = question.get("criteria")
    if kind == "choice" and (type(criteria) is dict or isinstance(criteria, Mapping)) and criteria:
        return list(criteria)
    return options(question)[0]  # raises, naming what is wrong


def to_answer(question: Mapping[str, object], probabilities: Sequence[float]) -> ChoiceAnswer | NoulAnswer:
    """The answer object of a rendered choice or noul question from its option probabilities."""
    kind = question.get("type")
    if kind == "noul":
        no, yes = normalized(probabilities, 2)
        return {"type": "noul", "noul": yes, "probabilities": {"false": no, "true": yes}}
    criteria = question.get("criteria")
    # A choice's keys are its criteria's, in order (``option_keys``, without looking the type up again).
    keys = list(criteria) if kind == "choice" and type(criteria) is dict and criteria else option_keys(question)
    shares = normalized(probabilities, len(keys))
    best = shares.index(max(shares))  # the first of equal bests, as max over the indices gives
    return {
        "type": "choice",
        "choice": keys[best],
        "probabilities": dict(zip(keys, shares, strict=True)),
    }
