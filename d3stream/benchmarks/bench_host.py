"""``d3stream bench host``: what the host costs per question on the real worker path, with the device taken out.

A GPU worker is only as fast as the host that feeds it. This benchmark runs one worker (``Service``) on the
embedded broker, store and registry with everything real except the backbone's forward: Kafka in, the request
checks, media fetched from the object store and decoded, the runtime's own prompt building and tokenizing
(the tiny demo checkpoint's Qwen3.5 tokenizer and processor), the scheduler's batch packing, shared-prefix
planning and its prefix and suffix passes, the FP32 readout into probabilities, answers with provenance,
framing (JSON, or Avro through the registry), Kafka out in either delivery mode.

**The stand-in** (``StandInBackbone``) takes the backbone's place in the loaded checkpoint
(``checkpoint.backbone``: the one object ``RowRunner.forward``, the shared-prefix passes and the vision encoder
call). It returns hidden states of the right shape and dtype at once (a zero tensor expanded to
``[rows, seq, hidden]``: nothing is allocated per token), or after ``device_ms`` (plus the pass's padded
tokens at ``device_tokens_per_s``) spent in ``time.sleep``, which releases the GIL as a wait on a GPU does.
A prefix pass gets its cache filled with zero states of the shapes the real backbone leaves (probed once with
a real forward of four tokens), so the suffix passes stack, pad and slice them as they would; the vision
tower answers zero features of the merged size. What it skips is computing: no attention, no delta-rule scan,
no vision tower. Its own CPU (the zero states, the bookkeeping) is measured apart and left out of "outside the
forward".

**What is measured**, between the moment the worker holds its partitions and the moment every answer is
published and its offset committed (the requests are all on the topic before it starts, so the worker runs
flat out): wall seconds, and CPU seconds per thread of this process read from ``/proc`` through psutil before
and after (the worker records per-stage wall times too, ``provenance.timings``; on a shared 2-core machine
those include waiting for the GIL and the cores, so CPU per thread is the figure to compare). Threads are
grouped by the names the worker gives them: the event loop (Kafka clients, request checks, answers, framing,
delivery), ``d3stream-prepare`` (prompts, tokenizing, prefix planning), ``d3stream-model`` (packing the
pass's tensors, the stand-in, the readout), ``d3stream-decode-*`` and ``d3stream-s3`` (media), the rest
(torch's and aiokafka's helpers, threads that ended). Decoding processes (videos) are this process's
children; the broker, the store and the registry (JVMs) are reported apart, per question too, never in the
worker's total.

**The H100 comparison**: an H100 at 40 % of its dense BF16 peak prefills about 250,000 tokens/s of the 0.8B
backbone (2 N FLOP a token). From the tokens the stand-in was given per question (after shared-prefix reuse)
that is the questions/s one GPU would answer; beside the worker's rate it says how many such workers (or
cores) one H100 needs, and the CPU a question may cost for one core to keep up (docs/GPU.md).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from d3stream.runtime import D3
from d3stream.settings import DeliveryName, Settings

if TYPE_CHECKING:
    import torch

    from d3stream.dev.infra import LocalStack
    from d3stream.service import Service

# An H100 SXM's dense BF16 peak is about 989 TFLOP/s; at 40 % of it, 2 x 0.8e9 FLOP a token prefill
# 0.4 * 989e12 / 1.6e9 = 247,000 tokens/s, rounded as the issue states it.
H100_PREFILL_TOKENS_PER_S = 250_000
# The worker's padded-token budget per pass on a GPU (core.passes.default_token_budget): the stand-in's
# model sits on the CPU, whose default (4,096) would cut passes a GPU worker never cuts.
GPU_BATCH_TOKENS = 16_384
PARTITIONS = 4

# The workloads (bench_workloads.py): the name here, the generator's name there, the default request count.
Workload = Literal["small", "repeated", "shared", "images"]
# "repeated" is bench_workloads.make_repeated's, no workload of ``bench workloads``.
WORKLOADS: dict[Workload, str] = {"small": "small", "repeated": "repeated", "shared": "long-state", "images": "mixed"}
WORKLOAD_TEXT: dict[Workload, str] = {
    "small": "text-only small requests (1-3 questions, prompts of about 100-400 tokens)",
    "repeated": "text-only small requests asking 1-3 of the same 6 questions of states of 20-200 tokens (a "
                "stream's shape: what a question costs once is not paid again per request)",
    "shared": "long shared states (a state of about 2,000 tokens asked 10 questions: shared-prefix reuse)",
    "images": "a mix: small, medium and long-state requests and a fifth with 1-4 images (fetched, decoded)",
}
DEFAULT_REQUESTS: dict[Workload, int] = {"small": 2000, "repeated": 2000, "shared": 60, "images": 300}
Format = Literal["json", "avro"]
FORMATS: tuple[Format, ...] = ("json", "avro")
DELIVERIES: tuple[DeliveryName, ...] = ("exactly_once", "at_least_once")

# Thread-name prefixes of the worker (service.py and core/) and the stage each one's CPU is reported under.
THREAD_STAGES = (
    ("d3stream-prepare", "prepare"),
    ("d3stream-model", "model_thread"),
    ("d3stream-decode", "decode_threads"),
    ("d3stream-s3", "fetch_threads"),
)
STAGES = ("event_loop", "prepare", "model_thread", "fetch_threads", "decode_threads", "decode_processes",
          "native_threads", "other")


# ------------------------------------------------------------------------------------------------ stand-in


@dataclass(frozen=True)
class _LayerShape:
    """One layer of the cache a prefix pass leaves, as the real backbone left it for one row of four tokens:
    ``kv`` (keys and values, [rows, heads, length, width]) or ``linear`` (the Gated DeltaNet convolution state
    and recurrent state, [rows, ...] whatever the length)."""

    kind: str
    first: tuple[int, ...]
    second: tuple[int, ...]
    first_dtype: torch.dtype
    second_dtype: torch.dtype


@dataclass
class DeviceLog:
    """What the stand-in saw: each backbone call's kind and tokens, its sleep, and its own CPU seconds."""

    calls: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # kind, real, padded, start, end
    vision_calls: int = 0
    cpu_seconds: float = 0.0

    def between(self, start: float, end: float) -> list[tuple[str, int, int, float, float]]:
        return [call for call in self.calls if start <= call[3] < end]


