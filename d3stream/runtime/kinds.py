"""The question types and media kinds, each defined once: what a request may ask and what it may show.

Every part of d3stream that treats the three question types (``choice``, ``noul``, ``score``) or the two
media kinds (``image``, ``video``) differently reads its difference from here, instead of keeping its own
list or if-chain of the kinds:

* a :class:`QuestionType` says how a question of the type is validated and rendered for the prompt
  contract (``build``), how its answer object is made from the option probabilities (``answer``), how
  ``d3stream compare`` reads that answer object back (``read``) and a label (``label_key``), how many
  options it has whatever its criteria say (``fixed_options``, for the request limits) and whether its
  options may be shown in reverse order (``permutable``, for permutation averaging);
* a :class:`MediaKind` says which request field lists its references, which model attribute says why
  the checkpoint cannot take it, its strict limits for bytes from outside, and the names the processor
  and the backbone use for it.

``QUESTION_TYPES`` and ``MEDIA_KINDS`` are ordered: reports, schemas and the service follow that order.

The prompt contract itself (``format.py``) is the one place that names the rendered types ``choice`` and
``noul`` on its own: a byte copy of it travels inside every checkpoint and must run with the standard
library alone, so it cannot read this registry (a ``score`` question is rendered as a ``choice`` over its
level texts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import mul
from typing import Any, Literal, NamedTuple, NotRequired, Protocol, TypedDict

from d3stream.runtime import format as d3_format
from d3stream.runtime import media as media_io

# -- the prompt contract, as the question types use it -----------------------------------------------


class PromptContract(Protocol):
    """What the runtime reads of a prompt contract module: the built-in ``format.py`` or the copy a checkpoint
    ships as ``d3_format.py`` (loaded by ``loading.prompt_contract``). A module is one when it has these names."""

    @property
    def MAX_OPTIONS(self) -> int: ...
    @property
    def SYSTEM_PROMPT(self) -> str: ...

    def answer_codes(self, tokenizer: d3_format.Tokenizer) -> tuple[list[str], list[int]]: ...
    def describe(self, value: object) -> str: ...
    def options(self, question: Mapping[str, object]) -> tuple[list[str], list[str]]: ...
    def user_prompt(self, state: object, question: Mapping[str, object], codes: Sequence[str]) -> str: ...
    def render(
        self, tokenizer: d3_format.Tokenizer, state: object, question: Mapping[str, object], codes: Sequence[str]
    ) -> str: ...
    def normalized(self, probabilities: Sequence[float], count: int) -> list[float]: ...
    def to_answer(
        self, question: Mapping[str, object], probabilities: Sequence[float]
    ) -> d3_format.ChoiceAnswer | d3_format.NoulAnswer: ...


class RenderedQuestion(TypedDict):
    """A question as the prompt contract renders it: a ``choice`` (a score too, over its level texts) or a
    ``noul``; its criteria as validated (a noul's only when it describes its outcomes)."""

    type: Literal["choice", "noul"]
    instructions: object  # JSON, shown through the contract's ``describe``
    criteria: NotRequired[dict[str, object]]  # option key -> description (JSON)


# -- the question record and the helpers its types share ---------------------------------------------


@dataclass
class Question:
    """One validated question: what the prompt renders and how its answer is reported."""

    kind: str  # the QuestionType's name
    rendered: RenderedQuestion  # the choice or noul question handed to the prompt contract
    keys: list[str]  # option keys in code order
    descriptions: list[object]  # what each option means (score: the level values, for the legend)
    # A score's legend (level number -> level text), made once: a question is shared by the requests that ask it.
    legend: dict[str, str] | None = None

    @property
    def option_count(self) -> int:
        return len(self.keys)


def require_json(value: object, what: str = "value") -> None:
    """Refuse values strict JSON cannot carry (NaN, infinities, non-JSON types, runaway nesting)."""
    if _plainly_json(value):
        return  # the common shapes (text, a flat mapping or list of texts) need no trial encoding
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"the {what} is not representable as JSON: {exc}") from exc


def _plainly_json(value: object) -> bool:
    """Whether ``value`` is a string, or a mapping or list of strings under string keys: JSON as it stands."""
    if isinstance(value, str):
        return True
    if isinstance(value, dict):
        return all(type(key) is str and type(item) is str for key, item in value.items())
    if isinstance(value, list):
        return all(type(item) is str for item in value)
    return False


