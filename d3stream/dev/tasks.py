"""A synthetic, seeded, labelled decision task: support tickets and pictures, generated in code.

The demo checkpoint is trained on it (``dev/train.py``) and judged on a held-out draw of it, so that
the embedded default answers something a reader can check, and ``d3stream compare --labels`` can say
which of two checkpoints is right, all offline. Every draw is a pure function of its seed.

Two kinds of requests:

* a **ticket** (``state``: ``{"ticket": n, "text": ...}``) with three questions: ``team`` (``choice``:
  billing, tech or sales), ``refund`` (``noul``: does the customer ask for money back) and ``urgency``
  (``score``: low, normal, urgent). The text is put together from templated sentences with varied
  wording, and the three answers are drawn independently (a tech ticket may ask for a refund too), so a
  model cannot get one right from another.
* a **picture** (an inline PNG of one to three coloured squares on a plain background) with one question,
  ``red_square`` (``noul``: is there a red square).

Labels are ``{"id", "question", "answer"}`` records, the format ``d3stream compare --labels`` reads:
the choice key, true / false, or the score level index.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

if TYPE_CHECKING:
    from d3stream.runtime import D3

# Seeds of the standard draws: training and the held-out set never share a seed.
TRAIN_SEED = 0
HELDOUT_SEED = 1

TEAM: dict[str, object] = {
    "type": "choice",
    "instructions": "Which team should handle this ticket?",
    "criteria": {"billing": "payments, charges, invoices", "tech": "bugs, errors, crashes, login", "sales": "plans, pricing, quotes"},
}
REFUND: dict[str, object] = {"type": "noul", "instructions": "Does the customer ask for their money back?"}
URGENCY: dict[str, object] = {"type": "score", "instructions": "How urgent is the ticket?", "criteria": ["low", "normal", "urgent"]}
TICKET_QUESTIONS: dict[str, dict[str, object]] = {"team": TEAM, "refund": REFUND, "urgency": URGENCY}
RED_SQUARE: dict[str, object] = {"type": "noul", "instructions": "Is there a red square in the picture?"}
PICTURE_QUESTIONS: dict[str, dict[str, object]] = {"red_square": RED_SQUARE}

_PRODUCTS = ("Pro plan", "Team plan", "mobile app", "desktop app", "starter kit", "annual subscription")
_AMOUNTS = ("$12", "$49", "$99", "19 EUR", "$240", "$7.50")
_TOPICS = {
    "billing": (
        "My card was charged twice for the {product}.",
        "I was billed {amount} but my invoice says something else.",
        "The payment for my {product} failed but the money left my account.",
        "Why is there an extra charge of {amount} on my statement?",
        "Please send me a corrected invoice for the {product}.",
        "You charged me {amount} after I cancelled the {product}.",
    ),
    "tech": (
        "The {product} crashes every time I open it.",
        "I cannot log in since the last update of the {product}.",
        "The {product} shows error 500 when I save a file.",
        "Sync in the {product} is broken and my files disappeared.",
        "The {product} freezes on the loading screen.",
        "Password reset emails for the {product} never arrive.",
    ),
    "sales": (
        "What does the {product} cost for a team of twenty?",
        "Can I get a quote for the {product}?",
        "Is there a discount if we buy the {product} for a year?",
        "I would like to upgrade to the {product}; what are the prices?",
        "Do you offer the {product} to schools at a lower price?",
        "We want to buy more seats on the {product}.",
    ),
}
_REFUND = (
    "I want a refund.",
    "Please give me my money back.",
    "I expect the {amount} to be refunded.",
    "Refund the charge, please.",
    "Return my payment of {amount}.",
)
_NO_REFUND = ("", "", "I have attached a screenshot.", "Thanks for your help.", "Let me know what you need from me.")
_URGENCY = (
    ("No rush on this.", "Whenever you get a chance.", "Low priority, just so you know.", "It can wait until next month."),
    ("", "Could you look at it this week?", "Let me know how to proceed."),
    ("This is urgent!", "Please fix this immediately.", "We need this solved today.", "ASAP please, our business is stuck."),
)
_GREETINGS = ("", "", "Hello,", "Hi team,", "Good morning,")

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "black": (20, 20, 20),
}
_BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (200, 215, 230), (245, 235, 215))
PICTURE_SIZE = 96


class Ticket(TypedDict):
    """A ticket's state."""

    ticket: int
    text: str


class TaskRequest(TypedDict):
    """A request of the task: a ticket (its state a ``Ticket``) or a picture (a sentence, and one image)."""

    id: str
    state: Ticket | str
    questions: dict[str, dict[str, object]]
    images: NotRequired[list[str]]  # a data: URL


# A label: the choice key (choice), true or false (noul), or the score level index (score).
Label = str | bool | int


@dataclass(frozen=True)
class Example:
    """One labelled request: the request (``id``, ``state``, ``questions``, maybe ``images``) and its labels
    by question id."""

    request: TaskRequest
    labels: dict[str, Label]

    @property
    def id(self) -> str:
        return self.request["id"]