class StandInBackbone:
    """The backbone's place taken by hidden states of the right shape, at once or after a sleep (module
    docstring). Everything but the calls (config, parameters for provenance) is the real backbone's."""

    def __init__(self, real: Any, *, device_ms: float = 0.0, device_tokens_per_s: float = 0.0):
        import torch

        self.real = real
        self.device_s = max(0.0, device_ms) / 1000.0
        self.device_tokens_per_s = max(0.0, device_tokens_per_s)
        self.log = DeviceLog()
        self._layers, hidden = _probe(real)
        self._hidden_size, self._dtype = int(hidden.shape[-1]), hidden.dtype
        self._zero = torch.zeros((1, 1, self._hidden_size), dtype=self._dtype)
        vision = getattr(real.config, "vision_config", None)
        self._merge = int(getattr(vision, "spatial_merge_size", 2) or 2) ** 2
        self._vision_width = int(getattr(vision, "out_hidden_size", self._hidden_size) or self._hidden_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: object = None, cache: Any = None,
                 **_: object) -> types.SimpleNamespace:
        entered = time.thread_time()
        rows, width = int(input_ids.shape[0]), int(input_ids.shape[1])
        if cache is not None and _empty(cache):
            kind = "prefix"
            self._fill(cache, rows, width)
        else:
            kind = "suffix" if cache is not None else "full"
        real = _real_tokens(attention_mask, rows, width)
        hidden = self._zero.expand(rows, width, self._hidden_size)
        cpu = time.thread_time() - entered
        seconds = self.device_s + (rows * width / self.device_tokens_per_s if self.device_tokens_per_s else 0.0)
        started = time.perf_counter()
        if seconds > 0.0:
            time.sleep(seconds)  # releases the GIL, as waiting on a GPU does
        self.log.calls.append((kind, real, rows * width, started, time.perf_counter()))
        self.log.cpu_seconds += cpu
        return types.SimpleNamespace(last_hidden_state=hidden)

    def get_image_features(self, pixels: torch.Tensor, grids: torch.Tensor, return_dict: bool = True,
                           **_: object) -> types.SimpleNamespace:
        """Zero features of the merged size per item (the pass's device time covers the tower's)."""
        import torch

        entered = time.thread_time()
        pooled = [torch.zeros((int(grid.prod()) // self._merge, self._vision_width), dtype=self._dtype)
                  for grid in grids]
        self.log.vision_calls += 1
        self.log.cpu_seconds += time.thread_time() - entered
        return types.SimpleNamespace(pooler_output=pooled, deepstack_features=None)

    get_video_features = get_image_features

    def _fill(self, cache: Any, rows: int, width: int) -> None:
        """The states a prefix pass of ``rows`` x ``width`` tokens leaves, as zeros of their real shapes."""
        import torch

        for number, layer in enumerate(self._layers):
            first = torch.zeros((1, *layer.first[1:]), dtype=layer.first_dtype)
            second = torch.zeros((1, *layer.second[1:]), dtype=layer.second_dtype)
            if layer.kind == "kv":  # zeros expanded along the rows and the pass's length: the cache copies them
                cache.update(first[:, :, :1].expand(rows, -1, width, -1), second[:, :, :1].expand(rows, -1, width, -1),
                             number)
            else:
                cache.update_conv_state(first.expand(rows, *layer.first[1:]), number,
                                        conv_kernel_size=layer.first[-1])
                cache.update_recurrent_state(second.expand(rows, *layer.second[1:]), number)


def _probe(real: Any) -> tuple[list[_LayerShape], torch.Tensor]:
    """The cache layers a real prefix pass leaves (one row of four tokens) and its hidden states."""
    import torch
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    cache = DynamicCache(config=real.config)
    ids = torch.full((1, 4), 100, dtype=torch.long)
    with torch.inference_mode():
        hidden = real(input_ids=ids, attention_mask=torch.ones_like(ids),
                      position_ids=torch.arange(4).expand(3, 1, 4), cache=cache, use_cache=True).last_hidden_state
    shapes = []
    first: Any
    second: Any
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            first, second, kind = layer.conv_states[0], layer.recurrent_states[0], "linear"
        else:
            first, second, kind = layer.keys, layer.values, "kv"
        shapes.append(_LayerShape(kind, tuple(first.shape), tuple(second.shape), first.dtype, second.dtype))
    return shapes, hidden


def _empty(cache: Any) -> bool:
    """Whether a cache holds nothing yet (a prefix pass's; a suffix pass's comes stacked)."""
    return all(not getattr(layer, "is_initialized", False)
               and not any(getattr(layer, "is_conv_states_initialized", [False]))
               for layer in cache.layers)


def _real_tokens(mask: object, rows: int, width: int) -> int:
    """Tokens of the pass that are not padding: the last ``width`` columns of its mask (a suffix pass's mask
    covers the cached prefix too)."""
    if isinstance(mask, dict):  # noncausal_full_attention: [rows, 1, 1, width] presence for full attention
        mask = mask["full_attention"]
    if mask is None:
        return rows * width
    tensor: Any = mask
    return int(tensor.reshape(rows, -1)[:, -width:].sum())


def install_stand_in(model: D3, *, device_ms: float = 0.0, device_tokens_per_s: float = 0.0) -> StandInBackbone:
    """Put a stand-in in ``model``'s backbone's place (the real one stays reachable as its ``real``)."""
    current: Any = model.checkpoint.backbone
    real = current.real if isinstance(current, StandInBackbone) else current
    stand_in = StandInBackbone(real, device_ms=device_ms, device_tokens_per_s=device_tokens_per_s)
    # The runtime types the backbone as a transformers model; the stand-in answers every call the runtime makes.
    model.checkpoint.backbone = cast("Any", stand_in)
    return stand_in


# ------------------------------------------------------------------------------------------- CPU by thread


@dataclass
class CpuSample:
    """CPU seconds at one moment: this process's threads (by native id) and in all, its decoding processes,
    and the servers."""

    threads: dict[int, float]
    names: dict[int, str]  # the Python threads' names by native id (the worker names its threads)
    process: float
    children: dict[int, float]
    reaped_children: float
    servers: dict[str, float]


def _cpu(times: Any) -> float:
    return float(times.user + times.system)


def _tree_seconds(process: Any) -> float:
    """A process's CPU seconds and its live children's."""
    import psutil

    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            total += _cpu(each.cpu_times())
        except psutil.Error:
            continue
    return total


def take_sample(servers: Mapping[str, int]) -> CpuSample:
    """Read the CPU seconds of every thread of this process, of its children other than ``servers`` (name ->
    pid) and their descendants, and of the servers."""
    import psutil

    me = psutil.Process()
    server_processes = {}
    skip: set[int] = set()
    for name, pid in servers.items():
        try:
            process = psutil.Process(pid)
            server_processes[name] = process
            skip |= {pid, *(child.pid for child in process.children(recursive=True))}
        except psutil.Error:
            continue
    children: dict[int, float] = {}
    for child in me.children(recursive=True):
        if child.pid in skip:
            continue
        try:
            children[child.pid] = _cpu(child.cpu_times())
        except psutil.Error:
            continue
    times = me.cpu_times()
    return CpuSample(
        threads={thread.id: thread.user_time + thread.system_time for thread in me.threads()},
        names={thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None},
        process=_cpu(times),
        children=children,
        reaped_children=float(times.children_user + times.children_system),
        servers={name: _tree_seconds(process) for name, process in server_processes.items()},
    )


def cpu_by_stage(before: CpuSample, after: CpuSample, loop_thread: int) -> dict[str, float]:
    """CPU seconds spent between the samples by stage (``STAGES``): threads grouped by name, the event loop
    by ``loop_thread`` (its native id). ``native_threads`` are those Python has no thread object for: the
    tokenizers library's Rayon pool (a batch of prompts is tokenized there, for the prepare thread) and torch's
    OpenMP workers. ``other`` is the rest of the process: Python threads the worker does not name (asyncio's
    resolver, the harness's) and threads that ended during the run."""
    names = after.names
    spent = dict.fromkeys(STAGES, 0.0)
    counted = 0.0
    for native, seconds in after.threads.items():
        delta = seconds - before.threads.get(native, 0.0)
        name = names.get(native)
        if native == loop_thread:
            stage = "event_loop"
        elif name is None:
            stage = "native_threads"
        else:
            stage = next((stage for prefix, stage in THREAD_STAGES if name.startswith(prefix)), "")
        if stage:
            spent[stage] += delta
            counted += delta
    spent["other"] = max(0.0, after.process - before.process - counted)
    spent["decode_processes"] = (
        sum(seconds - before.children.get(pid, 0.0) for pid, seconds in after.children.items())
        + after.reaped_children - before.reaped_children)
    return spent


# --------------------------------------------------------------------------------------------- one run


@dataclass
class Measured:
    """One run's window: its wall seconds, CPU by stage and by server, and the service as it ended."""

    seconds: float
    cpu: dict[str, float]
    servers: dict[str, float]
    window: tuple[float, float]
    service: Service


async def serve_measured(settings: Settings, model: D3, count: int, servers: Mapping[str, int], *,
                         poll_s: float = 0.01) -> Measured:
    """Serve until ``count`` requests are answered and committed; CPU sampled as the worker joins and as the
    last offset commits. The harness polls every ``poll_s`` (its own cost on the event loop: a few µs each)."""
    from d3stream.benchmarks.bench_service import until_joined
    from d3stream.service import Service

    service = Service(settings, model)
    # The worker starts a decoding process as it starts (for the first video); starting it costs about half a
    # second of CPU, a worker's start-up and not its questions': started here and waited for, and the worker's
    # own start skips it (a second warm() would start a second process: each takes the next idle slot).
    service.decoder.warm()
    service.decoder.warm = _started  # type: ignore[method-assign]
    await _children_settled(servers)
    task = asyncio.create_task(service.run())
    loop_thread = threading.get_native_id()
    try:
        await until_joined(service, task)
        before = take_sample(servers)
        started = time.perf_counter()
        while service.counts["answered"] + service.counts["errors"] < count:
            if task.done():
                task.result()
                raise RuntimeError("the service stopped before answering every request")
            await asyncio.sleep(poll_s)
        assert service.delivery is not None  # the service is running
        await service.delivery.flush()
        while service.tracker.committable():  # a flush already under way may still be finishing
            await asyncio.sleep(poll_s)
            await service.delivery.flush()
        ended = time.perf_counter()
        after = take_sample(servers)
    finally:
        service.stop()
        await asyncio.wait_for(task, 120)
    return Measured(ended - started, cpu_by_stage(before, after, loop_thread),
                    {name: after.servers[name] - before.servers.get(name, 0.0) for name in after.servers},
                    (started, ended), service)


def _started() -> None:
    """The decoder's warm-up, done already (``serve_measured``)."""


async def _children_settled(servers: Mapping[str, int], *, quiet_s: float = 0.3, most_s: float = 15.0) -> None:
    """Until the CPU of this process's children (the servers aside) has not moved for ``quiet_s``."""
    last = None
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline:
        sample = take_sample(servers)
        now = sum(sample.children.values())
        if last is not None and now - last < 0.011:  # under two clock ticks
            return
        last = now
        await asyncio.sleep(quiet_s)


async def published_values(bootstrap: str, topic: str, settle_s: float = 30.0) -> list[bytes]:
    """Every committed record value of ``topic`` up to its end (``chaos.count_topic`` without the JSON: Avro
    answers count too)."""
    from aiokafka import TopicPartition

    from d3stream.kafka.connection import raw_client

    consumer = raw_client("consumer", bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                          isolation_level="read_committed", auto_offset_reset="earliest")
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - a fresh client knows no topics yet
        partitions = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        values: list[bytes] = []
        deadline = time.monotonic() + settle_s
        while True:
            ends = await consumer.end_offsets(partitions)
            while True:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    values += [record.value for record in batch if record.value is not None]
                positions = {p: await consumer.position(p) for p in partitions}
                if all(positions[p] >= ends[p] for p in partitions):
                    break
            # Read up to the last stable offsets; a transaction whose markers are not written yet keeps them
            # below the high watermark for a moment.
            if all((consumer.highwater(p) or 0) <= ends[p] for p in partitions) or time.monotonic() > deadline:
                return values
            await asyncio.sleep(0.1)
    finally:
        await consumer.stop()


# --------------------------------------------------------------------------------------------- the report


class DeviceFigures(TypedDict):
    """The stand-in's view of the run: passes, tokens, its busy share of the window and the gaps between."""

    device_ms: float
    device_tokens_per_s: float
    passes: int
    passes_by_kind: dict[str, int]
    vision_calls: int
    busy_share: float  # the stand-in's sleeping seconds over the window's wall seconds, in [0, 1]
    # The same from the start of its first call to the end of its last: the steady state, without the ramp
    # (the first requests read and prepared before any pass) and the tail (the last answers out and committed).
    busy_share_steady: float
    ramp_ms: float
    tail_ms: float
    idle_gap_ms_median: float  # between the end of one call and the start of the next
    idle_gap_ms_p90: float
    idle_gap_ms_max: float
    questions_per_pass: float
    stand_in_cpu_us_per_question: float


class H100Figures(TypedDict):
    """The run's tokens against what an H100 prefills for the 0.8B backbone (module docstring)."""

    prompt_tokens_per_question: float  # whole prompts, as answered (usage)
    device_tokens_per_question: float  # what the stand-in was given: after shared-prefix reuse, no padding
    padded_tokens_per_question: float
    h100_questions_per_s: float  # H100_PREFILL_TOKENS_PER_S / device tokens per question
    worker_tokens_per_s: float  # device tokens this worker fed per second
    worker_share_of_h100: float  # worker_tokens_per_s over the H100's rate
    workers_per_h100: float  # workers like this one (each a process, most of a core) one H100 keeps busy
    cpu_us_per_question_for_one_core: float  # the CPU budget per question if one core is to feed one H100


class RunReport(TypedDict):
    """One workload in one format and delivery mode."""

    workload: str
    format: str
    delivery: str
    round: int
    requests: int
    questions: int
    answer_topic: str
    answers_published: int  # committed records on the answer topic once the run ended (one per request)
    seconds: float
    requests_per_s: float
    questions_per_s: float
    cpu_us_per_question: dict[str, float]  # by stage, and worker_total, outside_forward
    servers_cpu_us_per_question: dict[str, float]  # broker, store, registry: apart from the worker
    worker_cores: float  # the worker's CPU seconds over the window's wall seconds
    stage_wall_ms_per_request: dict[str, float]  # the worker's own stage timings (provenance.timings), mean
    device: DeviceFigures
    h100: H100Figures


class HostReport(TypedDict):
    """``d3stream bench host``: every run, and how it was taken."""

    checkpoint: str
    torch_threads: int
    max_batch_tokens: int
    device_ms: float
    device_tokens_per_s: float
    partitions: int
    rounds: int
    h100_prefill_tokens_per_s: int
    workloads: dict[str, str]
    runs: list[RunReport]


def _per(value: float, count: int, scale: float = 1.0) -> float:
    return value * scale / count if count else 0.0


def _device_figures(stand_in: StandInBackbone, window: tuple[float, float], questions: int,
                    cpu_seconds: float) -> DeviceFigures:
    calls = stand_in.log.between(*window)
    busy = sum(end - start for _, _, _, start, end in calls if stand_in.device_s or stand_in.device_tokens_per_s)
    gaps = [later[3] - earlier[4] for earlier, later in zip(calls, calls[1:], strict=False)]
    steady = calls[-1][4] - calls[0][3] if calls else 0.0
    kinds: dict[str, int] = {}
    for kind, *_ in calls:
        kinds[kind] = kinds.get(kind, 0) + 1
    answering = sum(1 for kind, *_ in calls if kind != "prefix")
    wall = window[1] - window[0]
    return {
        "device_ms": stand_in.device_s * 1000.0,
        "device_tokens_per_s": stand_in.device_tokens_per_s,
        "passes": len(calls),
        "passes_by_kind": kinds,
        "vision_calls": stand_in.log.vision_calls,
        "busy_share": round(min(1.0, busy / wall), 3) if wall > 0 else 0.0,
        "busy_share_steady": round(min(1.0, busy / steady), 3) if steady > 0 else 0.0,
        "ramp_ms": round((calls[0][3] - window[0]) * 1000, 1) if calls else 0.0,
        "tail_ms": round((window[1] - calls[-1][4]) * 1000, 1) if calls else 0.0,
        "idle_gap_ms_median": round(statistics.median(gaps) * 1000, 2) if gaps else 0.0,
        "idle_gap_ms_p90": round(statistics.quantiles(gaps, n=10)[-1] * 1000, 2) if len(gaps) >= 2 else 0.0,
        "idle_gap_ms_max": round(max(gaps) * 1000, 2) if gaps else 0.0,
        "questions_per_pass": round(questions / answering, 1) if answering else 0.0,
        "stand_in_cpu_us_per_question": round(_per(cpu_seconds, questions, 1e6), 1),
    }


def _h100_figures(stand_in: StandInBackbone, window: tuple[float, float], questions: int, prompt_tokens: int,
                  seconds: float, questions_per_s: float) -> H100Figures:
    calls = stand_in.log.between(*window)
    device_tokens = sum(real for _, real, _, _, _ in calls)
    padded = sum(padded for _, _, padded, _, _ in calls)
    per_question = _per(device_tokens, questions)
    h100_rate = H100_PREFILL_TOKENS_PER_S / per_question if per_question else 0.0
    worker_tokens = device_tokens / seconds if seconds else 0.0
    return {
        "prompt_tokens_per_question": round(_per(prompt_tokens, questions), 1),
        "device_tokens_per_question": round(per_question, 1),
        "padded_tokens_per_question": round(_per(padded, questions), 1),
        "h100_questions_per_s": round(h100_rate, 1),
        "worker_tokens_per_s": round(worker_tokens, 1),
        "worker_share_of_h100": round(worker_tokens / H100_PREFILL_TOKENS_PER_S, 4),
        "workers_per_h100": round(h100_rate / questions_per_s, 2) if questions_per_s else 0.0,
        "cpu_us_per_question_for_one_core": round(1e6 / h100_rate, 1) if h100_rate else 0.0,
    }


def _stage_walls(service: Service) -> dict[str, float]:
    """The mean wall milliseconds per request of each stage the worker times (its stage histogram)."""
    histogram = service.metrics.stage_seconds
    figures = {}
    for stage, counts in histogram.counts.items():
        observed = sum(counts)
        figures[stage] = round(histogram.sums[stage] * 1000 / observed, 3) if observed else 0.0
    return figures


def _prompt_tokens(service: Service) -> int:
    return int(sum(total for labels, total in service.metrics.tokens.totals.items() if labels[-1] == "prompt"))


def run_report(measured: Measured, stand_in: StandInBackbone, *, workload: str, format: str, delivery: str,
               round_number: int, requests: int, questions: int, answer_topic: str, published: int) -> RunReport:
    """One run's figures from its measurement (see ``RunReport``)."""
    seconds = measured.seconds
    cpu = measured.cpu
    stand_in_cpu = stand_in.log.cpu_seconds
    total = sum(cpu.values())
    by_stage = {stage: round(_per(value, questions, 1e6), 1) for stage, value in cpu.items()}
    by_stage["worker_total"] = round(_per(total, questions, 1e6), 1)
    by_stage["stand_in"] = round(_per(stand_in_cpu, questions, 1e6), 1)
    by_stage["outside_forward"] = round(_per(total - stand_in_cpu, questions, 1e6), 1)
    questions_per_s = questions / seconds if seconds else 0.0
    return {
        "workload": workload, "format": format, "delivery": delivery, "round": round_number,
        "requests": requests, "questions": questions, "answer_topic": answer_topic, "answers_published": published,
        "seconds": round(seconds, 3),
        "requests_per_s": round(requests / seconds, 1) if seconds else 0.0,
        "questions_per_s": round(questions_per_s, 1),
        "cpu_us_per_question": by_stage,
        "servers_cpu_us_per_question": {name: round(_per(value, questions, 1e6), 1)
                                        for name, value in measured.servers.items()},
        "worker_cores": round(total / seconds, 2) if seconds else 0.0,
        "stage_wall_ms_per_request": _stage_walls(measured.service),
        "device": _device_figures(stand_in, measured.window, questions, stand_in_cpu),
        "h100": _h100_figures(stand_in, measured.window, questions, _prompt_tokens(measured.service), seconds,
                              questions_per_s),
    }


# ------------------------------------------------------------------------------------------- the bench


@dataclass
class _Source:
    """One workload's requests on the broker, in one format: its topic and counts."""

    topic: str
    requests: int
    questions: int


def _records(workload: Workload, count: int, seed: int, model: D3,
             stack: LocalStack) -> tuple[list[tuple[bytes, bytes]], int]:
    """``count`` requests of ``workload`` as (key, value) records, images uploaded to the store; and their
    questions."""
    from d3stream.benchmarks.bench_stream import stream_records, upload_pool
    from d3stream.benchmarks.bench_workloads import make_repeated, make_workload

    requests = (make_repeated(count, seed, model.tokenizer) if workload == "repeated" else
                make_workload(WORKLOADS[workload], count, seed, model.tokenizer,
                              images_supported=model.image_unavailable is None))
    uris = upload_pool(stack.store, requests) if any(request.images for request in requests) else {}
    return stream_records(requests, uris, with_images=True), sum(len(request.questions) for request in requests)


def _settings(stack: LocalStack, source: str, prefix: str, mode: DeliveryName, format: Format, *,
              threads: int, max_batch_tokens: int) -> tuple[Settings, str]:
    """A worker's settings for one run (its own answer topics and group) and its answer topic."""
    from d3stream.benchmarks.bench_stream import BUCKET

    broker = stack.broker
    topics = {name: f"{prefix}.{name}" for name in ("answers", "dlq", "prov")}
    for topic in topics.values():
        broker.create_topic(topic, PARTITIONS, exist_ok=True)
    values: dict[str, object] = dict(
        bootstrap_servers=broker.bootstrap_servers, request_topics=[source], answer_topic=topics["answers"],
        dead_letter_topic=topics["dlq"], provenance_topic=topics["prov"], group_id=prefix, client_id=prefix,
        delivery=mode, metrics_port=None, create_topics=False, log_level="warning", torch_threads=threads,
        max_batch_tokens=max_batch_tokens, s3_endpoint_url=stack.store.endpoint_url, s3_region=stack.store.region,
        media_allowlist=[BUCKET],
    )
    if format == "avro":
        assert stack.registry is not None  # host_bench starts one for Avro
        values.update(schema_registry_url=stack.registry.url, answer_format="avro", schema_auto_register=True)
    return Settings.from_flat(**values), topics["answers"]


def _servers(stack: LocalStack) -> dict[str, int]:
    servers = {"broker": stack.broker.pid, "object_store": stack.store.pid,
               "registry": stack.registry.pid if stack.registry is not None else None}
    return {name: pid for name, pid in servers.items() if pid is not None}


def host_bench(checkpoint: Path, *, workloads: Sequence[Workload] = tuple(WORKLOADS),
               deliveries: Sequence[DeliveryName] = DELIVERIES, formats: Sequence[Format] = ("json",),
               requests: Mapping[Workload, int] | None = None, device_ms: float = 0.0,
               device_tokens_per_s: float = 0.0, rounds: int = 1, seed: int = 0, threads: int = 1,
               max_batch_tokens: int = GPU_BATCH_TOKENS, warm_up: bool = True, stack: LocalStack | None = None,
               progress: Callable[[str], None] | None = None) -> HostReport:
    """Every workload of ``workloads`` in every format and delivery mode, ``rounds`` times in turn, one worker
    each run, on ``stack`` (default: a fresh embedded broker, store and, for Avro, registry). ``warm_up``: one
    unmeasured run per workload and format first (imports, first batch shapes, the registry's schemas)."""
    if stack is None:
        from d3stream.dev.infra import embedded_stack

        with embedded_stack(partitions=PARTITIONS, registry="avro" in formats) as fresh:
            return host_bench(checkpoint, workloads=workloads, deliveries=deliveries, formats=formats,
                              requests=requests, device_ms=device_ms, device_tokens_per_s=device_tokens_per_s,
                              rounds=rounds, seed=seed, threads=threads, max_batch_tokens=max_batch_tokens,
                              warm_up=warm_up, stack=fresh, progress=progress)
    import torch
    from d3stream_client.publisher import produce

    from d3stream.benchmarks.bench_service import framed_requests

    torch.set_num_threads(threads)
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = stack.store.access_key, stack.store.secret_key
    model = D3.from_pretrained(checkpoint, device="cpu")
    stand_in = install_stand_in(model, device_ms=device_ms, device_tokens_per_s=device_tokens_per_s)
    counts = {**DEFAULT_REQUESTS, **(requests or {})}
    prefix = f"host-{time.time_ns()}"
    bootstrap = stack.broker.bootstrap_servers
    sources: dict[tuple[Workload, Format], _Source] = {}
    for workload in workloads:
        records, questions = _records(workload, counts[workload], seed, model, stack)
        for format in formats:
            topic = f"{prefix}.{workload}.{format}.requests"
            stack.broker.create_topic(topic, PARTITIONS, exist_ok=True)
            if format == "avro":
                assert stack.registry is not None
                framed = framed_requests(stack.registry.url, {"requests-avro": topic}, records)
                asyncio.run(produce(bootstrap, topic, framed))
            else:
                asyncio.run(produce(bootstrap, topic, records))
            sources[(workload, format)] = _Source(topic, len(records), questions)
    servers = _servers(stack)
    runs: list[RunReport] = []
    plan = [(workload, format, mode) for workload in workloads for format in formats for mode in deliveries]
    if warm_up:
        for workload in workloads:
            for format in formats:
                if progress is not None:
                    progress(f"warm-up {workload} {format}")
                source = sources[(workload, format)]
                settings, _ = _settings(stack, source.topic, f"{prefix}.warm.{workload}.{format}", deliveries[0],
                                        format, threads=threads, max_batch_tokens=max_batch_tokens)
                asyncio.run(serve_measured(settings, model, max(1, source.requests // 5), servers))
    for round_number in range(rounds):
        for workload, format, mode in plan:
            if progress is not None:
                progress(f"{workload} {format} {mode} ({round_number + 1}/{rounds})")
            source = sources[(workload, format)]
            name = f"{prefix}.{workload}.{format}.{mode.replace('_', '-')}.{round_number}"
            settings, answers = _settings(stack, source.topic, name, mode, format, threads=threads,
                                          max_batch_tokens=max_batch_tokens)
            stand_in.log = DeviceLog()
            measured = asyncio.run(serve_measured(settings, model, source.requests, servers))
            if measured.service.counts["errors"]:
                raise RuntimeError(f"{name}: {measured.service.counts['errors']} requests were answered with an "
                                   "error (the figures would count work never done)")
            published = len(asyncio.run(published_values(bootstrap, answers)))
            runs.append(run_report(measured, stand_in, workload=workload, format=format, delivery=mode,
                                   round_number=round_number, requests=source.requests,
                                   questions=source.questions, answer_topic=answers, published=published))
    return {
        "checkpoint": str(checkpoint), "torch_threads": threads, "max_batch_tokens": max_batch_tokens,
        "device_ms": device_ms, "device_tokens_per_s": device_tokens_per_s, "partitions": PARTITIONS,
        "rounds": rounds, "h100_prefill_tokens_per_s": H100_PREFILL_TOKENS_PER_S,
        "workloads": {workload: WORKLOAD_TEXT[workload] for workload in workloads}, "runs": runs,
    }


# ------------------------------------------------------------------------------------------- markdown


def host_markdown(report: HostReport) -> str:
    """The CPU table (µs per question by stage) and the H100 table, one row per run."""
    device = (f"device {report['device_ms']:g} ms a pass" if report["device_ms"] else "no device time")
    if report["device_tokens_per_s"]:
        device += f" + padded tokens at {report['device_tokens_per_s']:,.0f}/s"
    lines = [
        f"Host path with a stand-in backbone ({device}), torch threads {report['torch_threads']}, "
        f"max_batch_tokens {report['max_batch_tokens']:,}, {report['partitions']} partitions. CPU µs per question:",
        "",
        "| workload | format | delivery | req/s | q/s | event loop | prepare | native | model thread | media | other | "
        "worker | outside forward | broker | busy share (steady) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        cpu = run["cpu_us_per_question"]
        media = cpu["fetch_threads"] + cpu["decode_threads"] + cpu["decode_processes"]
        lines.append(
            f"| {run['workload']} | {run['format']} | {run['delivery']} | {run['requests_per_s']:,.1f} | "
            f"{run['questions_per_s']:,.1f} | {cpu['event_loop']:,.0f} | {cpu['prepare']:,.0f} | "
            f"{cpu['native_threads']:,.0f} | {cpu['model_thread']:,.0f} | {media:,.0f} | {cpu['other']:,.0f} | {cpu['worker_total']:,.0f} | "
            f"{cpu['outside_forward']:,.0f} | {run['servers_cpu_us_per_question'].get('broker', 0.0):,.0f} | "
            f"{run['device']['busy_share']:.2f} ({run['device']['busy_share_steady']:.2f}) |")
    lines += [
        "",
        f"Against an H100 prefilling {report['h100_prefill_tokens_per_s']:,} tokens/s of the 0.8B backbone:",
        "",
        "| workload | format | delivery | prompt tokens/q | device tokens/q | H100 q/s | worker q/s | "
        "workers per H100 | CPU µs/q for one core |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in report["runs"]:
        h100 = run["h100"]
        lines.append(
            f"| {run['workload']} | {run['format']} | {run['delivery']} | {h100['prompt_tokens_per_question']:,.0f} | "
            f"{h100['device_tokens_per_question']:,.0f} | {h100['h100_questions_per_s']:,.0f} | "
            f"{run['questions_per_s']:,.1f} | {h100['workers_per_h100']:,.1f} | "
            f"{h100['cpu_us_per_question_for_one_core']:,.0f} |")
    return "\n".join(lines)
