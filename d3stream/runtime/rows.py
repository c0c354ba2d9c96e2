"""What a prepared request is: its rows (one tokenized prompt per question and option order), its media, and
the answer object its rows' probabilities make.

These are the values that travel between the model's threads: the prepare thread makes a ``Prepared``
(``prompts.PromptPreparer``), the scheduler packs its ``Row``s with other requests' rows, the model thread
runs them (``forward.RowRunner``, ``prefix.PrefixRunner``), and ``Prepared.answers`` reads the
probabilities back into the response. No torch import here: the service's request pipeline and seams use
these types without loading the model's libraries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from d3stream.runtime import format as builtin_format
from d3stream.runtime.kinds import PromptContract
from d3stream.runtime.questions import Question, answer_object, average_orders, question_error

if TYPE_CHECKING:
    import torch


@dataclass
class Features:
    """The vision-tower output of one request's images (or videos), item by item in request order."""

    pooled: list[torch.Tensor]  # per item: [tokens, hidden], the merged features its placeholders take
    deepstack: list[list[torch.Tensor]] | None = None  # per deepstack layer, per item (Qwen3-VL), else None


@dataclass
class RequestMedia:
    """The images and videos of one request, processed once and shared by all of its rows. It keeps the
    processor's output, not the decoded media: those can go once the request is prepared."""

    inputs: dict[str, torch.Tensor]  # pixel_values / image_grid_thw / pixel_values_videos / video_grid_thw
    image_slots: list[list[int]]  # token ids that replace each image placeholder
    video_slots: list[list[int]]  # token ids that replace each video placeholder
    # Vision-tower output by media kind ("image", "video"), filled the first time a row runs.
    features: dict[str, Features] | None = None
    # The content digest of each image and video by media kind, the feature cache's keys (``cache.py``): taken
    # while preparing, when the decoded media are at hand, and only when a cache will ask (None otherwise).
    contents: dict[str, list[str]] | None = None

    @property
    def visual_tokens(self) -> int:
        return sum(map(len, self.image_slots)) + sum(map(len, self.video_slots))


@dataclass(eq=False, slots=True)
class Row:
    """One prompt ready to run: a question (or its reversed-option twin) of one request."""

    key: str
    ids: list[int]
    options: int
    media: RequestMedia | None = None
    positions: torch.Tensor | None = None  # [3, length] multimodal RoPE positions; None means 0..length-1
    reversed: bool = False
    # The rendered prompt text (media placeholders unexpanded), kept for shared-prefix reuse
    # (``runtime/prefix.py`` splits it at the question header); None for rows built by hand.
    text: str | None = None
    # Its prompt's tokens, counted once: the passes read it several times a row (a row's ids are never changed).
    length: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.length = len(self.ids)


@dataclass(slots=True, weakref_slot=True)
class Prepared:
    """A validated, tokenized request: its rows (question prompts) and per-question errors."""

    keys: list[str]
    model_name: str
    questions: dict[str, Question] = field(default_factory=dict)
    errors: dict[str, dict[str, object]] = field(default_factory=dict)  # question id -> its error answer (JSON)
    rows: list[Row] = field(default_factory=list)
    media: RequestMedia | None = None
    contract: PromptContract = builtin_format

    @property
    def input_tokens(self) -> int:
        return sum([row.length for row in self.rows])

    def answers(self, probabilities: Mapping[Row, Sequence[float]]) -> dict[str, object]:
        """The response ``{"model", "answers", "usage"}`` from the probabilities of every row."""
        merged: dict[str, Sequence[float]] = {}
        twins: list[Row] = []  # reversed-option rows, averaged in once their originals are in
        tokens = 0
        for row in self.rows:
            tokens += len(row.ids)
            if row.reversed:
                twins.append(row)
            else:
                merged[row.key] = probabilities[row]
        for row in twins:
            merged[row.key] = average_orders(merged[row.key], probabilities[row])
        answers: dict[str, Mapping[str, object]] = {}
        errors, questions, contract = self.errors, self.questions, self.contract
        for key in self.keys:
            if key in errors:
                answers[key] = errors[key]
                continue
            question = questions[key]
            try:
                answers[key] = answer_object(question, merged[key], contract=contract)
            except ValueError as exc:
                answers[key] = question_error(question, "invalid_model_output", str(exc))
        return {"model": self.model_name, "answers": answers, "usage": {"input_tokens": tokens, "output_tokens": 0}}