def ticket(rng: random.Random, number: int, prefix: str) -> Example:
    """A support ticket with independently drawn team, refund and urgency."""
    team = rng.choice(list(_TOPICS))
    refund = rng.random() < 0.4
    urgency = rng.randrange(3)
    fill = {"product": rng.choice(_PRODUCTS), "amount": rng.choice(_AMOUNTS)}
    sentences = [
        rng.choice(_GREETINGS),
        rng.choice(_TOPICS[team]).format(**fill),
        (rng.choice(_REFUND) if refund else rng.choice(_NO_REFUND)).format(**fill),
        rng.choice(_URGENCY[urgency]),
    ]
    middle = sentences[1:3]
    rng.shuffle(middle)  # the refund sentence may come first
    text = " ".join(part for part in [sentences[0], *middle, sentences[3]] if part)
    request: TaskRequest = {"id": f"{prefix}-ticket-{number}", "state": {"ticket": 1000 + number, "text": text},
                            "questions": TICKET_QUESTIONS}
    return Example(request, {"team": team, "refund": refund, "urgency": urgency})


def picture_png(rng: random.Random, red: bool) -> bytes:
    """A PNG of one to three non-red squares on a plain background, one of them red when ``red``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (PICTURE_SIZE, PICTURE_SIZE), rng.choice(_BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    others = [name for name in COLOURS if name != "red"]
    colours = [rng.choice(others) for _ in range(rng.randint(1, 3) - (1 if red else 0))]
    if red:
        colours.insert(rng.randrange(len(colours) + 1), "red")
    for colour in colours:
        side = rng.randint(24, 40)
        x, y = rng.randint(0, PICTURE_SIZE - side), rng.randint(0, PICTURE_SIZE - side)
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def picture(rng: random.Random, number: int, prefix: str) -> Example:
    """An image request asking whether there is a red square (half of them have one)."""
    red = rng.random() < 0.5
    url = "data:image/png;base64," + base64.b64encode(picture_png(rng, red)).decode()
    request: TaskRequest = {"id": f"{prefix}-picture-{number}", "state": "A picture attached to a support ticket.",
                            "questions": PICTURE_QUESTIONS, "images": [url]}
    return Example(request, {"red_square": red})


def draw(seed: int, tickets: int, pictures: int = 0, prefix: str | None = None) -> list[Example]:
    """``tickets`` tickets and ``pictures`` pictures from ``seed``, interleaved; ids start with ``prefix``
    (default ``s<seed>``)."""
    rng = random.Random(seed)
    prefix = prefix or f"s{seed}"
    examples = [ticket(rng, number, prefix) for number in range(tickets)]
    examples += [picture(rng, number, prefix) for number in range(pictures)]
    rng.shuffle(examples)
    return examples


def heldout(tickets: int = 60, pictures: int = 20) -> list[Example]:
    """The standard held-out set: ``HELDOUT_SEED``, never trained on."""
    return draw(HELDOUT_SEED, tickets, pictures, prefix="heldout")


def showcase() -> list[Example]:
    """Hand-written tickets and two pictures whose answers a reader can judge at a glance (the demo's)."""
    texts: list[tuple[str, dict[str, Label]]] = [
        ("My card was charged twice for the Pro plan. Please give me my money back. This is urgent!",
         {"team": "billing", "refund": True, "urgency": 2}),
        ("The desktop app crashes every time I open it. No rush on this.",
         {"team": "tech", "refund": False, "urgency": 0}),
        ("Can I get a quote for the Team plan? Could you look at it this week?",
         {"team": "sales", "refund": False, "urgency": 1}),
        ("I cannot log in since the last update of the mobile app. I want a refund. We need this solved today.",
         {"team": "tech", "refund": True, "urgency": 2}),
    ]
    examples = [
        Example({"id": f"ticket-{number}", "state": {"ticket": 4311 + number, "text": text},
                 "questions": TICKET_QUESTIONS}, labels)
        for number, (text, labels) in enumerate(texts, 1)
    ]
    rng = random.Random(4312)
    for name, red in (("red", True), ("no-red", False)):
        url = "data:image/png;base64," + base64.b64encode(picture_png(rng, red)).decode()
        examples.append(Example({"id": f"picture-{name}", "state": "A picture attached to a support ticket.",
                                 "questions": PICTURE_QUESTIONS, "images": [url]}, {"red_square": red}))
    return examples


class LabelRecord(TypedDict):
    """One question's label, as ``d3stream compare --labels`` reads it."""

    id: str
    question: str
    answer: Label


def label_records(examples: Iterable[Example]) -> list[LabelRecord]:
    """``{"id", "question", "answer"}`` records for ``d3stream compare --labels``."""
    return [{"id": e.id, "question": key, "answer": value} for e in examples for key, value in e.labels.items()]


def write_task(out: str | Path, examples: list[Example]) -> tuple[Path, Path]:
    """``requests.jsonl`` (for ``d3stream produce``) and ``labels.jsonl`` (for ``compare --labels``) in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    requests, labels = out / "requests.jsonl", out / "labels.jsonl"
    requests.write_text("".join(json.dumps(e.request) + "\n" for e in examples), encoding="utf-8")
    labels.write_text("".join(json.dumps(r) + "\n" for r in label_records(examples)), encoding="utf-8")
    return requests, labels


def answer_records(model: D3, examples: Iterable[Example]) -> dict[str, dict[str, object]]:
    """Answer records by request id, from a loaded ``D3`` run in process (no Kafka): the input of
    ``d3stream.jobs.compare.compare`` with ``label_records`` as its labels."""
    answers: dict[str, dict[str, object]] = {}
    for example in examples:
        request = example.request
        response = model.system_one(state=request["state"], questions=request["questions"],
                                    images=request.get("images"))
        answers[example.id] = {"id": example.id, **response}
    return answers
