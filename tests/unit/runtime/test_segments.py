"""Prompts tokenized piece by piece (d3stream/runtime/segments.py) give the tokenizer's own ids, always.

The pieces between added tokens are tokenized on their own and the short ones cached; that is only exact where
the tokenizer matches its added tokens as plain strings. Fuzzed texts of the characters that matter (added tokens
and fragments of them, newlines, spaces before and after, contractions the pre-tokenizer splits, non-ASCII) on the
session's Qwen3.5 tokenizer; a tokenizer whose added token strips the spaces beside it is left to itself.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from d3stream.runtime.segments import CACHED_PIECE_CHARS, PromptTokens


def _fuzzed_texts(added: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [*"ab Z\n\t .,:;!?'0123456789éü中🎉", *added, "<|im", "end|>", "<", "|>", "  ", "\r\n", "'s", "'LL",
                "\n\n", "\n\nQ", "\u0301"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(count)]


def test_piecewise_ids_are_the_tokenizers_on_fuzzed_text_with_added_tokens(qwen35_text_model):
    tokenizer = qwen35_text_model.tokenizer
    tokens = PromptTokens.of(tokenizer)
    assert tokens.piecewise
    added = [str(token.content) for token in tokenizer.added_tokens_decoder.values()]
    texts = _fuzzed_texts(added, 2000, seed=7)
    want = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tokens.ids(texts) == want
    assert tokens.ids(texts) == want  # the second time from the cache, the same


def test_a_real_prompt_and_one_over_the_cached_length_match_the_tokenizer(qwen35_text_model):
    prepared = qwen35_text_model.prepare("Ticket 7: refund asked twice.\t", {
        "q1": {"type": "noul", "instructions": "Is this a duplicate?"},
        "q2": {"type": "choice", "criteria": {"billing": "a billing team case", "ops": "an operations case"}},
    })
    assert len(prepared.rows) == 2, prepared.errors
    long = prepared.rows[0].text.replace("Ticket 7", "Ticket 7 " + "word " * CACHED_PIECE_CHARS)
    texts = [row.text for row in prepared.rows] + [long]
    tokenizer = qwen35_text_model.tokenizer
    assert PromptTokens.of(tokenizer).ids(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert [row.ids for row in prepared.rows] == tokenizer(texts[:2], add_special_tokens=False)["input_ids"]


def test_a_requests_state_goes_to_the_tokenizer_once_for_all_its_questions(qwen35_text_model):
    state = "Order 18: the parcel came back damaged, and the customer asks for a refund. " * 12
    questions = {f"q{n}": {"type": "noul", "instructions": f"Is point {n} settled?"} for n in range(3)}
    texts = [row.text for row in qwen35_text_model.prepare(state, questions).rows]
    tokenizer = qwen35_text_model.tokenizer
    tokens = PromptTokens.of(tokenizer)
    assert tokens.cut_paragraphs
    sent: list[str] = []
    encode = tokens._encode
    assert encode is not None
    tokens._encode = lambda pieces: sent.extend(pieces) or encode(pieces)
    assert tokens.ids(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert sum(state.strip() in piece for piece in sent) == 1, "the state was tokenized once per question"


def _small_tokenizer(separator: AddedToken) -> TokenizersBackend:
    vocabulary = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([separator])
    return TokenizersBackend(tokenizer_object=backend)


@pytest.mark.parametrize("strips", [False, True], ids=["plain", "strips-spaces"])
def test_a_tokenizer_whose_added_token_strips_spaces_is_left_to_itself(strips):
    tokenizer = _small_tokenizer(AddedToken("<sep>", lstrip=strips, rstrip=strips, special=True, normalized=False))
    tokens = PromptTokens.of(tokenizer)
    assert tokens.piecewise is not strips
    texts = ["a <sep> b", "a<sep>b c", "<sep><sep> c a"]
    assert tokens.ids(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]


def test_a_stand_in_tokenizer_without_a_rust_backend_is_called_as_it_is():
    calls = []

    def stand_in(texts, add_special_tokens):
        calls.append((texts, add_special_tokens))
        return {"input_ids": [[len(text)] for text in texts]}

    tokens = PromptTokens.of(stand_in)
    assert not tokens.piecewise
    assert tokens.ids(["ab", "abc"]) == [[2], [3]]
    assert calls == [(["ab", "abc"], False)]
