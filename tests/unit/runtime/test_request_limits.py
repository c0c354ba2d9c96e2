"""Request limits in the runtime (issue 11, points 4 and 6): the exact token count includes media tokens, the
early estimate refuses a costly request without tokenizing it and never refuses what the exact count accepts
(hypothesis), and answers to requests at the limits fit Kafka's default 1 MB message limit. On the broker:
tests/integration/test_limits.py."""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from d3stream_client.contract import (
    Answer,
    BatchRecord,
    ModelRecord,
    Provenance,
    Source,
    Timings,
    Worker,
    encode,
)
from d3stream_client.validation import DEFAULT_LIMITS, decode_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from d3stream.settings import Settings
from tests.support.media_makers import make_png
from tests.support.stream_helpers import Q_CHOICE, Q_NOUL

# Kafka's default limits: the broker's message.max.bytes (1048588) and the producer's max_request_size.
KAFKA_DEFAULT_MESSAGE_BYTES = 1_048_576
# A 180 KB state of ~22,500 tokens (under max_prompt_tokens, so each prompt alone would be served) asked
# 100 questions: ~2.25 M prompt tokens in all.
COSTLY_STATE = "charged " * 22_500
COSTLY_QUESTIONS = {f"q{n}": {"type": "noul", "instructions": f"Question {n}?"} for n in range(100)}


# ----------------------------------------------------------------------------------- prompt tokens


def test_the_exact_token_count_includes_media_tokens(qwen35_model, monkeypatch):
    model = qwen35_model
    image = make_png(64, 64, seed=3)
    text_only = model.prepare("a state", {"a": Q_NOUL, "b": Q_CHOICE}).input_tokens
    with_image = model.prepare("a state", {"a": Q_NOUL, "b": Q_CHOICE}, images=[image]).input_tokens
    assert with_image > text_only
    monkeypatch.setattr(model, "max_request_tokens", with_image - 1)
    model.prepare("a state", {"a": Q_NOUL, "b": Q_CHOICE})  # the text alone fits
    model.check_request_tokens("a state", {"a": Q_NOUL, "b": Q_CHOICE})  # the estimate cannot know the image
    with pytest.raises(ValueError, match=r"max_request_tokens \(" + f"{with_image - 1:,}"):
        model.prepare("a state", {"a": Q_NOUL, "b": Q_CHOICE}, images=[image])


def test_the_early_estimate_refuses_a_costly_request_without_tokenizing_it(qwen35_text_model, monkeypatch):
    model = qwen35_text_model
    monkeypatch.setattr(model, "max_request_tokens", Settings().limits.max_request_tokens)
    assert model.request_may_exceed_tokens(len(json.dumps(COSTLY_STATE)), len(COSTLY_QUESTIONS))
    assert not model.request_may_exceed_tokens(2_000, 8)  # ordinary requests skip the estimate
    calls = []
    monkeypatch.setattr(model, "tokenizer", _Counting(model.tokenizer, calls))
    with pytest.raises(ValueError, match="at least .* tokens in all .* max_request_tokens"):
        model.prepare(COSTLY_STATE, COSTLY_QUESTIONS)
    assert calls == []  # whole prompts were never tokenized


class _Counting:
    """The model's tokenizer, counting calls (the estimate reads its backend, not __call__)."""

    def __init__(self, tokenizer: Any, calls: list) -> None:
        self._tokenizer, self._calls = tokenizer, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._calls.append(args)
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=30))
state_values = st.one_of(
    st.text(min_size=0, max_size=400),
    st.text(alphabet=" \n\t.,:{}[]<|>'\"abcXYZ0123é你", max_size=400),
    st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                 max_leaves=30),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(state=state_values, questions=st.integers(min_value=1, max_value=6), averaged=st.booleans())
