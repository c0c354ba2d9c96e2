"""Questions in, answer objects out: validation of System One questions and the public answer shape.

A request asks any number of questions about one state. Each question is validated on its own, so a
bad question becomes a per-question ``invalid_question`` error while the others are still answered.
The three public types map onto the two types the prompt contract renders:

* ``choice``: options keyed by the caller, one probability each, the argmax is the choice;
* ``noul``: a yes/no question rendered with the two options ``false`` and ``true``;
* ``score``: 2 to 10 ordered levels rendered as a choice over the level texts, answered with the
  expected level (0-based) and a legend from level number to level text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import format as d3_format

QUESTION_TYPES = ("choice", "noul", "score")
SCORE_LEVELS = (2, 10)
ERRORS = ("invalid_question", "max_length_exceeded", "invalid_model_output")


@dataclass
class Question:
    """One validated question: what the prompt renders and how its answer is reported."""

    kind: str  # choice | noul | score
    rendered: dict[str, Any]  # the choice or noul question handed to the prompt contract
    keys: list[str]  # option keys in code order
    descriptions: list[Any]  # what each option means (score: the level values, for the legend)

    @property
    def option_count(self) -> int:
        return len(self.keys)


def require_json(value: Any, what: str = "value") -> None:
    """Refuse values strict JSON cannot carry (NaN, infinities, non-JSON types, runaway nesting)."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"the {what} is not representable as JSON: {exc}") from exc


def normalize_question(question: Any, *, contract: Any = d3_format) -> Question:
    """Validate one question; ValueError says what is wrong with it.

    ``contract`` is the checkpoint's prompt contract module (its own ``d3_format.py`` when it ships one).
    """
    if not isinstance(question, Mapping):
        raise ValueError("a question is an object with a type")
    kind = question.get("type")
    instructions = question.get("instructions")
    if instructions is not None:
        require_json(instructions, "instructions")
    criteria = question.get("criteria")
    if kind == "choice":
        limit = contract.MAX_OPTIONS
        if not isinstance(criteria, Mapping) or not 1 <= len(criteria) <= limit:
            raise ValueError(f"choice criteria must map 1 to {limit} option keys to descriptions")
        if any(not isinstance(key, str) or not key for key in criteria):
            raise ValueError("choice option keys must be nonempty strings")
        require_json(dict(criteria), "criteria")
        rendered = {"type": "choice", "instructions": instructions, "criteria": dict(criteria)}
        keys = list(criteria)
        return Question("choice", rendered, keys, [criteria[key] for key in keys])
    if kind == "noul":
        rendered = {"type": "noul", "instructions": instructions}
        if criteria is not None:
            if not isinstance(criteria, Mapping) or set(criteria) - {"false", "true"}:
                raise ValueError('noul criteria may only describe "false" and "true"')
            require_json(dict(criteria), "criteria")
            rendered["criteria"] = dict(criteria)
        keys, texts = contract.options(rendered)
        return Question("noul", rendered, list(keys), list(texts))
    if kind == "score":
        low, high = SCORE_LEVELS
        if not isinstance(criteria, (list, tuple)) or not low <= len(criteria) <= high:
            raise ValueError(f"score criteria must be an ordered list of {low} to {high} levels")
        require_json(list(criteria), "criteria")
        texts = [contract.describe(level) for level in criteria]
        if any(not text for text in texts) or len(set(texts)) != len(texts):
            raise ValueError("score levels must be distinct and nonempty")
        # Each level is an option shown by its text alone; code order is level order.
        rendered = {"type": "choice", "instructions": instructions, "criteria": dict.fromkeys(texts)}
        return Question("score", rendered, [str(level) for level in range(len(texts))], list(criteria))
    raise ValueError(f"unsupported question type {kind!r} (choice, noul or score)")


def question_error(question: Any, code: str, message: str) -> dict[str, Any]:
    """The answer slot of a question that could not be answered."""
    kind = question.get("type") if isinstance(question, Mapping) else None
    if isinstance(question, Question):
        kind = question.kind
    return {"type": kind if isinstance(kind, str) else None, "error": code, "message": message}


def reversed_question(question: Question) -> dict[str, Any] | None:
    """The rendered choice question with its options in reverse order (None when nothing to permute)."""
    if question.kind != "choice" or len(question.keys) < 2:
        return None
    criteria = question.rendered["criteria"]
    return dict(question.rendered, criteria={key: criteria[key] for key in reversed(criteria)})


def average_orders(forward: Sequence[float], backward: Sequence[float]) -> list[float]:
    """Per-option mean of the original-order and reversed-order distributions, in original order."""
    return [(a + b) / 2 for a, b in zip(forward, reversed(backward), strict=True)]


def canonical_text(value: Any) -> str:
    """Stable text for a score level: strings verbatim, anything else as compact key-sorted JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def confidence(probabilities: Sequence[float]) -> float:
    """One minus the normalized Shannon entropy of a distribution, clipped to [0, 1]."""
    count = len(probabilities)
    if count < 2:
        return 1.0
    entropy = -sum(p * math.log(p) for p in probabilities if p > 0)
    return max(0.0, min(1.0, 1.0 - entropy / math.log(count)))


def answer_object(
    question: Question, probabilities: Sequence[float], *, contract: Any = d3_format
) -> dict[str, Any]:
    """The public answer of one question from its option probabilities (code order).

    ValueError when the probabilities cannot be an answer (the caller reports ``invalid_model_output``).
    """
    if question.kind == "score":
        shares = contract.normalized(probabilities, len(question.keys))
        return {
            "type": "score",
            "score": sum(level * p for level, p in enumerate(shares)),
            "probabilities": dict(zip(question.keys, shares, strict=True)),
            "confidence": confidence(shares),
            "legend": {
                key: canonical_text(text) for key, text in zip(question.keys, question.descriptions, strict=True)
            },
        }
    answer = contract.to_answer(question.rendered, probabilities)
    if question.kind == "choice":
        answer["confidence"] = confidence(list(answer["probabilities"].values()))
    return answer
