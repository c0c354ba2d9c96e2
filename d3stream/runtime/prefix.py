"""Shared-prefix reuse: run the prompt prefix a request's questions share once, then each question's tail.

Every question of a request renders the same prompt up to the end of the state (system turn, images and
videos, ``State:`` block: ``format.py``), and only the tail (``\\n\\nQuestion: ...``, the options, the
assistant header) differs. The token ids every question's prompt starts with are the request's shared
prefix. With a **causal** checkpoint the hidden states of that prefix do not depend on what follows, so it
can run once per request: the prefix pass keeps the backbone's cache (the key/value cache of the
full-attention layers and the convolution and recurrent states of the Gated DeltaNet layers, both carried
by transformers' ``DynamicCache``), and each question's suffix then runs on that cache.

Batching. Prefix passes pack the prefixes of many requests (left-padded, exactly as ``D3.forward`` pads
full prompts). Suffix passes pack suffix rows **across requests**: the cached prefix states of the rows of
a pass are stacked, the key/value caches left-padded to the longest prefix of the pass (padding masked
out), the recurrent states need no padding (one fixed-size state per row), and the suffixes are
right-padded, so padding only ever follows a row's real tokens, which a causal model never reads. Rows are
grouped by prefix length first, then by suffix length, so little attention is spent on padding. The passes
themselves (the cache kept, sliced and stacked) are ``prefix_passes.py``'s; this module plans, batches and
checks them.

Safety:

* ``noncausal_full_attention`` checkpoints are refused (``PrefixReuseUnavailable``): there the prefix reads
  the question, so it cannot be shared.
* The split is taken from the rows' own token ids (media placeholders expanded), never from text: the
  longest run every row starts with, one token short of the shortest row. Whatever the tokenizer merges
  across the question header, the rows share exactly those tokens at exactly those positions, so a prefix
  pass over them leaves the states each row's full prompt would have there. A request whose rows carry
  different media, whose media placeholders lie beyond the shared ids or whose media positions differ over
  them runs with full prompts.
* Exact replay: with ``verify_every=N`` every Nth question served from a prefix is also run from scratch;
  ``max |Δp|`` of each check goes to ``on_check`` and ``report()``. A check above ``tolerance`` is logged,
  the questions of that round are answered again from full prompts, and (``sticky``, the default) the
  runner serves full prompts from then on.

Requests with fewer than ``min_rows`` rows (default 2) gain nothing from a shared prefix and simply run
as full prompts, packed under the same token budget.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import structlog

from d3stream.runtime.model import D3
from d3stream.runtime.packing import pack
from d3stream.runtime.prefix_passes import Plan, PrefixPasses, PrefixState, pack_suffixes, pairs
from d3stream.runtime.rows import Prepared, Row

log = structlog.get_logger(__name__)

DEFAULT_TOLERANCE = 1e-2
# Prefix tokens whose cached states one round may hold at once (then the next round starts).
DEFAULT_ROUND_TOKENS = 65_536


class PrefixReuseUnavailable(ValueError):
    """The checkpoint cannot share a prompt prefix between questions."""


def check_supported(model: D3) -> None:
    """Raise ``PrefixReuseUnavailable`` unless ``model`` reads its prompts causally."""
    if model.attention_mode != "causal":
        raise PrefixReuseUnavailable(
            f"shared-prefix reuse needs a causal checkpoint; this one uses attention_mode="
            f"{model.attention_mode!r}, where the prefix attends to the question that follows it, so its "
            "states differ for every question"
        )


@dataclass(frozen=True)
class Check:
    """One exact-replay comparison: a question served from a prefix, run again from scratch."""

    key: str
    reversed: bool
    max_abs_dp: float
    passed: bool


@dataclass(frozen=True)
class PassInfo:
    """One forward pass of the runner.

    ``kind``: ``prefix`` (fills caches, answers nothing), ``suffix`` (answers rows from caches), ``full``
    (answers rows from whole prompts) or ``verify`` (exact-replay check). ``real_tokens`` are the tokens
    run through the backbone, ``padded_tokens`` the padded grid (rows x longest run). ``attention_pairs``
    counts the (query, key) pairs causal attention really scores, for FLOP estimates. ``done``: the rows
    this pass answered (suffix and full passes); after a failed exact-replay check the round's rows are
    answered again by full passes, whose ``done`` lists them a second time (the later answer is the one
    ``run`` returns). ``prefixes``: the requests a prefix pass ran the shared prefix of.
    """

    kind: str
    rows: int
    real_tokens: int
    padded_tokens: int
    seconds: float
    attention_pairs: int = 0
    done: tuple[Row, ...] = ()
    prefixes: tuple[Plan, ...] = ()  # prefix passes: the requests whose prefixes it ran


class RunnerOptions(TypedDict, total=False):
    """The settings ``PrefixRunner`` takes by keyword (``reuse_probabilities`` passes them on)."""

    max_batch_tokens: int
    max_batch_rows: int
    max_cache_tokens: int | None
    round_tokens: int
    verify_every: int
    tolerance: float
    min_rows: int
    sticky: bool
    solo_prefix_tokens: int | None | str
    on_pass: Callable[[PassInfo], None] | None
    on_check: Callable[[Check], None] | None
    on_fallback: Callable[[str, Prepared], None] | None


class PrefixRunner:
    """Answers prepared requests, running each request's shared prompt prefix once."""

    def __init__(
        self,
        model: D3,
        *,
        max_batch_tokens: int = 4096,
        max_batch_rows: int = 64,
        max_cache_tokens: int | None = None,
        round_tokens: int = DEFAULT_ROUND_TOKENS,
        verify_every: int = 0,
        tolerance: float = DEFAULT_TOLERANCE,
        min_rows: int = 2,
        sticky: bool = True,
        solo_prefix_tokens: int | None | str = "auto",
        on_pass: Callable[[PassInfo], None] | None = None,
        on_check: Callable[[Check], None] | None = None,
        on_fallback: Callable[[str, Prepared], None] | None = None,
    ):
        check_supported(model)
        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be positive")
        if verify_every < 0:
            raise ValueError("verify_every must be >= 0")
        self.model = model
        self.passes = PrefixPasses(model)
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_batch_rows = int(max_batch_rows)
        # Padded cached-plus-new tokens of a suffix pass (memory and attention work of its cache).
        self.max_cache_tokens = int(max_cache_tokens or 16 * self.max_batch_tokens)
        self.round_tokens = int(round_tokens)
        self.verify_every = int(verify_every)
        self.tolerance = float(tolerance)
        self.min_rows = max(1, int(min_rows))
        # Prefixes at least this long run one per pass instead of left-padded together. On CPU, SDPA with a
        # padding mask leaves the flash kernel for the math one: two 2,048-token rows padded by one token ran
        # about 30 % slower per token than one row alone (20 % at 1,024, 5 % at 512). "auto": 1,024 on CPU,
        # never on CUDA (whose masked kernels keep up and which needs wide passes).
        if solo_prefix_tokens == "auto":
            solo_prefix_tokens = 1024 if model.device.type == "cpu" else None
        self.solo_prefix_tokens = int(solo_prefix_tokens) if solo_prefix_tokens else None
        self.sticky = sticky
        self.on_pass = on_pass
        self.on_check = on_check
        self.on_fallback = on_fallback
        self.disabled: str | None = None  # why the runner serves full prompts only (after a failed check)
        self.fallbacks: Counter[str] = Counter()
        # The most recent checks (a long-running worker must not keep them all), and running totals.
        self.checks: deque[Check] = deque(maxlen=1000)
        self.checks_run = 0
        self.checks_failed = 0
        self._max_abs_dp: float | None = None
        self.counts: Counter[str] = Counter()
        self._served = 0  # questions served from a prefix, for verify_every

    # ------------------------------------------------------------------------------------ planning

    def _fall_back(self, reason: str, prepared: Prepared) -> None:
        self.fallbacks[reason] += 1
        if self.on_fallback is not None:
            self.on_fallback(reason, prepared)

    def plan(self, prepared: Prepared) -> Plan | None:
        """The request split at its shared prefix, or None when it must run as full prompts."""
        rows = list(prepared.rows)
        if len(rows) < self.min_rows:
            return None
        if self.disabled is not None:
            self._fall_back("disabled", prepared)
            return None
        reason = None
        plan = None
        try:
            plan = split_at_question(self.model, prepared, rows)
        except _NoPlan as exc:
            reason = exc.reason
        if plan is None:
            self._fall_back(reason or "unknown", prepared)
        return plan

    # ------------------------------------------------------------------------------------- running

    def run(self, requests: Iterable[Prepared | Plan]) -> dict[Row, list[float]]:
        """Probabilities of every row of every request (shared prefixes where possible). A request may
        come already planned (``plan()`` ran earlier, e.g. off the model thread)."""
        plans: list[Plan] = []
        full: list[Row] = []
        for item in requests:
            if isinstance(item, Plan):
                # A check that failed since it was planned turned reuse off: full prompts then.
                plan = item if self.disabled is None else None
                prepared = item.prepared
            else:
                plan, prepared = self.plan(item), item
            if plan is None:
                full += prepared.rows
                self.counts["requests_full"] += 1
            else:
                plans.append(plan)
        results = self._run_full(full, kind="full")
        for chunk in self._rounds(plans):
            results.update(self._run_round(chunk))
        return results

    def run_one(self, prepared: Prepared) -> dict[Row, list[float]]:
        return self.run([prepared])

    def run_requests(self, requests: Sequence[Prepared | Plan]) -> list[dict[Row, list[float]]]:
        """``run`` with one result per request, in order: the shape ``BatchScheduler`` expects of its ``run``
        when its items are whole requests (``length=lambda prepared: prepared.input_tokens``)."""
        results = self.run(requests)
        return [{row: results[row] for row in item.rows} for item in requests]

    def _rounds(self, plans: list[Plan]) -> Iterable[list[Plan]]:
        chunk: list[Plan] = []
        tokens = 0
        for plan in plans:
            if chunk and tokens + plan.length > self.round_tokens:
                yield chunk
                chunk, tokens = [], 0
            chunk.append(plan)
            tokens += plan.length
        if chunk:
            yield chunk

    def _emit(self, info: PassInfo) -> None:
        if self.on_pass is not None:
            self.on_pass(info)

    def _run_full(self, rows: list[Row], *, kind: str) -> dict[Row, list[float]]:
        results: dict[Row, list[float]] = {}
        for group in pack(rows, lambda row: row.length, self.max_batch_rows, self.max_batch_tokens):
            started = time.perf_counter()
            values = self.model.forward(group)
            seconds = time.perf_counter() - started
            results.update(zip(group, values, strict=True))
            lengths = [row.length for row in group]
            self._emit(
                PassInfo(kind, len(group), sum(lengths), len(group) * max(lengths), seconds,
                         sum(pairs(n) for n in lengths), tuple(group) if kind == "full" else ())
            )
        if kind == "full":
            self.counts["rows_full"] += len(rows)
        return results

    def _run_round(self, plans: list[Plan]) -> dict[Row, list[float]]:
        states: dict[Plan, PrefixState] = {}
        # Long prefixes run one per pass where padding is expensive (see ``solo_prefix_tokens``).
        alone = [plan for plan in plans if self.solo_prefix_tokens and plan.length >= self.solo_prefix_tokens]
        packed = [plan for plan in plans if not (self.solo_prefix_tokens and plan.length >= self.solo_prefix_tokens)]
        groups = [[plan] for plan in alone]
        groups += pack(packed, lambda plan: plan.length, self.max_batch_rows, self.max_batch_tokens)
        for group in groups:
            states.update(self._prefix_pass(group))
        items = [(plan, row) for plan in plans for row in plan.rows]
        results: dict[Row, list[float]] = {}
        for suffixes in pack_suffixes(items, self.max_batch_rows, self.max_batch_tokens, self.max_cache_tokens):
            results.update(self._suffix_pass(suffixes, states))
        states.clear()
        self.counts["prefix_tokens"] += sum(plan.length for plan in plans)
        self.counts["suffix_tokens"] += sum(plan.suffix_length(row) for plan, row in items)

        if self.verify_every:
            chosen = []
            for _, row in items:
                if self._served % self.verify_every == 0:
                    chosen.append(row)
                self._served += 1
            if chosen and not self._verify(chosen, results):
                if self.sticky:
                    self.disabled = self.disabled or (
                        f"an exact-replay check differed from full prompts by more than {self.tolerance:g}"
                    )
                for plan in plans:
                    self._fall_back("verify_failed", plan.prepared)
                self.counts["requests_full"] += len(plans)
                return self._run_full([row for _, row in items], kind="full")
        else:
            self._served += len(items)
        self.counts["requests_reused"] += len(plans)
        self.counts["rows_reused"] += len(items)
        self.counts["saved_tokens"] += sum(plan.length * (len(plan.rows) - 1) for plan in plans)
        return results

    def _verify(self, rows: list[Row], results: dict[Row, list[float]]) -> bool:
        exact = self._run_full(rows, kind="verify")
        passed = True
        for row in rows:
            delta = max(abs(a - b) for a, b in zip(results[row], exact[row], strict=True))
            check = Check(row.key, row.reversed, delta, delta <= self.tolerance)
            self.checks.append(check)
            self.checks_run += 1
            self.checks_failed += not check.passed
            self._max_abs_dp = delta if self._max_abs_dp is None else max(self._max_abs_dp, delta)
            if self.on_check is not None:
                self.on_check(check)
            if not check.passed:
                passed = False
                log.warning(
                    "shared-prefix reuse differs from the full prompt; falling back to full prompts",
                    question=row.key, max_abs_dp=round(delta, 6), tolerance=self.tolerance,
                )
        return passed

    # -------------------------------------------------------------------------------------- passes

    def _prefix_pass(self, group: list[Plan]) -> dict[Plan, PrefixState]:
        """Run the prefixes of ``group`` (left-padded) and keep each one's cached states."""
        started = time.perf_counter()
        states, width = self.passes.prefixes(group)
        lengths = [plan.length for plan in group]
        self._emit(PassInfo("prefix", len(group), sum(lengths), len(group) * width, time.perf_counter() - started,
                            sum(pairs(n) for n in lengths), prefixes=tuple(group)))
        return states

    def _suffix_pass(self, group: list[tuple[Plan, Row]], states: dict[Plan, PrefixState]) -> dict[Row, list[float]]:
        """Answer the rows of ``group`` from their plans' cached prefixes (right-padded suffixes)."""
        started = time.perf_counter()
        rows, values, lengths = self.passes.suffixes(group, states)
        self._emit(
            PassInfo("suffix", len(group), sum(lengths), len(group) * max(lengths), time.perf_counter() - started,
                     sum(pairs(n, plan.length) for (plan, _), n in zip(group, lengths, strict=True)), tuple(rows))
        )
        return dict(zip(rows, values, strict=True))

    # ------------------------------------------------------------------------------------- records

    @property
    def max_abs_dp(self) -> float | None:
        return self._max_abs_dp

    def report(self) -> dict[str, object]:
        """Counters for metrics and benchmark reports."""
        return {
            "enabled": self.disabled is None,
            "disabled_reason": self.disabled,
            "verify_every": self.verify_every,
            "tolerance": self.tolerance,
            "requests_reused": self.counts["requests_reused"],
            "requests_full": self.counts["requests_full"],
            "rows_reused": self.counts["rows_reused"],
            "rows_full": self.counts["rows_full"],
            "prefix_tokens": self.counts["prefix_tokens"],
            "suffix_tokens": self.counts["suffix_tokens"],
            "saved_tokens": self.counts["saved_tokens"],
            "checks": self.checks_run,
            "failed_checks": self.checks_failed,
            "max_abs_dp": self.max_abs_dp,
            "fallbacks": dict(self.fallbacks),
        }

    def provenance(self) -> dict[str, object]:
        """What to merge into the model's provenance record when the runner serves answers."""
        return {
            "shared_prefix_reuse": {
                "split": "the longest run of token ids every question's prompt starts with",
                "policy": "the token ids every question's prompt of a request starts with (at least the prompt up "
                "to the question header) run once per request; each question's suffix runs on its cached states "
                "(full-attention key/value cache, Gated DeltaNet convolution and recurrent states); causal "
                "checkpoints only",
                "min_rows": self.min_rows,
                "verify_every": self.verify_every,
                "tolerance": self.tolerance,
            }
        }


