"""The synthetic workloads of ``d3stream bench`` (``bench.py``): requests shaped like real traffic, drawn from a seed.

* ``small``: many small requests, 1-3 questions each, prompts of about 50-400 tokens;
* ``long-state``: a state of about 2,000 tokens asked 10 questions;
* ``images``: 1-4 images of mixed sizes per request, drawn from a pool (so images repeat across requests);
* ``mixed``: the three above plus medium requests, interleaved.

``make_stream`` draws the operator's stream of ``bench stream``: small text requests, one in ten with an
image (``images_per_request`` of them, at most). ``make_repeated`` draws small text requests that ask the same
few questions of different states, as a stream does (``bench host --workload repeated``).

Kept apart from the harness so what is measured (here) reads apart from how it is measured (``bench.py``);
the same seed and tokenizer always give the same requests, which is what lets two runs compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from PIL.Image import Image

WORKLOADS = ("small", "long-state", "images", "mixed")
# Default request counts per workload (CPU, CUDA); --requests overrides, --scale multiplies.
DEFAULT_REQUESTS = {
    "small": (300, 1500),
    "long-state": (16, 48),
    "images": (40, 120),
    "mixed": (120, 400),
}
# Image sizes of the pool, from a vision tower's minimum to a 720p frame.
IMAGE_SIZES = ((224, 224), (320, 240), (448, 336), (512, 512), (640, 480), (800, 600), (1024, 768), (1280, 720))

_WORDS = (
    "robot corridor junction package delivery sensor battery door left right stop wait route blocked open "
    "closed customer ticket card charged twice refund account order shipped late early warehouse shelf box "
    "forklift driver camera signal light red green yellow traffic lane vehicle pedestrian crossing speed "
    "limit weather rain snow fog visibility temperature pressure valve pump alarm level high low normal "
    "status report error warning update firmware version network latency packet server client request "
    "response timeout retry queue worker shift manager team meeting schedule priority urgent routine "
    "inspection maintenance repair replace part supplier invoice payment balance credit debit transfer "
    "approved rejected pending review score risk fraud suspicious normal pattern history previous current "
    "next step plan goal target position distance meters seconds minutes hours north south east west "
    "floor room kitchen office entrance exit stairs elevator window table chair screen message email "
    "phone call voice text image photo video frame object person animal cat dog bird tree building street"
).split()


class Tokenizer(Protocol):
    """What the workloads need of a tokenizer: the ids of a text (to size filler text in tokens)."""

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Sequence[int]]: ...


@dataclass
class Request:
    """One synthetic request: a state, its questions (request JSON) and the images every question sees."""

    state: str
    questions: dict[str, dict[str, object]]
    images: list[Image] = field(default_factory=list)
    kind: str = ""


class _Text:
    """Seeded filler text of about a given number of tokens."""

    def __init__(self, rng: np.random.Generator, tokenizer: Tokenizer):
        self.rng = np.random.default_rng(12345)  # a sample of the generator's own text sets tokens per word
        sample = self.words(4000)
        self.tokens_per_word = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / 4000
        self.rng = rng

    def words(self, count: int) -> str:
        picked = self.rng.choice(len(_WORDS), size=max(1, count))
        out: list[str] = []
        for number, index in enumerate(picked):
            word = _WORDS[index]
            out.append(word.capitalize() if number == 0 or out[-1].endswith(".") else word)
            if self.rng.random() < 0.08:
                out[-1] += "."
            elif self.rng.random() < 0.05:
                out[-1] += f" {int(self.rng.integers(0, 1000))}"
        return " ".join(out) + "."

    def tokens(self, count: int) -> str:
        return self.words(max(1, round(count / self.tokens_per_word)))


def _question(rng: np.random.Generator, text: _Text) -> dict[str, object]:
    kind = rng.choice(["choice", "choice", "noul", "score"])
    if kind == "noul":
        return {"type": "noul", "instructions": text.words(int(rng.integers(4, 12))).rstrip(".") + "?"}
    if kind == "score":
        levels = int(rng.integers(3, 6))
        return {"type": "score", "instructions": text.words(int(rng.integers(4, 10))),
                "criteria": [f"level {n}" for n in range(levels)]}
    count = int(rng.integers(2, 7))
    keys = [str(_WORDS[i]) for i in rng.choice(len(_WORDS), size=count, replace=False)]
    criteria = {key: (text.words(int(rng.integers(1, 8))) if rng.random() < 0.8 else "") for key in keys}
    question: dict[str, object] = {"type": "choice", "criteria": criteria}
    if rng.random() < 0.6:
        question["instructions"] = text.words(int(rng.integers(4, 14))).rstrip(".") + "?"
    return question


def _questions(rng: np.random.Generator, text: _Text, count: int) -> dict[str, dict[str, object]]:
    return {f"q{n}": _question(rng, text) for n in range(count)}


def _image_pool(rng: np.random.Generator, count: int) -> list[Image]:
    from PIL import Image

    pool = []
    for number in range(count):
        width, height = IMAGE_SIZES[number % len(IMAGE_SIZES)]
        x = np.linspace(0, 1, width)[None, :, None]
        y = np.linspace(0, 1, height)[:, None, None]
        colour = rng.random(3)[None, None, :]
        pixels = (255 * (0.5 * x * colour + 0.3 * y + 0.2 * rng.random((height, width, 3)))).clip(0, 255)
        pool.append(Image.fromarray(pixels.astype("uint8"), "RGB"))
    return pool


class _Draw:
    """The request shapes of the workloads, each drawn from one generator in the order asked."""

    def __init__(self, rng: np.random.Generator, text: _Text, pool: list[Image]):
        self.rng, self.text, self.pool = rng, text, pool

    def small(self) -> Request:
        # The prompt template and a question take about 70-130 tokens; the state fills the rest.
        rng, text = self.rng, self.text
        return Request(text.tokens(int(rng.integers(0, 300))), _questions(rng, text, int(rng.integers(1, 4))),
                       kind="small")

    def long_state(self, tokens: int = 2000, questions: int = 10) -> Request:
        return Request(self.text.tokens(tokens), _questions(self.rng, self.text, questions), kind="long-state")

    def with_images(self, most: int = 4) -> Request:
        rng, text, pool = self.rng, self.text, self.pool
        picked = [pool[int(i)] for i in rng.integers(0, len(pool), size=int(rng.integers(1, most + 1)))]
        return Request(text.tokens(int(rng.integers(10, 120))), _questions(rng, text, int(rng.integers(1, 4))),
                       picked, kind="images")

    def mixed(self) -> Request:
        draw = self.rng.random()
        if draw < 0.55:
            return self.small()
        if draw < 0.65:
            return self.long_state()
        if draw < 0.85 and self.pool:
            return self.with_images()
        medium = self.long_state(int(self.rng.integers(300, 800)), int(self.rng.integers(3, 7)))
        medium.kind = "medium"
        return medium


def make_workload(name: str, count: int, seed: int, tokenizer: Tokenizer, *,
                  images_supported: bool = True) -> list[Request]:
    """``count`` requests of workload ``name``, a deterministic function of ``seed``."""
    rng = np.random.default_rng([seed, WORKLOADS.index(name)])
    text = _Text(rng, tokenizer)
    pool = _image_pool(rng, 10) if name in ("images", "mixed") and images_supported else []
    draw = _Draw(rng, text, pool)
    shape = {"small": draw.small, "long-state": draw.long_state, "images": draw.with_images}.get(name, draw.mixed)
    return [shape() for _ in range(count)]


STREAM_IMAGES_EVERY = 10  # one request in ten carries images
REPEATED_QUESTIONS = 6  # the questions a repeated stream asks, 1-3 of them per request


def make_stream(count: int, seed: int, tokenizer: Tokenizer, images_per_request: int = 1) -> list[Request]:
    """``count`` requests of an operator's stream: small text requests, and every ``STREAM_IMAGES_EVERY``-th
    (from the fifth) one with 1 to ``images_per_request`` images from a pool of ten (224x224 to 1280x720); a
    deterministic function of ``seed``."""
    rng = np.random.default_rng([seed, len(WORKLOADS)])
    draw = _Draw(rng, _Text(rng, tokenizer), _image_pool(rng, 10))
    middle = STREAM_IMAGES_EVERY // 2
    return [draw.with_images(images_per_request) if n % STREAM_IMAGES_EVERY == middle else draw.small()
            for n in range(count)]


def make_repeated(count: int, seed: int, tokenizer: Tokenizer) -> list[Request]:
    """``count`` small text requests, each asking 1-3 of the same ``REPEATED_QUESTIONS`` questions (drawn once
    from ``seed``, under the same ids) of a state of 20-200 tokens of its own: a stream's shape (a ticket router
    asks the same few questions of every ticket), where what a question costs once (its validation, its prompt
    piece's tokens) is not paid again per request. A deterministic function of ``seed``."""
    rng = np.random.default_rng([seed, len(WORKLOADS) + 1])
    text = _Text(rng, tokenizer)
    pool = list(_questions(rng, text, REPEATED_QUESTIONS).items())
    requests = []
    for _ in range(count):
        picked = sorted(rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False))
        requests.append(Request(text.tokens(int(rng.integers(20, 200))), dict(pool[int(i)] for i in picked),
                                kind="repeated"))
    return requests
