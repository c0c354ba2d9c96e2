"""The demo checkpoint on wordings it was never trained on (``heldout_tickets.py``): it learned the task, not
the templates of ``d3stream/dev/tasks.py``.

Three sets, each ticket labelled for team, refund and urgency: the showcase tickets the demo prints, the
README's ``examples/requests.jsonl`` (both must be answered right, every question: they are what a newcomer
reads first), and 45 tickets written apart from the templates, held to an accuracy floor that the random
checkpoint it was trained from is far below. The checkpoint is the demo's own (``demo_trained_checkpoint``),
so these are the answers ``make demo`` and the README's stream give.
"""

from __future__ import annotations

import pytest

from d3stream.dev import tasks
from tests.unit.dev.heldout_tickets import readme_examples, showcase_tickets, wording_examples

# Measured: the demo checkpoint 0.93 (team 0.89, refund 1.0, urgency 0.91), the random one 0.35 (team 0.33,
# refund 0.2, urgency 0.51). The floors leave room for the training's rounding on another CPU, not for a
# checkpoint that answers from the templates (the one before issue 43: 0.62, team 0.42).
ACCURACY_FLOOR = 0.85
PER_QUESTION_FLOOR = {"team": 0.75, "refund": 0.8, "urgency": 0.75}

# The trained demo model loads once per pytest worker that runs a test of it: `make test` keeps the modules that
# judge it on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("demo-trained")


def _decisions(model: object, examples: list[tasks.Example]) -> dict[tuple[str, str], bool]:
    """Whether each question of each example is answered as labelled: the most probable choice, p(true) above
    one half, the score level nearest the expected score."""
    answers = tasks.answer_records(model, examples)  # type: ignore[arg-type]
    return {(example.id, question): _is_right(answers[example.id]["answers"][question], label)
            for example in examples for question, label in example.labels.items()}


def _is_right(slot: dict, label: tasks.Label) -> bool:
    if slot["type"] == "choice":
        return slot["choice"] == label
    if slot["type"] == "noul":
        return (slot["noul"] > 0.5) == label
    return round(slot["score"]) == label


def _accuracy(right: dict[tuple[str, str], bool], question: str | None = None) -> float:
    values = [ok for (_, name), ok in right.items() if question in (None, name)]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def trained_wordings(demo_trained_model) -> dict[tuple[str, str], bool]:
    return _decisions(demo_trained_model, wording_examples())


def test_the_showcase_and_the_readme_examples_are_answered_right(demo_trained_model):
    right = _decisions(demo_trained_model, showcase_tickets() + readme_examples())
    assert len(right) == 3 * (4 + 3)
    assert [key for key, ok in right.items() if not ok] == []


def test_wordings_never_trained_on_are_answered_above_the_floor(trained_wordings):
    assert len(trained_wordings) == 3 * 45
    accuracy = {name: _accuracy(trained_wordings, name) for name in PER_QUESTION_FLOOR}
    assert _accuracy(trained_wordings) >= ACCURACY_FLOOR, accuracy
    for name, floor in PER_QUESTION_FLOOR.items():
        assert accuracy[name] >= floor, accuracy


def test_the_random_checkpoint_is_far_below_the_floor(demo_random_model):
    """The floor means something: the weights the demo checkpoint started from do not come near it."""
    assert _accuracy(_decisions(demo_random_model, wording_examples())) < ACCURACY_FLOOR - 0.3