class _NoPlan(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def split_at_question(model: D3, prepared: Prepared, rows: list[Row]) -> Plan:
    """``prepared`` split into one shared prefix and a suffix per row; ``_NoPlan`` names why it cannot be (then
    its rows run as full prompts).

    The prefix is the longest run of token ids every row starts with, one token short of the shortest row so
    every suffix has one. Every question renders the same prompt up to its question header, so that is at
    least the system turn, the media and the state. Taken from the rows' own ids it needs no tokenizer call
    and no text (tokenizing the prefix text again cost as much as a fifth of preparing a small request), and it
    is exact whatever the tokenizer does at the split: a causal model's states over those positions depend on
    those tokens alone."""
    import torch

    media = rows[0].media
    if any(row.media is not media for row in rows):
        raise _NoPlan("media_differs")
    first = rows[0].ids
    length = min(row.length for row in rows) - 1  # every suffix keeps a token of its own
    for row in rows[1:]:
        length = _shared_length(first, row.ids, length)
    if length < 1:
        raise _NoPlan("no_shared_prefix")
    vocabulary = model.checkpoint.vocabulary
    visual = {token for token in (vocabulary.image_token_id, vocabulary.video_token_id) if token is not None}
    if visual and any(not visual.isdisjoint(row.ids[length:]) for row in rows):
        raise _NoPlan("media_in_suffix")
    positions = None
    if rows[0].positions is not None:
        positions = rows[0].positions[:, :length]
        if any(row.positions is None or not torch.equal(row.positions[:, :length], positions) for row in rows):
            raise _NoPlan("positions_differ")
    return Plan(prepared, first[:length], positions, media, rows)


def _shared_length(first: list[int], ids: list[int], limit: int) -> int:
    """How many leading ids ``ids`` shares with ``first``, at most ``limit``: compared a slice at a time (in C),
    then id by id in the slice that differs."""
    step = 64
    for start in range(0, limit, step):
        end = min(start + step, limit)
        if ids[start:end] != first[start:end]:
            return next(n for n in range(start, end) if ids[n] != first[n])
    return limit


def reuse_probabilities(
    model: D3, requests: Sequence[Prepared], **options: Unpack[RunnerOptions]
) -> tuple[dict[Row, list[float]], PrefixRunner]:
    """One-shot helper: run ``requests`` through a fresh ``PrefixRunner(model, **options)``."""
    runner = PrefixRunner(model, **options)
    return runner.run(requests), runner
