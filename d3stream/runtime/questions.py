"""Questions in, answer objects out: validation of System One questions and the public answer shape.

A request asks any number of questions about one state. Each question is validated on its own, so a
bad question becomes a per-question ``invalid_question`` error while the others are still answered.
The three public types map onto the two types the prompt contract renders:

* ``choice``: options keyed by the caller, one probability each, the argmax is the choice;
* ``noul``: a yes/no question rendered with the two options ``false`` and ``true``;
* ``score``: 2 to 10 ordered levels rendered as a choice over the level texts, answered with the
  expected level (0-based) and a legend from level number to level text.

What differs between the types is defined once, in :mod:`.kinds`; this module is the interface the model
uses (validate a question, reverse its options, make its answer object), and it re-exports the shared
helpers (``Question``, ``require_json``, ``confidence``, ``canonical_text``) that used to live here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import msgspec

from d3stream.runtime import format as d3_format
from d3stream.runtime.kinds import (
    QUESTION_TYPE_NAMES,
    SCORE_LEVELS,
    PromptContract,
    Question,
    RenderedQuestion,
    canonical_text,
    confidence,
    question_type,
    require_json,
    spoken_list,
)

__all__ = [
    "ERRORS", "QUESTION_TYPE_NAMES", "SCORE_LEVELS", "Question", "QuestionCache", "answer_object", "average_orders",
    "canonical_text", "confidence", "normalize_question", "question_error", "require_json", "reversed_question",
]

ERRORS = ("invalid_question", "max_length_exceeded", "invalid_model_output")


def normalize_question(question: object, *, contract: PromptContract = d3_format) -> Question:
    """Validate one question; ValueError says what is wrong with it.

    ``contract`` is the checkpoint's prompt contract module (its own ``d3_format.py`` when it ships one).
    """
    if not isinstance(question, Mapping):
        raise ValueError("a question is an object with a type")
    kind = question.get("type")
    instructions = question.get("instructions")
    if instructions is not None:
        require_json(instructions, "instructions")
    found = question_type(kind)
    if found is None:
        raise ValueError(f"unsupported question type {kind!r} ({spoken_list(QUESTION_TYPE_NAMES)})")
    return found.build(question, instructions, contract)


class QuestionCache:
    """Validated questions by their content, for one prompt contract: a stream asks the same few questions of
    many states (a ticket router asks the same three of every ticket), and validating one again costs more
    than recognising it (``bench kafka``: 5 µs a question validated, under 2 µs recognised).

    Only a question as JSON decodes it and flat is kept: a dict whose values are strings, numbers, booleans or
    null, or a list or dict of those (``_flat``). So what it shares with the requests that ask it is immutable
    (its criteria are copied when validated), it holds a few KB of objects at most, and it is recognised by its
    MessagePack encoding, which keeps apart what JSON text would merge (NaN and null, 1 and 1.0, true and 1).
    Anything else (instructions given as an object, a tuple, a set) is validated each time, as is a question
    that fails validation. The ``Question`` handed out is shared, so nothing may change it (nothing does:
    reversing its options copies). Bounded: past ``capacity`` questions the oldest is forgotten, and one over
    ``largest`` bytes encoded is not kept (its tokens cost far more than its validation)."""

    def __init__(self, contract: PromptContract = d3_format, capacity: int = 1024, largest: int = 4096):
        if capacity < 1:
            raise ValueError(f"a question cache holds at least one question, got capacity {capacity}")
        self.contract = contract
        self.capacity = capacity
        self.largest = largest
        self._known: dict[bytes, Question] = {}
        self._lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode

    def normalize(self, question: object) -> Question:
        """``normalize_question(question, contract=...)``: the same Question, or the same ValueError."""
        if not _flat(question):
            return normalize_question(question, contract=self.contract)
        key = self._encode(question)
        known = self._known.get(key)
        if known is not None:
            return known
        normalized = normalize_question(question, contract=self.contract)
        if len(key) > self.largest:
            return normalized
        with self._lock:  # a rollout's warm-up may prepare on another thread than the prepare thread
            known_questions = self._known
            if len(known_questions) >= self.capacity:
                del known_questions[next(iter(known_questions))]
            known_questions[key] = normalized
        return normalized


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _flat(question: object) -> bool:
    """A dict as JSON decodes it, of scalars and of lists and dicts of scalars (``QuestionCache``)."""
    if type(question) is not dict:
        return False
    scalars = _SCALARS
    for value in question.values():
        kind = type(value)
        if kind in scalars:
            continue
        if kind is dict:  # JSON objects have string keys; an Avro map too
            items = value.values()
        elif kind is list:
            items = value
        else:
            return False
        for item in items:
            if type(item) not in scalars:
                return False
    return True


def question_error(question: object, code: str, message: str) -> dict[str, object]:
    """The answer slot of a question that could not be answered."""
    kind = question.get("type") if isinstance(question, Mapping) else None
    if isinstance(question, Question):
        kind = question.kind
    return {"type": kind if isinstance(kind, str) else None, "error": code, "message": message}


def reversed_question(question: Question) -> RenderedQuestion | None:
    """The rendered question with its options in reverse order (None when nothing to permute)."""
    found = question_type(question.kind)
    if found is None or not found.permutable or len(question.keys) < 2:
        return None
    flipped = question.rendered.copy()
    criteria = flipped["criteria"]  # a permutable type always has criteria
    flipped["criteria"] = {key: criteria[key] for key in reversed(criteria)}
    return flipped


def average_orders(forward: Sequence[float], backward: Sequence[float]) -> list[float]:
    """Per-option mean of the original-order and reversed-order distributions, in original order."""
    return [(a + b) / 2 for a, b in zip(forward, reversed(backward), strict=True)]


def answer_object(
    question: Question, probabilities: Sequence[float], *, contract: PromptContract = d3_format
) -> Mapping[str, object]:
    """The public answer of one question from its option probabilities (code order).

    ValueError when the probabilities cannot be an answer (the caller reports ``invalid_model_output``).
    """
    found = question_type(question.kind)
    if found is None:
        raise ValueError(f"unsupported question type {question.kind!r} ({spoken_list(QUESTION_TYPE_NAMES)})")
    return found.answer(question, probabilities, contract)
