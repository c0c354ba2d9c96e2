"""Token ids of prompt texts, with the pieces every prompt shares tokenized once.

A fast tokenizer cuts a text at its added tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>``, the vision
tokens) before anything else, then normalizes, pre-tokenizes and encodes each piece between them on its own.
So a prompt's ids are its pieces' ids in order, and the pieces the prompts of a checkpoint share (the system
turn, the assistant's opening, the newlines between turns) need tokenizing once, not once per question.
``PromptTokens`` keeps the ids of short pieces in a bounded cache and hands the others (a question's user
turn: its state and question) to the tokenizer's batch call in one go, as before: that call releases the GIL
while it runs (the event loop goes on beside it) and spreads the pieces over the tokenizer's threads.

Exact by construction only where the added tokens are matched as the plain strings they are (no stripping
of spaces beside them, not normalized), and checked: ``PromptTokens.of`` compares its ids with the
tokenizer's on a probe that holds every added token, and otherwise leaves every text to the tokenizer
itself (as it does for a tokenizer without a Rust backend, or a test's stand-in).

A piece is also cut after each blank line that a visible character follows (``PARAGRAPH``): the user turn has
one between the state and the question, so the state of a request's questions is one piece, tokenized once
per request instead of once per question (the tokenizer's regular expression is most of a prompt's cost). That
is exact where the pre-tokenizer never joins a line break to the text after it (Qwen's expression ends every
match that takes a line break at the last one), and checked on a probe of its own; a tokenizer that fails it
is still cut at its added tokens.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

# Pieces up to this many characters are cached: the template's own pieces are a few dozen, a user turn with
# its state is usually longer and never seen twice.
CACHED_PIECE_CHARS = 512
# Pieces kept at most (a few per prompt contract and media count are ever reused).
CACHED_PIECES = 1024
# Where a piece is cut again: after a blank line, before the visible character that follows it.
PARAGRAPH = re.compile(r"(?<=\n\n)(?=\S)")
# What the cut is checked on: blank lines after punctuation, digits, contractions, spaces and a combining mark.
_CUT_PROBE = "State:\nA b.\n\nQuestion: x?\n\n\nY's\n\n  z \n\n12\n\n中文\n\n\u0301y\r\n\r\nZ\n\n'll\n\n"


class PromptTokens:
    """``ids(texts)``: the token ids ``tokenizer(texts, add_special_tokens=False)`` gives, piece by piece."""

    def __init__(self, tokenizer: Any, encode: Callable[[list[str]], list[list[int]]] | None,
                 added: dict[str, int], *, cut_paragraphs: bool = False):
        self.tokenizer = tokenizer  # what the ids are for (a caller may swap a checkpoint's tokenizer)
        self._encode = encode
        self._added = added
        self.cut_paragraphs = cut_paragraphs  # pieces are cut after their blank lines too (PARAGRAPH)
        # Leftmost, then longest first, as the tokenizer's matcher takes them.
        self._added_pattern = (
            re.compile("|".join(re.escape(token) for token in sorted(added, key=len, reverse=True)))
            if added else None
        )
        self._cache: dict[str, list[int]] = {}  # short pieces' ids, least recently used first
        self._lock = threading.Lock()  # a model may prepare on more than one thread (replay, benchmarks)

    @classmethod
    def of(cls, tokenizer: Any) -> PromptTokens:
        """Piecewise where that is exact for ``tokenizer`` (module docstring), else the tokenizer's own call."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return cls(tokenizer, None, {})
        plain = all(
            not (token.lstrip or token.rstrip or token.single_word or token.normalized)
            for token in tokenizer.added_tokens_decoder.values()
        )
        if not plain:
            return cls(tokenizer, None, {})
        added = {str(token.content): int(index) for index, token in tokenizer.added_tokens_decoder.items()}

        def encode(pieces: list[str]) -> list[list[int]]:
            return [encoding.ids for encoding in backend.encode_batch(pieces, add_special_tokens=False)]

        def exact(pieces: PromptTokens, probe: str) -> bool:
            return pieces.ids([probe]) == [list(ids) for ids in tokenizer([probe], add_special_tokens=False)["input_ids"]]

        added_probe = "\n".join(f" x{token}y\t{token}" for token in added) + " Zürich 12.5\n\n"
        pieces = cls(tokenizer, encode, added)
        if not exact(pieces, added_probe):
            return cls(tokenizer, None, {})
        cut = cls(tokenizer, encode, added, cut_paragraphs=True)
        return cut if exact(cut, added_probe + _CUT_PROBE) and exact(cut, _CUT_PROBE) else pieces

    @property
    def piecewise(self) -> bool:
        """Whether texts are tokenized piece by piece (else by the tokenizer's own call)."""
        return self._encode is not None

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, no special tokens added."""
        if self._encode is None:
            return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
        split = [self._split(text) for text in texts]
        with self._lock:
            known = {piece: self._recall(piece) for parts in split for piece in parts
                     if isinstance(piece, str) and piece in self._cache}
        fresh = list({piece for parts in split for piece in parts if isinstance(piece, str) and piece not in known})
        if fresh:
            known.update(zip(fresh, self._encode(fresh), strict=True))
            with self._lock:
                for piece in fresh:
                    if len(piece) <= CACHED_PIECE_CHARS:
                        self._remember(piece, known[piece])
        out: list[list[int]] = []
        for parts in split:
            ids: list[int] = []
            for part in parts:
                if isinstance(part, int):
                    ids.append(part)
                else:
                    ids += known[part]
            out.append(ids)
        return out

    def _split(self, text: str) -> list[str | int]:
        """``text`` as its pieces (str) and added tokens (their ids), in order."""
        parts: list[str | int] = []
        start = 0
        if self._added_pattern is not None:
            for match in self._added_pattern.finditer(text):
                if match.start() > start:
                    parts.append(text[start:match.start()])
                parts.append(self._added[match.group()])
                start = match.end()
        if start < len(text):
            parts.append(text[start:])
        if not self.cut_paragraphs:
            return parts
        return [piece for part in parts
                for piece in ((part,) if isinstance(part, int) else PARAGRAPH.split(part)) if piece != ""]

    def _recall(self, piece: str) -> list[int]:
        """A cached piece's ids, the piece now the most recently used (the template's pieces stay)."""
        ids = self._cache.pop(piece)
        self._cache[piece] = ids
        return ids

    def _remember(self, piece: str, ids: list[int]) -> None:
        if len(self._cache) >= CACHED_PIECES:
            self._cache.pop(next(iter(self._cache)))  # the least recently used
        self._cache[piece] = ids