def test_the_estimate_never_refuses_what_the_exact_count_accepts(qwen35_text_model, monkeypatch, state, questions,
                                                                    averaged):
    model = qwen35_text_model
    asked = {f"q{n}": (Q_CHOICE if n % 2 else Q_NOUL) for n in range(questions)}
    monkeypatch.setattr(model, "max_request_tokens", None)
    exact = model.prepare(state, asked, permutation_average=averaged).input_tokens
    monkeypatch.setattr(model, "max_request_tokens", exact)
    model.check_request_tokens(state, asked, permutation_average=averaged)
    assert model.prepare(state, asked, permutation_average=averaged).input_tokens == exact
    monkeypatch.setattr(model, "max_request_tokens", exact - 1)
    with pytest.raises(ValueError, match="max_request_tokens"):
        model.prepare(state, asked, permutation_average=averaged)
    # The service's byte bound (which decides whether to estimate before fetching media) never calls a
    # request over the limit cheap.
    wire = json.dumps({"id": "r", "state": state, "questions": asked, "permutation_average": averaged}).encode()
    assert model.request_may_exceed_tokens(len(wire), len(asked))


# --------------------------------------------------------------------------------- answers fit Kafka


def _worst_cases() -> dict[str, dict[str, Any]]:
    """Requests at the default limits whose answers are as large as those limits allow."""
    limits = DEFAULT_LIMITS
    two_letter = [a + b for a in string.ascii_letters for b in string.ascii_letters]
    per_question = 255
    questions = limits.options // per_question
    # Score questions take at most 10 levels, each echoed in the legend too.
    score = {f"s{n:03d}": {"type": "score", "criteria": two_letter[:10]} for n in range(limits.questions)}
    long_key = 20  # about the longest option keys that let max_request_options options fit max_request_bytes
    choice = {
        f"c{n:03d}": {"type": "choice", "criteria": {f"{n:03d}{i:03d}".ljust(long_key, "k"): None
                                                     for i in range(per_question)}}
        for n in range(questions)
    }
    many = {f"{n:04d}".ljust(900, "q"): {"type": "noul"} for n in range(limits.questions)}
    cases = {"score levels": score, "long option keys": choice, "long question ids": many}
    requests = {}
    for name, asked in cases.items():
        request = {"id": "w" * 512, "state": "s", "questions": asked, "metadata": None}
        room = limits.bytes - len(json.dumps(request)) - 64
        request["metadata"] = "m" * max(0, room)  # echoed back: fill the record to max_request_bytes
        requests[name] = request
    return requests


@pytest.mark.parametrize("case", list(_worst_cases()))
def test_answers_at_the_limits_fit_the_kafka_message_limit(qwen35_text_model, case):
    request = _worst_cases()[case]
    wire = json.dumps(request).encode()
    decoded = decode_request(wire)  # within every default limit
    assert len(wire) > 0.95 * DEFAULT_LIMITS.bytes
    response = qwen35_text_model.system_one(state=decoded.state, questions=decoded.questions)
    assert not [key for key, answer in response["answers"].items() if "error" in answer]
    answer = Answer(
        id=decoded.id,
        answer_id="a" * 64,
        source=Source(topic="t" * 249, partition=2**31 - 1, offset=2**63 - 1, timestamp=2**62),
        model=response["model"],
        answers=response["answers"],
        usage=response["usage"],
        provenance=Provenance(
            model=ModelRecord(name=response["model"], runtime="d3-runtime/1", provenance_sha256="f" * 64),
            batch=BatchRecord(passes=99, rows=9_999, real_tokens=10**9, padded_tokens=10**9, saved_tokens=10**9),
            timings=Timings(queued=1e6, fetch=1e6, decode=1e6, prepare=1e6, forward=1e6, total=1e6),
            worker=Worker(host="h" * 253, pid=2**22, version="0.1.0"),
        ),
        metadata=decoded.metadata,
    )
    size = len(encode(answer))
    # Bounded by about the request's bytes plus 35 bytes per option (events.RequestLimits): here well under.
    print(f"{case}: request {len(wire):,} bytes, answer {size:,} bytes")
    assert size < 0.9 * KAFKA_DEFAULT_MESSAGE_BYTES, size