def canonical_text(value: object) -> str:
    """Stable text for a score level: strings verbatim, anything else as compact key-sorted JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def confidence(probabilities: Collection[float]) -> float:
    """One minus the normalized Shannon entropy of a distribution, clipped to [0, 1]."""
    count = len(probabilities)
    if count < 2:
        return 1.0
    log = math.log
    entropy = -sum([p * log(p) for p in probabilities if p > 0])
    value = 1.0 - entropy / (_LOGS[count] if count < len(_LOGS) else log(count))
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value  # clipped (rounding can pass either end)


_LOGS = tuple(math.log(count) if count else 0.0 for count in range(64))  # log of small option counts, once


class ReadAnswer(NamedTuple):
    """An answer object as ``d3stream compare`` reads it: every option's probability, the decision (an
    option key) and, for ``score``, the expected level. (A tuple: the evaluator reads thousands a second.)"""

    probabilities: dict[str, float]
    decision: str
    score: float | None = None


def finite_number(value: object) -> float | None:
    """A JSON number that is finite (booleans are not numbers here); None otherwise."""
    if type(value) is float:  # the common cases first: the evaluator reads a dozen numbers per answer
        return value if math.isfinite(value) else None
    if type(value) is int:
        return float(value) if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def probability_map(raw: object) -> dict[str, float] | None:
    """A non-empty object of finite numbers by option key; None when ``raw`` is anything else."""
    if not isinstance(raw, dict) or not raw:
        return None
    out = {}
    for key, value in raw.items():
        number = finite_number(value)
        if number is None:
            return None
        out[str(key)] = number
    return out


def _argmax(probabilities: Mapping[str, float], keys: Sequence[str]) -> str:
    return max(keys, key=lambda k: probabilities[k])  # first of equal maxima


def _level(key: str) -> int | None:
    try:
        return int(key)
    except ValueError:
        return None


# -- the question types ----------------------------------------------------------------------------

# A builder gets the question object, its (JSON-checked) instructions and the checkpoint's prompt contract.
Builder = Callable[[Mapping[str, object], object, PromptContract], Question]
# An answerer gets the validated question, its option probabilities (code order) and the prompt contract, and
# makes the public answer object (JSON).
Answerer = Callable[[Question, Sequence[float], PromptContract], Mapping[str, object]]


@dataclass(frozen=True)
class QuestionType:
    """One public question type and everything that differs between types."""

    name: str
    build: Builder  # validate the question's criteria and render it for the prompt contract
    answer: Answerer  # the public answer object; ValueError when the probabilities cannot be one
    read: Callable[[Mapping[str, object]], ReadAnswer | None]  # an answer object back (compare)
    label_key: Callable[[object], str | None]  # the option key a label names (compare --labels, training)
    fixed_options: int | None = None  # options whatever the criteria say (None: one per criterion)
    permutable: bool = False  # options may be shown in reverse order (permutation averaging)


def _build_choice(question: Mapping[str, object], instructions: object, contract: PromptContract) -> Question:
    criteria = question.get("criteria")
    limit = contract.MAX_OPTIONS
    if not isinstance(criteria, Mapping) or not 1 <= len(criteria) <= limit:
        raise ValueError(f"choice criteria must map 1 to {limit} option keys to descriptions")
    if any(not isinstance(key, str) or not key for key in criteria):
        raise ValueError("choice option keys must be nonempty strings")
    require_json(dict(criteria), "criteria")
    rendered: RenderedQuestion = {"type": "choice", "instructions": instructions, "criteria": dict(criteria)}
    keys = list(criteria)
    return Question("choice", rendered, keys, [criteria[key] for key in keys])


def _answer_choice(question: Question, probabilities: Sequence[float], contract: PromptContract) -> dict[str, object]:
    answer: dict[str, Any] = contract.to_answer(question.rendered, probabilities)  # type: ignore[assignment]
    answer["confidence"] = confidence(answer["probabilities"].values())  # the contract's answer is a new dict
    return answer


def _read_choice(raw: Mapping[str, object]) -> ReadAnswer | None:
    probabilities = probability_map(raw.get("probabilities"))
    if probabilities is None:
        return None
    choice = raw.get("choice")
    decision = choice if isinstance(choice, str) and choice in probabilities else _argmax(
        probabilities, list(probabilities)
    )
    return ReadAnswer(probabilities, decision)


def _choice_label(expected: object) -> str | None:
    return expected if isinstance(expected, str) else None


def _build_noul(question: Mapping[str, object], instructions: object, contract: PromptContract) -> Question:
    criteria = question.get("criteria")
    rendered: RenderedQuestion = {"type": "noul", "instructions": instructions}
    if criteria is not None:
        if not isinstance(criteria, Mapping) or set(criteria) - {"false", "true"}:
            raise ValueError('noul criteria may only describe "false" and "true"')
        require_json(dict(criteria), "criteria")
        rendered["criteria"] = dict(criteria)
    keys, texts = contract.options(rendered)
    return Question("noul", rendered, list(keys), list(texts))


def _answer_noul(question: Question, probabilities: Sequence[float], contract: PromptContract) -> Mapping[str, object]:
    return contract.to_answer(question.rendered, probabilities)


def _read_noul(raw: Mapping[str, object]) -> ReadAnswer | None:
    probabilities = probability_map(raw.get("probabilities"))
    p = finite_number(raw.get("noul"))
    if probabilities is None or not {"false", "true"} <= probabilities.keys():
        if p is None:
            return None
        probabilities = {"false": 1.0 - p, "true": p}
    if p is None:
        p = probabilities["true"]
    return ReadAnswer(probabilities, "true" if p >= 0.5 else "false")


def _noul_label(expected: object) -> str | None:
    if isinstance(expected, bool):
        return "true" if expected else "false"
    if isinstance(expected, str) and expected.lower() in ("true", "false"):
        return expected.lower()
    return None


SCORE_LEVELS = (2, 10)


def _build_score(question: Mapping[str, object], instructions: object, contract: PromptContract) -> Question:
    criteria = question.get("criteria")
    low, high = SCORE_LEVELS
    if not isinstance(criteria, list | tuple) or not low <= len(criteria) <= high:
        raise ValueError(f"score criteria must be an ordered list of {low} to {high} levels")
    require_json(list(criteria), "criteria")
    texts = [contract.describe(level) for level in criteria]
    if any(not text for text in texts):
        raise ValueError("score levels must be distinct and nonempty")
    # The prompt shows an object level with its keys as given; the same object with its keys in another
    # order is still the same level, so distinctness is judged on the canonical text.
    if len(set(texts)) != len(texts) or len({canonical_text(level) for level in criteria}) != len(texts):
        raise ValueError("score levels must be distinct and nonempty (an object with the same keys and values in "
                         "another order is the same level)")
    # Each level is an option shown by its text alone; code order is level order.
    rendered: RenderedQuestion = {"type": "choice", "instructions": instructions, "criteria": dict.fromkeys(texts)}
    keys = [str(level) for level in range(len(texts))]
    legend = {key: level if type(level) is str else canonical_text(level)
              for key, level in zip(keys, criteria, strict=True)}
    return Question("score", rendered, keys, list(criteria), legend)


def _answer_score(question: Question, probabilities: Sequence[float], contract: PromptContract) -> dict[str, object]:
    assert question.legend is not None  # every score question is made by _build_score, with its legend
    shares = contract.normalized(probabilities, len(question.keys))
    return {
        "type": "score",
        "score": sum(map(mul, range(len(shares)), shares)),  # the expected level: products summed in order
        "probabilities": dict(zip(question.keys, shares, strict=True)),
        "confidence": confidence(shares),
        "legend": dict(question.legend),
    }


def _read_score(raw: Mapping[str, object]) -> ReadAnswer | None:
    probabilities = probability_map(raw.get("probabilities"))
    if probabilities is None:
        return None
    levels: dict[str, int] = {}
    for key in probabilities:
        level = _level(key)
        if level is None:
            return None
        levels[key] = level
    ordered = sorted(probabilities, key=levels.__getitem__)
    score = finite_number(raw.get("score"))
    if score is None:
        score = sum(levels[k] * probabilities[k] for k in ordered)
    return ReadAnswer(probabilities, _argmax(probabilities, ordered), score)


def _score_label(expected: object) -> str | None:
    if isinstance(expected, bool):
        return None
    if isinstance(expected, int):
        return str(expected)
    if isinstance(expected, str) and (level := _level(expected)) is not None:
        return str(level)
    return None


CHOICE = QuestionType("choice", _build_choice, _answer_choice, _read_choice, _choice_label, permutable=True)
NOUL = QuestionType("noul", _build_noul, _answer_noul, _read_noul, _noul_label, fixed_options=len(d3_format.NOUL_DEFAULTS))
SCORE = QuestionType("score", _build_score, _answer_score, _read_score, _score_label)

QUESTION_TYPES: tuple[QuestionType, ...] = (CHOICE, NOUL, SCORE)
QUESTION_TYPE_NAMES: tuple[str, ...] = tuple(kind.name for kind in QUESTION_TYPES)
_QUESTION_TYPES_BY_NAME = {kind.name: kind for kind in QUESTION_TYPES}


def question_type(name: object) -> QuestionType | None:
    """The question type of that name; None for any other value (a request's ``type`` may be anything)."""
    return _QUESTION_TYPES_BY_NAME.get(name) if isinstance(name, str) else None


def label_option(type_name: object, expected: object, legend: Sequence[tuple[str, str]] = ()) -> str | None:
    """The option key a label names for a question of that type (None: none). ``legend`` is a score's level
    texts by key, as its answer gives them: a score label that is a string names a level by its text, even a
    digit (on a ``["1", ..., "5"]`` scale, ``"3"`` is the level whose text is "3"), and an integer is a level
    index. Without the texts (an answer from before they were recorded) a digit string is read as an index."""
    if type_name == "score" and isinstance(expected, str) and legend:
        named = [key for key, text in legend if text == expected]
        return named[0] if len(named) == 1 else None
    kind = question_type(type_name)
    return kind.label_key(expected) if kind is not None else None


def spoken_list(names: Sequence[str]) -> str:
    """``choice, noul or score``: names as an error message or a description lists them."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# -- the media kinds -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaKind:
    """One kind of media a request may show every question, and the names each layer gives it."""

    name: str  # "image": the data: URL media type, the error messages, the feature and cache keys
    request_attribute: str  # the request field listing its references (also ``RequestMedia``'s field)
    unavailable_attribute: str  # the model attribute saying why the checkpoint cannot take it (None: it can)
    max_bytes: int  # strict limit of one object from outside (refused from HEAD, never downloaded)
    data_url_types: tuple[str, ...]  # subtypes an inline data:<name>/<subtype> URL may have
    processor_attribute: str  # the processor's part for it (settings are part of the feature cache key)
    pixels_input: str  # the processor output holding its patches
    grid_input: str  # the processor output holding its (t, h, w) patch grids
    features_method: str  # the backbone method encoding it

    def references(self, request: object) -> list[str]:
        """The references of this kind a request (a ``Request`` struct or its JSON object) names."""
        if isinstance(request, Mapping):
            return list(request.get(self.request_attribute) or [])
        return list(getattr(request, self.request_attribute))

    def unavailable(self, model: object) -> str | None:
        """Why the model cannot take this kind (None when it can, or when the model does not say)."""
        reason: str | None = getattr(model, self.unavailable_attribute, None)
        return reason


IMAGE = MediaKind(
    name="image",
    request_attribute="images",
    unavailable_attribute="image_unavailable",
    max_bytes=media_io.MAX_IMAGE_BYTES,
    data_url_types=media_io.DATA_URL_IMAGE_TYPES,
    processor_attribute="image_processor",
    pixels_input="pixel_values",
    grid_input="image_grid_thw",
    features_method="get_image_features",
)
VIDEO = MediaKind(
    name="video",
    request_attribute="videos",
    unavailable_attribute="video_unavailable",
    max_bytes=media_io.MAX_VIDEO_BYTES,
    data_url_types=media_io.VIDEO_FORMATS,
    processor_attribute="video_processor",
    pixels_input="pixel_values_videos",
    grid_input="video_grid_thw",
    features_method="get_video_features",
)

MEDIA_KINDS: tuple[MediaKind, ...] = (IMAGE, VIDEO)
_MEDIA_KINDS_BY_NAME = {kind.name: kind for kind in MEDIA_KINDS}


def media_kind(name: str) -> MediaKind:
    """The media kind of that name; ValueError naming the kinds for any other."""
    found = _MEDIA_KINDS_BY_NAME.get(name)
    if found is None:
        raise ValueError(f"unknown media kind {name!r} ({spoken_list([kind.name for kind in MEDIA_KINDS])})")
    return found
