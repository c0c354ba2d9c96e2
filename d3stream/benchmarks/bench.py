"""``d3stream bench``: the reference per-request path against d3stream's batching, on one machine, in one run.

Workloads are synthetic but shaped like real traffic, drawn from a seed (``bench_workloads.py``):

* ``small``: many small requests, 1-3 questions each, prompts of about 50-400 tokens;
* ``long-state``: a state of about 2,000 tokens asked 10 questions;
* ``images``: 1-4 images of mixed sizes per request, drawn from a pool (so images repeat across requests);
* ``mixed``: the three above plus medium requests, interleaved.

Every workload runs through three paths on the same model and the same prepared requests:

* **a** the reference path: one request at a time, ``batch_size`` (8) questions per pass, padded to the
  longest (``D3.run``);
* **b** cross-event token-budget batching: the rows of all requests packed (``runtime.packing.pack``) into passes
  of at most ``max_batch_tokens`` padded tokens, then ``D3.forward``; with the media-feature cache;
* **c** b with shared-prefix reuse (``runtime/prefix.py``; causal checkpoints only).

Throughput is measured with every request available at once (questions/s, input tokens/s, real / padded
tokens). ``--repeat N`` runs N interleaved rounds of a, b, c; every pass then counts at its fastest of the N
(as each shape of the calibration sweep does), plus the least time any round spent between passes, which
filters bursts of load from other processes on a shared machine (the latency runs are repeated too, and
each path reports its run with the lowest mean latency). Latency is measured under a Poisson arrival process: arrivals are replayed on a virtual clock
while the passes really run, and the clock advances by each pass's measured duration (a: one request at a
time, first come first served; b and c: the service's scheduler rule, i.e. collect for ``linger_ms`` after
the oldest waiting request or until a pass is full, then run everything waiting). A question's latency is
the time from its request's arrival until the whole request is answered (the service publishes one answer
per request). The rate defaults to 70 % of what path a sustains on that workload.

A calibration sweep of batch shapes (rows x length, no padding) runs first: its best tokens/s is the
device's saturated forward throughput (``b_over_peak`` compares b with it), and ``--calibrate`` widens the
sweep and prints the ``max_batch_tokens`` to give the service (the smallest budget within 5 % of the best).

``--variant buckets`` / ``--variant media_per_request`` add ``b_buckets`` / ``b_media_per_request``: path b
with padded widths rounded to length buckets, or with each request's images encoded on their own instead of
all of a pass's together (throughput only; ``b_<variant>_over_b`` and ``b_<variant>_max_abs_dp`` compare).

``max_abs_dp`` is the largest |Δp| between c's and b's probabilities over every question (prefix reuse
against full prompts). Peak memory: resident set size sampled during each path, and on CUDA
``torch.cuda.max_memory_allocated``. Model FLOPs: 2 x non-embedding parameters x tokens run + 4 x
full-attention layers x heads x head_dim x scored (query, key) pairs (vision tower not counted).

``d3stream bench workloads`` runs it (``d3stream/cli/bench.py``: every benchmark is a subcommand there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

import numpy as np

from d3stream.benchmarks.bench_workloads import DEFAULT_REQUESTS, WORKLOADS, Request, make_workload
from d3stream.dev.progress import Progress
from d3stream.dev.tasks import TaskRequest, heldout

# The runtime's public names only (the runtime package imports neither torch nor transformers until a model
# loads, so the CLI's ``--help`` stays quick): a runtime change that breaks the harness fails here, at import.
from d3stream.runtime import D3, Prepared, Row
from d3stream.runtime.cache import MediaFeatureCache
from d3stream.runtime.device import reference_kernels
from d3stream.runtime.forward import bucketed_width
from d3stream.runtime.packing import pack
from d3stream.runtime.prefix import PassInfo, PrefixReuseUnavailable, PrefixRunner, check_supported

if TYPE_CHECKING:
    import torch

H200_BF16_PEAK_TFLOPS = 989.0
REFERENCE_BATCH_SIZE = 8
DEFAULT_RATE_SHARE = 0.7
# ``--variant NAME``: path b run once more with one runtime choice flipped, throughput and |Δp| beside b
# (named ``b_NAME`` in the report), so a choice is kept only when the same run shows it pays.
VARIANTS = {
    "buckets": "with padded widths rounded to length buckets (D3.pad_buckets)",
    "media_per_request": "with each request's media encoded on its own (D3.media_batch_patches = 0)",
}


# ---------------------------------------------------------------------------------------- measuring


class PeakFigures(TypedDict):
    """Peak memory of one run, in MB: resident set size, and allocated device memory (None off CUDA)."""

    peak_rss_mb: float
    peak_cuda_mb: float | None


PeakKey = Literal["peak_rss_mb", "peak_cuda_mb"]
PEAK_KEYS: tuple[PeakKey, ...] = ("peak_rss_mb", "peak_cuda_mb")


class PeakMemory:
    """Peak resident set size (sampled every few ms) and, on CUDA, peak allocated device memory."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval = device, interval
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        import psutil

        process = psutil.Process()
        self.peak_rss = process.memory_info().rss
        if self.device.type == "cuda":
            import torch  # loaded with the model already

            torch.cuda.reset_peak_memory_stats(self.device)

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self.peak_rss = max(self.peak_rss, process.memory_info().rss)

        self._thread = threading.Thread(target=sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        import psutil

        self.peak_rss = max(self.peak_rss, psutil.Process().memory_info().rss)

    def figures(self) -> PeakFigures:
        cuda = None
        if self.device.type == "cuda":
            import torch

            cuda = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return {"peak_rss_mb": round(self.peak_rss / 2**20, 1), "peak_cuda_mb": cuda}


@dataclass
class Pass:
    kind: str
    rows: int
    real: int
    padded: int
    seconds: float
    pairs: int


@dataclass
class Tally:
    """Passes of one throughput run."""

    passes: list[Pass] = field(default_factory=list)

    def add(self, kind: str, lengths: Sequence[int], seconds: float, pairs: int | None = None,
            width: int | None = None) -> None:
        """One pass of rows of ``lengths``, padded to ``width`` (default: the longest)."""
        lengths = list(lengths)
        if pairs is None:
            pairs = sum(n * (n + 1) // 2 for n in lengths)
        width = max(lengths) if width is None else width
        self.passes.append(Pass(kind, len(lengths), sum(lengths), len(lengths) * width, seconds, pairs))

    @property
    def real(self) -> int:
        return sum(p.real for p in self.passes)

    @property
    def padded(self) -> int:
        return sum(p.padded for p in self.passes)

    @property
    def pairs(self) -> int:
        return sum(p.pairs for p in self.passes)


@dataclass
class Rounds:
    """What the throughput rounds of one path measured: each round's passes, wall time and peak memory, and
    the last round's media-cache and prefix-reuse counters."""

    tallies: list[Tally] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    peaks: list[PeakFigures] = field(default_factory=list)
    media_cache: Mapping[str, object] | None = None  # MediaFeatureCache.stats()
    prefix: Mapping[str, object] | None = None  # PrefixRunner.report()

    def peak(self, key: PeakKey) -> float | None:
        """The largest of the rounds' ``key`` figures (``peak_rss_mb``, ``peak_cuda_mb``); None: none measured."""
        values = [value for peak in self.peaks if (value := peak[key]) is not None]
        return max(values) if values else None

    def figures(self, prepared: Sequence[Prepared], flops: Flops, peak_tflops: float | None) -> PathFigures:
        """The path's throughput record: each pass at its fastest round (``best_seconds``), peak memory."""
        seconds = best_seconds(self.tallies, self.walls)
        figures = throughput_figures(self.tallies[-1], seconds, prepared, flops, peak_tflops)
        return {**figures, "peak_rss_mb": self.peak("peak_rss_mb"), "peak_cuda_mb": self.peak("peak_cuda_mb"),
                "round_seconds": [round(wall, 4) for wall in self.walls], "media_cache": self.media_cache}


class Shape(TypedDict):
    """One shape of the calibration sweep: unpadded rows x length and its best time."""

    rows: int
    length: int
    tokens: int
    tokens_per_s: float
    seconds: float


class Peak(TypedDict):
    """What the calibration sweep gives: the saturated throughput, its shape and the recommended budget (each
    workload's ``calibration`` in the report)."""

    peak_tokens_per_s: float
    best_shape: list[int]
    max_batch_tokens: int


class Calibration(Peak):
    """The calibration sweep and what it gives."""

    sweep: list[Shape]


class Throughput(TypedDict):
    """One path's throughput figures (``throughput_figures``)."""

    seconds: float
    questions: int
    questions_per_s: float
    requests_per_s: float
    input_tokens_per_s: float
    computed_tokens_per_s: float
    real_tokens: int
    padded_tokens: int
    real_over_padded: float | None
    passes: int
    model_tflops_per_s: float
    mfu: float | None


class Latency(TypedDict):
    """One path's latency under Poisson arrivals (``latency_figures``), in ms."""

    rate_rps: float
    linger_ms: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    runs: int


class PathFigures(Throughput):
    """One path's record in the report: throughput, peak memory and the caches' counters; latency (not for
    b's variants) and prefix reuse (c) added as they are measured."""

    peak_rss_mb: float | None
    peak_cuda_mb: float | None
    round_seconds: list[float]
    media_cache: Mapping[str, object] | None
    prefix: NotRequired[Mapping[str, object] | None]
    latency: NotRequired[Latency]


class Comparison(TypedDict):
    """The paths against each other and against the calibrated peak (``comparison``)."""

    b_over_a: float
    b_over_peak: float
    b_over_peak_at_length: float
    c_over_b: float | None
    real_over_padded: float | None
    max_abs_dp: float | None


class VariantComparison(TypedDict):
    """A variant of b against b (``b_<variant>_over_b`` and ``b_<variant>_max_abs_dp`` in the report)."""

    over_b: float
    max_abs_dp: float


class WorkloadShape(TypedDict):
    """What a workload held (its ``workload`` in the report)."""

    requests: int
    questions: int
    input_tokens: int
    prompt_tokens: dict[str, int]  # min, p50, max
    images: int
    seed: int


class Setup(TypedDict):
    """The run's settings and machine (``Bench.setup``; ``run_bench`` adds the checkpoint and its kernels)."""

    device: str
    load_average_1m: float | None
    repeat: int
    threads: int
    parameters: int
    flop_parameters: int
    max_batch_tokens: int
    max_batch_rows: int
    reference_batch_size: int
    verify_every: int
    peak_tflops: float | None
    media_batch_patches: int
    pad_buckets: bool
    checkpoint: NotRequired[str]
    kernels: NotRequired[dict[str, str]]


@dataclass
class WorkloadRun:
    """One workload's figures (``Bench.workload``). Its object in the report (``entry``) is flat: each path's
    record and the comparisons beside ``workload``, ``setup`` and ``calibration``."""

    workload: WorkloadShape
    paths: dict[str, PathFigures]  # a, b, c (where prefix reuse works), then b_<variant>
    comparison: Comparison
    variants: dict[str, VariantComparison]
    setup: Setup
    calibration: Peak

    def entry(self) -> dict[str, object]:
        """The workload's object in the JSON report."""
        variants: dict[str, float] = {}
        for variant, compared in self.variants.items():
            variants[f"b_{variant}_over_b"] = compared["over_b"]
            variants[f"b_{variant}_max_abs_dp"] = compared["max_abs_dp"]
        return {"workload": self.workload, **self.paths, **self.comparison, **variants, "setup": self.setup,
                "calibration": self.calibration}


def report_of(runs: Mapping[str, WorkloadRun]) -> dict[str, dict[str, object]]:
    """The JSON report: each workload's object by name."""
    return {name: run.entry() for name, run in runs.items()}


# A scheduler's run of the waiting requests: ``execute(requests, finished)`` (``schedule``).
Execute = Callable[[list[int], Callable[[int, float], None]], None]
# Probabilities of every row a path answered.
Results = dict[Row, list[float]]


def best_seconds(tallies: Sequence[Tally], walls: Sequence[float]) -> float:
    """Seconds of a path measured in several rounds: each pass at its fastest plus the least time any round
    spent between passes; the fastest wall time when the rounds did not run the same passes."""
    shapes = [[(p.kind, p.rows, p.real) for p in tally.passes] for tally in tallies]
    if len(tallies) == 1 or any(shape != shapes[0] for shape in shapes):
        return min(walls)
    passes = sum(min(tally.passes[i].seconds for tally in tallies) for i in range(len(shapes[0])))
    between = min(wall - sum(p.seconds for p in tally.passes) for wall, tally in zip(walls, tallies, strict=True))
    return passes + max(0.0, between)


def length_peak(calibration: Calibration, lengths: Sequence[int]) -> float:
    """Best tokens/s of the sweep among shapes whose row length is nearest (in ratio) the mean of ``lengths``."""
    mean = statistics.fmean(lengths)
    swept = {shape["length"] for shape in calibration["sweep"]}
    nearest = min(swept, key=lambda length: abs(math.log(length / mean)))
    return max(shape["tokens_per_s"] for shape in calibration["sweep"] if shape["length"] == nearest)


def sweep_sizes(sweep: str, cuda: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row lengths and padded-token budgets of a calibration sweep (``quick``, ``default`` or ``wide``)."""
    if sweep == "quick":
        return (128, 512), (1024, 4096)
    if cuda:
        lengths = (256, 512, 1024, 2048, 4096) if sweep == "wide" else (256, 1024, 2048)
        budgets = (4096, 8192, 16384, 32768, 65536, 131072) if sweep == "wide" else (4096, 16384, 65536)
        return lengths, budgets
    if sweep == "wide":
        return (64, 128, 256, 512, 1024, 2048, 4096), (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    return (128, 256, 512, 1024, 2048), (512, 1024, 2048, 4096, 8192, 16384)


def sweep_shapes(lengths: Sequence[int], budgets: Sequence[int], max_rows: int) -> list[tuple[int, int]]:
    """(rows, length) of every budget and length: budgets are padded tokens per pass, as the service counts
    them; rows stay within ``max_rows``."""
    return sorted({(max(1, budget // length), length) for budget in budgets for length in lengths
                   if length <= budget and budget // length <= max_rows})


def summarise_sweep(sweep: list[Shape]) -> Calibration:
    """The sweep's best throughput, and the smallest budget within 5 % of it (``max_batch_tokens``)."""
    peak = max(sweep, key=lambda s: s["tokens_per_s"])
    by_budget: dict[int, float] = {}
    for shape in sweep:
        by_budget[shape["tokens"]] = max(by_budget.get(shape["tokens"], 0.0), shape["tokens_per_s"])
    recommended = min(t for t, rate in by_budget.items() if rate >= 0.95 * peak["tokens_per_s"])
    return {
        "peak_tokens_per_s": peak["tokens_per_s"],
        "best_shape": [peak["rows"], peak["length"]],
        "max_batch_tokens": recommended,
        "sweep": sweep,
    }


@contextlib.contextmanager
def variant_of_b(model: D3, variant: str) -> Iterator[None]:
    """Path b's runtime choice ``variant`` (``VARIANTS``) flipped on ``model`` for the duration."""
    saved = model.pad_buckets, model.media_batch_patches
    if variant == "buckets":
        model.pad_buckets = True
    elif variant == "media_per_request":
        model.media_batch_patches = 0
    else:
        raise ValueError(f"unknown variant {variant!r}")
    try:
        yield
    finally:
        model.pad_buckets, model.media_batch_patches = saved


def _reset_media(prepared: Sequence[Prepared]) -> None:
    for request in prepared:
        if request.media is not None:
            request.media.features = None


def _nearest_rank(ordered: Sequence[float], share: float) -> float:
    return ordered[max(1, math.ceil(share * len(ordered))) - 1]


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile (``share`` in 0..1) of ``values``."""
    if not values:
        return None
    return _nearest_rank(sorted(values), share)


def question_waits(prepared: Sequence[Prepared], arrivals: Sequence[float], done: Sequence[float]) -> list[float]:
    """Every question's wait (ms): its request's arrival until the whole request is answered."""
    waits: list[float] = []
    for request, arrival, finish in zip(prepared, arrivals, done, strict=True):
        waits += [1000.0 * (finish - arrival)] * len(request.rows)
    return waits


def latency_figures(waits: Sequence[float], rps: float, linger_ms: float, runs: int) -> Latency:
    """The latency record of one simulated run: percentiles and mean of every question's wait (ms)."""
    ordered = sorted(waits)
    return {
        "rate_rps": round(rps, 3),
        "linger_ms": linger_ms,
        "p50_ms": round(_nearest_rank(ordered, 0.50), 2),
        "p99_ms": round(_nearest_rank(ordered, 0.99), 2),
        "mean_ms": round(statistics.fmean(waits), 2),
        "runs": runs,
    }


def poisson_arrivals(rps: float, count: int, seed: int, workload: str) -> list[float]:
    """Arrival times (s) of ``count`` requests at ``rps`` a second, drawn from the seed and the workload."""
    gaps = np.random.default_rng([seed, 7, WORKLOADS.index(workload)]).exponential(1.0 / rps, size=count)
    arrivals: list[float] = np.cumsum(gaps).tolist()
    return arrivals


def max_abs_dp(first: Results, second: Results, prepared: Sequence[Prepared]) -> float:
    """The largest |Δp| between two paths' probabilities over every question of ``prepared``."""
    return round(max(
        max(abs(x - y) for x, y in zip(first[row], second[row], strict=True))
        for request in prepared for row in request.rows
    ), 6)


class Flops:
    """Model FLOP estimates of the checkpoint's text backbone."""

    def __init__(self, model: D3):
        backbone = model.backbone
        text = backbone.config.get_text_config()
        language = getattr(backbone, "language_model", backbone)
        embedding = language.get_input_embeddings().weight.numel()
        self.parameters = sum(p.numel() for p in language.parameters()) - embedding + model.readout.numel()
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        full_layers = sum(kind == "full_attention" for kind in types)
        self.attention_per_pair = 4 * full_layers * text.num_attention_heads * text.head_dim

    def __call__(self, tokens: int, pairs: int) -> float:
        return 2.0 * self.parameters * tokens + self.attention_per_pair * pairs


def throughput_figures(tally: Tally, seconds: float, prepared: Sequence[Prepared], flops: Flops,
                       peak_tflops: float | None) -> Throughput:
    """One path's throughput record: rates, tokens, padding and model FLOP utilisation."""
    questions = sum(len(request.rows) for request in prepared)
    tokens = sum(request.input_tokens for request in prepared)
    tflops = flops(tally.real, tally.pairs) / seconds / 1e12
    return {
        "seconds": round(seconds, 4),
        "questions": questions,
        "questions_per_s": round(questions / seconds, 2),
        "requests_per_s": round(len(prepared) / seconds, 3),
        "input_tokens_per_s": round(tokens / seconds, 1),
        "computed_tokens_per_s": round(tally.real / seconds, 1),
        "real_tokens": tally.real,
        "padded_tokens": tally.padded,
        "real_over_padded": round(tally.real / tally.padded, 4) if tally.padded else None,
        "passes": len(tally.passes),
        "model_tflops_per_s": round(tflops, 4),
        "mfu": round(tflops / peak_tflops, 4) if peak_tflops else None,
    }


def paths_for(model: D3, variants: Sequence[str]) -> tuple[str, ...]:
    """The paths ``model`` runs: a and b, c where prefix reuse works (causal), then b's ``variants``."""
    try:
        check_supported(model)
        paths: tuple[str, ...] = ("a", "b", "c")
    except PrefixReuseUnavailable:
        paths = ("a", "b")
    return paths + tuple(f"b_{variant}" for variant in variants)  # throughput only, beside b


def comparison(out: Mapping[str, PathFigures], results: Mapping[str, Results], prepared: Sequence[Prepared],
               peak: Calibration, lengths: Sequence[int]) -> Comparison:
    """The paths against each other and against the calibrated peak; |Δp| of c vs b."""
    causal = "c" in out
    b_rate = out["b"]["questions_per_s"]
    return {
        "b_over_a": round(b_rate / out["a"]["questions_per_s"], 3),
        "b_over_peak": round(out["b"]["computed_tokens_per_s"] / peak["peak_tokens_per_s"], 3),
        # b against the best sweep shape whose rows are about as long as this workload's (a fairer peak
        # for long prompts, which cost more per token than the short rows the overall peak is usually at)
        "b_over_peak_at_length": round(out["b"]["computed_tokens_per_s"] / length_peak(peak, lengths), 3),
        "c_over_b": round(out["c"]["questions_per_s"] / b_rate, 3) if causal else None,
        "real_over_padded": out["b"]["real_over_padded"],
        "max_abs_dp": max_abs_dp(results["b"], results["c"], prepared) if causal else None,
    }


def variants_against_b(out: Mapping[str, PathFigures], results: Mapping[str, Results],
                       prepared: Sequence[Prepared], variants: Sequence[str]) -> dict[str, VariantComparison]:
    """Each variant of b against b: questions/s over b's, and the largest |Δp|."""
    b_rate = out["b"]["questions_per_s"]
    return {variant: {"over_b": round(out[f"b_{variant}"]["questions_per_s"] / b_rate, 3),
                      "max_abs_dp": max_abs_dp(results["b"], results[f"b_{variant}"], prepared)}
            for variant in variants}


def schedule(prepared: Sequence[Prepared], arrivals: Sequence[float], execute: Execute, *, max_rows: int,
             max_tokens: int, linger: float) -> list[float]:
    """The service's batch scheduler on a virtual clock; ``execute`` really runs the waiting requests.

    ``execute(requests, finished)`` calls ``finished(request, elapsed)`` as each request's last row is
    answered, ``elapsed`` measured from the start of the call. Returns each request's completion time.
    """
    count = len(prepared)
    done = [0.0] * count
    waiting: list[int] = []
    clock = 0.0
    following = 0  # next request to arrive

    def admit() -> None:
        nonlocal following
        while following < count and arrivals[following] <= clock:
            waiting.append(following)
            following += 1

    def full() -> bool:
        rows = sum(len(prepared[i].rows) for i in waiting)
        tokens = sum(prepared[i].input_tokens for i in waiting)
        return rows >= max_rows or tokens >= max_tokens

    while following < count or waiting:
        if not waiting:
            clock = max(clock, arrivals[following])
            admit()
        deadline = arrivals[waiting[0]] + linger
        while not full() and clock < deadline:
            if following < count and arrivals[following] <= deadline:
                clock = max(clock, arrivals[following])
                admit()
            else:
                clock = deadline
        taken, waiting = waiting, []
        start = clock

        def finished(request: int, elapsed: float, start: float = start) -> None:
            done[request] = start + elapsed

        began = time.perf_counter()
        execute(taken, finished)
        clock = start + (time.perf_counter() - began)
        admit()
    return done


class _Completion:
    """Reports each request of a scheduled run as finished once its last row is answered."""

    def __init__(self, prepared: Sequence[Prepared], taken: list[int], finished: Callable[[int, float], None]):
        self.began = time.perf_counter()
        self.owner = {row: i for i in taken for row in prepared[i].rows}
        self.left = {i: len(prepared[i].rows) for i in taken}
        self.finished = finished

    def answered(self, rows: Sequence[Row]) -> None:
        for row in rows:
            self.left[self.owner[row]] -= 1
            if self.left[self.owner[row]] == 0:
                self.finished(self.owner[row], time.perf_counter() - self.began)


# ------------------------------------------------------------------------------------------- paths


class Bench:
    """One model, one device: runs the workloads and the calibration sweep."""

    def __init__(
        self,
        model: D3,
        *,
        max_batch_tokens: int,
        max_batch_rows: int = 64,
        linger_ms: float = 5.0,
        verify_every: int = 0,
        peak_tflops: float | None = None,
        progress: bool = True,
        repeat: int = 1,
        variants: Sequence[str] = (),
    ):
        self.model = model
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_batch_rows = int(max_batch_rows)
        self.linger = linger_ms / 1000.0
        self.linger_ms = linger_ms
        self.verify_every = verify_every
        self.peak_tflops = peak_tflops
        self.progress = progress
        self.repeat = max(1, int(repeat))
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown --variant {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
        self.variants = tuple(variants)
        self.flops = Flops(model)
        self._bar: Progress | None = None

    @contextlib.contextmanager
    def progress_bar(self, description: str, unit: str, total: int | None = None) -> Iterator[None]:
        """A progress bar on stderr (unless ``progress`` is off) that the passes tick while it is shown."""
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=description, unit=unit, file=sys.stderr, disable=not self.progress,
                         leave=False)
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None

    def _tick(self, rows: int) -> None:
        if self._bar is not None:
            self._bar.update(rows)

    def _timed_forward(self, rows: Sequence[Row]) -> tuple[list[list[float]], float]:
        started = time.perf_counter()
        values = self.model.forward(rows)  # reads the probabilities back: the device is synchronised
        return values, time.perf_counter() - started

    # ---------------------------------------------------------------------------- calibration

    def calibrate(self, *, sweep: str = "default", seconds_per_shape: float = 0.4) -> Calibration:
        """Tokens/s of unpadded passes over a grid of rows x length; the best is the saturated throughput.

        ``sweep``: ``quick`` (4 shapes, for tests), ``default`` or ``wide`` (``--calibrate``).
        """
        if sweep == "quick":
            seconds_per_shape = 0.0
        lengths, budgets = sweep_sizes(sweep, self.model.device.type == "cuda")
        shapes = sweep_shapes(lengths, budgets, self.max_batch_rows)
        return summarise_sweep([self._time_shape(rows, length, seconds_per_shape) for rows, length in shapes])

    def _time_shape(self, rows: int, length: int, seconds_per_shape: float) -> Shape:
        """The best of 2-5 timed passes of ``rows`` unpadded rows of ``length`` tokens (after a warm-up)."""
        ids = self.model.token_ids
        batch = [Row("calibrate", [ids[(r * 7 + j) % len(ids)] for j in range(length)], 2) for r in range(rows)]
        self.model.forward(batch)  # warm-up: kernel selection for this shape
        times: list[float] = []
        spent = 0.0
        while len(times) < 2 or (spent < seconds_per_shape and len(times) < 5):
            _, seconds = self._timed_forward(batch)
            times.append(seconds)
            spent += seconds
        best = min(times)
        self._tick(1)
        return {"rows": rows, "length": length, "tokens": rows * length,
                "tokens_per_s": round(rows * length / best, 1), "seconds": round(best, 5)}

    # ------------------------------------------------------------------------------- throughput

    def run_a(self, prepared: Sequence[Prepared], tally: Tally) -> Results:
        results: Results = {}
        for request in prepared:
            for rows in self.model.passes(request):
                values, seconds = self._timed_forward(rows)
                results.update(zip(rows, values, strict=True))
                tally.add("reference", [row.length for row in rows], seconds)
                self._tick(len(rows))
        return results

    def run_b(self, prepared: Sequence[Prepared], tally: Tally) -> Results:
        rows = [row for request in prepared for row in request.rows]
        results: Results = {}
        for group in pack(rows, lambda row: row.length, self.max_batch_rows, self.max_batch_tokens):
            values, seconds = self._timed_forward(group)
            results.update(zip(group, values, strict=True))
            lengths = [row.length for row in group]
            width = bucketed_width(max(lengths)) if self.model.pad_buckets else max(lengths)
            tally.add("batch", lengths, seconds, width=width)
            self._tick(len(group))
        return results

    def runner(self, tally: Tally | None = None, on_pass: Callable[[PassInfo], None] | None = None) -> PrefixRunner:
        def record(info: PassInfo) -> None:
            if tally is not None:
                tally.passes.append(Pass(info.kind, info.rows, info.real_tokens, info.padded_tokens, info.seconds,
                                         info.attention_pairs))
            if info.kind in ("suffix", "full"):
                self._tick(info.rows)
            if on_pass is not None:
                on_pass(info)

        return PrefixRunner(self.model, max_batch_tokens=self.max_batch_tokens, max_batch_rows=self.max_batch_rows,
                            verify_every=self.verify_every, on_pass=record)

    def run_path(self, path: str, prepared: Sequence[Prepared], tally: Tally,
                 runner: PrefixRunner | None = None) -> Results:
        """Answer ``prepared`` by ``path``: ``a``, ``b``, ``b_<variant>`` or ``c`` (on ``runner`` if given)."""
        if path == "a":
            return self.run_a(prepared, tally)
        if path == "b":
            return self.run_b(prepared, tally)
        if path.startswith("b_"):
            with variant_of_b(self.model, path[2:]):
                return self.run_b(prepared, tally)
        return (runner or self.runner(tally)).run(prepared)

    # ---------------------------------------------------------------------------------- latency

    def latency_a(self, prepared: Sequence[Prepared], arrivals: Sequence[float]) -> list[float]:
        """Completion time of each request: one at a time, in arrival order (the reference server)."""
        clock, done = 0.0, []
        for request, arrival in zip(prepared, arrivals, strict=True):
            clock = max(clock, arrival)
            started = time.perf_counter()
            self.model.run(request)
            clock += time.perf_counter() - started
            done.append(clock)
            self._tick(len(request.rows))
        return done

    def _schedule(self, prepared: Sequence[Prepared], arrivals: Sequence[float], execute: Execute) -> list[float]:
        return schedule(prepared, arrivals, execute, max_rows=self.max_batch_rows,
                        max_tokens=self.max_batch_tokens, linger=self.linger)

    def latency_b(self, prepared: Sequence[Prepared], arrivals: Sequence[float]) -> list[float]:
        def execute(taken: list[int], finished: Callable[[int, float], None]) -> None:
            completion = _Completion(prepared, taken, finished)
            rows = [row for i in taken for row in prepared[i].rows]
            for group in pack(rows, lambda row: row.length, self.max_batch_rows, self.max_batch_tokens):
                self.model.forward(group)
                self._tick(len(group))
                completion.answered(group)

        return self._schedule(prepared, arrivals, execute)

    def latency_c(self, prepared: Sequence[Prepared], arrivals: Sequence[float]) -> list[float]:
        def execute(taken: list[int], finished: Callable[[int, float], None]) -> None:
            completion = _Completion(prepared, taken, finished)
            self.runner(on_pass=lambda info: completion.answered(info.done)).run([prepared[i] for i in taken])

        return self._schedule(prepared, arrivals, execute)

    # ------------------------------------------------------------------------------ one workload

    def workload(self, name: str, requests: list[Request], *, seed: int, rate: float | None,
                 peak: Calibration) -> WorkloadRun:
        """Every path's throughput and latency on ``requests``, and how the paths compare."""
        model = self.model
        prepared = [model.prepare(r.state, r.questions, r.images or None) for r in requests]
        lengths = [row.length for request in prepared for row in request.rows]
        paths = paths_for(model, self.variants)
        with self.progress_bar(f"bench {name}", "q", total=len(lengths) * 2 * self.repeat * len(paths)):
            self._warm_up(prepared[: max(2, len(prepared) // 20)], paths)
            out, results = self._throughput(prepared, paths)
            # Latency under Poisson arrivals at the same rate for every path.
            rps = rate if rate is not None else DEFAULT_RATE_SHARE * out["a"]["requests_per_s"]
            self._latency(prepared, poisson_arrivals(rps, len(prepared), seed, name), rps, paths, out)
            model.media_cache = None
        return WorkloadRun(
            workload={
                "requests": len(prepared),
                "questions": len(lengths),
                "input_tokens": sum(lengths),
                "prompt_tokens": {"min": min(lengths), "p50": int(statistics.median(lengths)), "max": max(lengths)},
                "images": sum(len(r.images) for r in requests),
                "seed": seed,
            },
            paths=out,
            comparison=comparison(out, results, prepared, peak, lengths),
            variants=variants_against_b(out, results, prepared, self.variants),
            setup=self.setup(),
            calibration={"peak_tokens_per_s": peak["peak_tokens_per_s"], "best_shape": peak["best_shape"],
                         "max_batch_tokens": peak["max_batch_tokens"]},
        )

    def _warm_up(self, few: Sequence[Prepared], paths: Sequence[str]) -> None:
        """Every path on a few requests (not timed, no progress), so kernel selection is not measured."""
        saved_bar, self._bar = self._bar, None
        for path in sorted(paths, key=lambda path: path == "c"):  # c last, after b's variants
            self.run_path(path, few, Tally())
            _reset_media(few)
        self._bar = saved_bar

    def _throughput(self, prepared: Sequence[Prepared],
                    paths: Sequence[str]) -> tuple[dict[str, PathFigures], dict[str, Results]]:
        """Each path's throughput figures over ``repeat`` rounds, and its answers (from its last round)."""
        results: dict[str, Results] = {}
        rounds = {path: Rounds() for path in paths}
        # Rounds interleave the paths (a, b, c, a, b, c, ...). The passes of a path are the same in every round,
        # so each pass keeps its fastest time (as the calibration sweep keeps each shape's), which filters
        # bursts of load from elsewhere on the machine; see ``best_seconds``.
        for _ in range(self.repeat):
            for path in paths:
                results[path] = self._throughput_round(path, prepared, rounds[path])
        out: dict[str, PathFigures] = {}
        for path in paths:
            out[path] = rounds[path].figures(prepared, self.flops, self.peak_tflops)
            if path == "c":
                out[path]["prefix"] = rounds[path].prefix
        return out, results

    def _throughput_round(self, path: str, prepared: Sequence[Prepared], rounds: Rounds) -> Results:
        """One timed run of ``path`` over every request, all available at once; adds to ``rounds``."""
        model = self.model
        tally = Tally()
        model.media_cache = None if path == "a" else MediaFeatureCache()
        _reset_media(prepared)
        with PeakMemory(model.device) as memory:
            started = time.perf_counter()
            runner = self.runner(tally) if path == "c" else None  # kept for its prefix-reuse counters
            results = self.run_path(path, prepared, tally, runner)
            model.synchronize()
            rounds.walls.append(time.perf_counter() - started)
        rounds.tallies.append(tally)
        rounds.peaks.append(memory.figures())
        if runner is not None:
            rounds.prefix = runner.report()
        rounds.media_cache = None if model.media_cache is None else model.media_cache.stats()
        return results

    def _latency(self, prepared: Sequence[Prepared], arrivals: list[float], rps: float, paths: Sequence[str],
                 out: dict[str, PathFigures]) -> None:
        """Each path's latency under ``arrivals`` into ``out`` (b's variants are throughput only)."""
        # Like the throughput rounds, the simulations run ``repeat`` times interleaved; each path reports the
        # run with the lowest mean latency (the one least disturbed by other load on the machine).
        for _ in range(self.repeat):
            for path in (p for p in paths if not p.startswith("b_")):
                latency, peaks = self._latency_run(path, prepared, arrivals, rps)
                figures = out[path]
                previous = figures.get("latency")
                if previous is None or latency["mean_ms"] < previous["mean_ms"]:
                    figures["latency"] = latency
                for key in PEAK_KEYS:
                    value = peaks[key]
                    if value is not None:
                        figures[key] = max(figures[key] or 0, value)

    def _latency_run(self, path: str, prepared: Sequence[Prepared], arrivals: list[float],
                     rps: float) -> tuple[Latency, PeakFigures]:
        """One simulated run of ``path``: its latency figures and peak memory."""
        model = self.model
        model.media_cache = None if path == "a" else MediaFeatureCache()
        _reset_media(prepared)
        simulate = {"a": self.latency_a, "b": self.latency_b, "c": self.latency_c}[path]
        with PeakMemory(model.device) as memory:
            done = simulate(prepared, arrivals)
        waits = question_waits(prepared, arrivals, done)
        return latency_figures(waits, rps, self.linger_ms, self.repeat), memory.figures()

    def setup(self) -> Setup:
        """The run's settings and machine, as the report records them."""
        model = self.model
        return {
            "device": str(model.device),
            "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
            "repeat": self.repeat,
            "threads": model.torch.get_num_threads(),
            "parameters": model.parameter_count(),
            "flop_parameters": self.flops.parameters,
            "max_batch_tokens": self.max_batch_tokens,
            "max_batch_rows": self.max_batch_rows,
            "reference_batch_size": model.batch_size,
            "verify_every": self.verify_every,
            "peak_tflops": self.peak_tflops,
            "media_batch_patches": model.media_batch_patches,
            "pad_buckets": model.pad_buckets,
        }


# ----------------------------------------------------------------------------------- kernel check

# Largest |Δp| the bound kernels may differ by from the reference PyTorch path (the test suite's tolerance for
# a question batched against alone: both are BF16 sums in another order).
KERNEL_TOLERANCE = 1e-2


class KernelCheck(TypedDict):
    """``kernel_check``: the bound kernels against the reference code on the held-out requests."""

    kernels: dict[str, str]
    requests: int
    questions: int
    max_abs_dp: float
    tolerance: float
    passed: bool
    bound_seconds: float
    reference_seconds: float


def kernel_check(model: D3, *, tickets: int = 60, pictures: int = 20) -> KernelCheck:
    """The held-out requests of the demo task (``tasks.heldout``) answered with the kernels transformers bound
    and again with its reference PyTorch code (``reference_kernels``), same weights, same process: the
    largest |Δp| of any question and whether it is within ``KERNEL_TOLERANCE``. Run before timing anything:
    a fast kernel that answers differently is a defect, not a speed-up."""
    examples = heldout(tickets, pictures if model.image_unavailable is None else 0)
    started = time.perf_counter()
    bound = [_answer(model, example.request) for example in examples]
    bound_seconds = time.perf_counter() - started
    with reference_kernels():
        started = time.perf_counter()
        reference = [_answer(model, example.request) for example in examples]
        reference_seconds = time.perf_counter() - started
    worst = 0.0
    questions = 0
    for fast, slow in zip(bound, reference, strict=True):
        slow_answers = _probabilities(slow)
        for key, probabilities in _probabilities(fast).items():
            other = slow_answers.get(key)
            if other is None:
                continue
            questions += 1
            worst = max(worst, max(abs(probabilities[k] - other[k]) for k in probabilities))
    return {
        "kernels": model.kernel_record(),
        "requests": len(examples),
        "questions": questions,
        "max_abs_dp": round(worst, 6),
        "tolerance": KERNEL_TOLERANCE,
        "passed": worst <= KERNEL_TOLERANCE,
        "bound_seconds": round(bound_seconds, 3),
        "reference_seconds": round(reference_seconds, 3),
    }


def _answer(model: D3, request: TaskRequest) -> Mapping[str, object]:
    return model.system_one(state=request["state"], questions=request["questions"], images=request.get("images"))


def _probabilities(response: Mapping[str, object]) -> dict[str, Mapping[str, float]]:
    """The option probabilities of each question a ``system_one`` response answered (an error answer has
    none), by question id."""
    answers = response["answers"]
    assert isinstance(answers, dict)  # system_one answers every question: an answer or an error
    return {key: answer["probabilities"] for key, answer in answers.items()
            if isinstance(answer, dict) and "probabilities" in answer}


# ------------------------------------------------------------------------------------------ reports


def markdown(runs: Mapping[str, WorkloadRun], calibration: Calibration | None = None) -> str:
    """The report as Markdown tables."""
    out = io.StringIO()
    names = {"a": "a reference (per request, batch 8)", "b": "b token-budget batching", "c": "c b + prefix reuse",
             **{f"b_{variant}": f"b {text}" for variant, text in VARIANTS.items()}}
    out.write("| workload | path | questions/s | input tokens/s | real ÷ padded | p50 ms | p99 ms | peak RSS MB |"
              " MFU |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for workload, run in runs.items():
        for path in names:
            figures = run.paths.get(path)
            if not figures:
                continue
            latency = figures.get("latency")
            p50, p99 = (latency["p50_ms"], latency["p99_ms"]) if latency else (float("nan"), float("nan"))
            mfu = figures.get("mfu")
            cuda = f" (GPU {figures['peak_cuda_mb']:.0f})" if figures.get("peak_cuda_mb") is not None else ""
            out.write(
                f"| {workload} | {names[path]} | {figures['questions_per_s']:,.1f} | "
                f"{figures['input_tokens_per_s']:,.0f} | {figures['real_over_padded']:.3f} | "
                f"{p50:,.1f} | {p99:,.1f} | "
                f"{figures['peak_rss_mb']:,.0f}{cuda} | {'-' if mfu is None else f'{100 * mfu:.1f} %'} |\n"
            )
    out.write("\n| workload | b ÷ a | b ÷ peak | b ÷ peak at its row length | c ÷ b | real ÷ padded (b) | "
              "max abs Δp (c vs b) | arrival rate req/s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
    for workload, run in runs.items():
        def show(value: float | None, digits: int = 2) -> str:
            return "-" if value is None else f"{value:.{digits}f}"

        compared = run.comparison
        delta = compared["max_abs_dp"]
        out.write(f"| {workload} | {show(compared['b_over_a'])} | {show(compared['b_over_peak'])} | "
                  f"{show(compared.get('b_over_peak_at_length'))} | {show(compared['c_over_b'])} | "
                  f"{show(compared['real_over_padded'], 3)} | "
                  f"{'-' if delta is None else format(delta, '.1e')} | {run.paths['a']['latency']['rate_rps']:.2f} |\n")
    variants = [v for v in VARIANTS if any(v in run.variants for run in runs.values())]
    if variants:
        out.write("\n| workload | variant of b | ÷ b (questions/s) | max abs Δp vs b |\n|---|---|---:|---:|\n")
        for workload, run in runs.items():
            for variant in variants:
                if variant in run.variants:
                    against_b = run.variants[variant]
                    out.write(f"| {workload} | {VARIANTS[variant]} | {against_b['over_b']:.3f} | "
                              f"{against_b['max_abs_dp']:.1e} |\n")
    first = next(iter(runs.values()), None)
    if first is not None:
        setup, peak = first.setup, first.calibration
        out.write(
            f"\nDevice {setup['device']}, {setup['threads']} threads, {setup['parameters']:,} parameters; "
            f"max_batch_tokens {setup['max_batch_tokens']}, max_batch_rows {setup['max_batch_rows']}; "
            f"saturated forward throughput {peak['peak_tokens_per_s']:,.0f} tokens/s at "
            f"{peak['best_shape'][0]} x {peak['best_shape'][1]}.\n"
        )
    if calibration is not None:
        out.write("\n| rows | length | tokens | tokens/s |\n|---:|---:|---:|---:|\n")
        for shape in calibration["sweep"]:
            out.write(f"| {shape['rows']} | {shape['length']} | {shape['tokens']} | {shape['tokens_per_s']:,.0f} |\n")
        out.write(f"\nRecommended `--max-batch-tokens {calibration['max_batch_tokens']}` (the smallest budget within "
                  f"5 % of the best, {calibration['peak_tokens_per_s']:,.0f} tokens/s).\n")
    return out.getvalue()


# ---------------------------------------------------------------------------------------- a run


def run_bench(args: argparse.Namespace) -> tuple[dict[str, WorkloadRun], Calibration]:
    """Load the model, calibrate, run the chosen workloads; returns (each workload's figures by name,
    calibration); ``report_of`` makes the JSON report of them."""
    import torch

    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run_bench(args)
    finally:
        torch.set_num_threads(threads)


def _run_bench(args: argparse.Namespace) -> tuple[dict[str, WorkloadRun], Calibration]:
    import torch

    try:
        from d3stream.service import default_token_budget
    except ImportError:  # a bare GPU image without the Kafka client: the service's rule, restated

        def default_token_budget(device: str) -> int:
            return 16_384 if str(device).startswith("cuda") else 4_096

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("d3stream bench: --device cuda but torch sees no CUDA device")
    if args.checkpoint:
        root = Path(args.checkpoint)
    else:
        from d3stream.dev.demo import demo_checkpoint

        root = demo_checkpoint(progress=args.progress)
    model = D3.from_pretrained(root, device=device, batch_size=REFERENCE_BATCH_SIZE, verify="none")
    cuda = model.device.type == "cuda"
    peak_tflops = args.peak_tflops if args.peak_tflops is not None else (H200_BF16_PEAK_TFLOPS if cuda else None)
    budget = args.max_batch_tokens or default_token_budget(str(model.device))
    bench = Bench(model, max_batch_tokens=budget, max_batch_rows=args.max_batch_rows, linger_ms=args.linger_ms,
                  verify_every=args.verify_every, peak_tflops=peak_tflops, progress=args.progress,
                  repeat=args.repeat, variants=args.variants)

    with bench.progress_bar("calibrate", "shape"):
        calibration = bench.calibrate(sweep="wide" if args.calibrate else args.sweep)
    if args.calibrate and not args.max_batch_tokens:
        bench.max_batch_tokens = calibration["max_batch_tokens"]

    names = WORKLOADS if args.workload == "all" else (args.workload,)
    runs: dict[str, WorkloadRun] = {}
    for name in names:
        count = args.requests or max(2, round(DEFAULT_REQUESTS[name][1 if cuda else 0] * args.scale))
        requests = make_workload(name, count, args.seed, model.tokenizer,
                                 images_supported=model.image_unavailable is None)
        runs[name] = bench.workload(name, requests, seed=args.seed, rate=args.rate, peak=calibration)
        runs[name].setup["checkpoint"] = str(root)
        runs[name].setup["kernels"] = model.kernel_record()
        if args.out:  # after every workload, so a run stopped early still leaves what it measured
            Path(args.out).write_text(json.dumps(report_of(runs), indent=2) + "\n", encoding="utf-8")
    return runs, calibration
