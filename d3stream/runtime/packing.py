"""Packing rows of many requests into forward passes under a row and padded-token budget.

A pass is padded to its longest row, so rows of similar length go together: sorted longest first, each pass
takes rows until one more would pass ``max_rows`` or make ``rows x longest`` pass ``max_tokens``. Pure and
generic over the row type, so the row scheduler (``core/batching.py``) and the shared-prefix runner
(``runtime/prefix.py``) cut their passes the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def pack(items: Sequence[T], length: Callable[[T], int], max_rows: int, max_tokens: int) -> list[list[T]]:
    """Passes of at most ``max_rows`` items and ``max_tokens`` padded tokens, similar lengths together."""
    ordered = sorted(items, key=length, reverse=True)
    passes: list[list[T]] = []
    current: list[T] = []
    longest = 0
    for item in ordered:
        size = length(item)
        if current and (len(current) >= max_rows or (len(current) + 1) * max(longest, size) > max_tokens):
            passes.append(current)
            current, longest = [], 0
        current.append(item)
        longest = max(longest, size)
    if current:
        passes.append(current)
    return passes
