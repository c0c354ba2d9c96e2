"""What the tools call of a progress bar, as a type: tqdm ships no type information, so without this every
bar would be ``Any`` and a misspelt method would pass the type check."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """A tqdm bar as the tools use it: steps done, a label for the current step, closed at the end."""

    def update(self, n: float = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None: ...

    def close(self) -> None: ...
