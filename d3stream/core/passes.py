"""Forward passes for prepared requests: the row scheduler, shared-prefix reuse, and what each request rode in.

Rows (question prompts) of many requests are packed into passes by a ``RowScheduler``: the token-budget
``batching.BatchScheduler`` when serving, or a replay's ``ordered.OrderedPasses`` whose passes depend only on the
source order. A request with two or more rows on a causal checkpoint is first *planned*
(``runtime.prefix.PrefixRunner.plan``: where its shared prefix ends) and then goes, whole, to a second
scheduler whose calls run ``PrefixRunner.run_requests``: prefix passes fill each request's cache, suffix
passes answer rows of many requests from their caches. Both schedulers share one model thread, so passes
never run side by side on the device. If a shared-prefix call fails, the request's rows run as full prompts.

A pass that fails is split and retried by the scheduler; a row failing alone fails only its question
(``invalid_model_output``). Each request gets the record of the passes that carried it (its provenance's
``batch``) and its queueing and forward time, and its share of each pass's device time, by tokens
(provenance ``cost``; docs/SCHEDULING.md). A request whose deadline passes before its rows ride a pass
is marked ``expired`` (the pipeline answers it ``deadline_exceeded``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack, cast

import structlog
from d3stream_client.contract import BatchRecord

from d3stream.core.answers import ms
from d3stream.core.batching import BatchScheduler, PassRecord, RowOutcome, resolve
from d3stream.core.record import RequestRecord, Stage
from d3stream.core.seams import DeadlineExceeded, DecisionModel, Position, Scheduling
from d3stream.ops.metrics import Metrics
from d3stream.runtime.cpu_threads import intraop_initializer
from d3stream.runtime.model import Prepared, Row
from d3stream.settings import BatchingSettings

if TYPE_CHECKING:
    from d3stream.runtime.model import D3
    from d3stream.runtime.prefix import Check, PassInfo, PrefixRunner
    from d3stream.runtime.prefix_passes import Plan

log = structlog.get_logger(__name__)

# A full-prompt row's outcome: its option probabilities and the pass it rode in, or its exception.
Outcome = RowOutcome[list[float]]
# A shared-prefix request's outcome: its rows' probabilities and the runner's passes that answered them.
SharedRun = tuple[dict[Row, list[float]], list["PassInfo"]]
# A request prepared on the prepare thread, with its shared-prefix plan (``Passes.plan``), or what went wrong.
PrepareOutcome = tuple[Prepared, "Plan | None"] | BaseException


class SharedPrefix(TypedDict, total=False):
    """What a shared-prefix run adds to the batch record of the request it answered."""

    shared_prefix: bool
    saved_tokens: int


def model_thread(intraop_threads: int | None = None) -> ThreadPoolExecutor:
    """The one thread every pass of a device runs on, with ``intraop_threads`` for torch's CPU ops (None: what
    the calling thread has; ``runtime.cpu_threads``)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="d3stream-model",
                              initializer=intraop_initializer(intraop_threads))


def default_token_budget(device: str) -> int:
    """Padded tokens per pass: a GPU keeps gaining up to ~16k, a CPU saturates at 1-4k."""
    return 16_384 if str(device).startswith("cuda") else 4_096


class RowScheduler(Protocol):
    """Packs rows of many requests into passes of the model; one outcome per row."""

    @property
    def passes_run(self) -> int:
        """Passes run so far."""
        ...

    def expect(self, positions: Sequence[Position]) -> None:
        """Requests were read at ``positions`` (a source-ordered scheduler keeps their places)."""
        ...

    def finished(self, position: Position) -> None:
        """The request read at ``position`` is answered; if it submitted no rows it holds nothing back."""
        ...

    def enqueue_many(self, requests: Sequence[tuple[Sequence[Row], Position, Scheduling]],
                     settled: Callable[[int, list[Outcome]], object]) -> None:
        """Queue the rows of several requests, each ``(rows, position, scheduling)``; ``settled(index, outcomes)``
        is called on the event loop once every row of request ``index`` has run, with each row's
        (probabilities, pass record), or the exception of a row that failed alone. ``scheduling`` (lane,
        deadline) may be ignored; a scheduler that honours a deadline settles the rows it drops with
        ``seams.DeadlineExceeded``. ``settled`` must not raise."""
        ...

    async def close(self) -> None: ...


class Passes:
    """The model side of a worker: one model thread, the row scheduler and the shared-prefix scheduler."""

    def __init__(self, batching: BatchingSettings, model: DecisionModel, metrics: Metrics,
                 scheduler: RowScheduler | None = None, *, executor: ThreadPoolExecutor | None = None):
        self.metrics = metrics
        self.budget = batching.max_batch_tokens or default_token_budget(str(model.device))
        # Passes while high-priority traffic is about: short, so a high request waits for little (SCHEDULING.md).
        lane_budget = self.budget // 16 if batching.lane_pass_tokens is None else batching.lane_pass_tokens
        # One model thread for both schedulers: passes never run side by side on the device. A worker serving
        # several models hands every model's Passes the same one (it shuts it down itself).
        self._owns_executor = executor is None
        self.executor = executor or model_thread()
        self.rows: RowScheduler = scheduler or BatchScheduler(
            model.forward,
            length=attrgetter("length"),  # read once a row, in C
            max_batch_rows=batching.max_batch_rows,
            max_batch_tokens=self.budget,
            linger_ms=batching.linger_ms,
            executor=self.executor,
            on_pass=metrics.observe_pass_record,
            lanes=batching.priority_lanes,
            lane_ageing_ms=batching.lane_ageing_ms,
            lane_pass_tokens=lane_budget,
        )
        self.prefix_runner: PrefixRunner | None = self._prefix_runner(batching, model) if scheduler is None else None
        self.prefix_scheduler: BatchScheduler[Plan, SharedRun] | None = None
        self._call_passes: list[PassInfo] = []  # the runner's passes during the current call (model thread only)
        if self.prefix_runner is not None:
            self.prefix_scheduler = BatchScheduler(
                self._run_shared_prefix,
                length=lambda plan: plan.length + sum(plan.suffix_length(row) for row in plan.rows),
                max_batch_rows=batching.max_batch_rows,
                # A call packs its own passes under the budget; a few passes' worth per call keeps the
                # full-prompt scheduler's turn on the model thread near.
                max_batch_tokens=4 * self.budget,
                linger_ms=batching.linger_ms,
                executor=self.executor,
                lanes=batching.priority_lanes,
                lane_ageing_ms=batching.lane_ageing_ms,
                lane_pass_tokens=lane_budget,  # a call of this budget runs passes within it too
            )

    def provenance(self) -> dict[str, object]:
        """What answers depend on besides the model: the prefix reuse policy, when it is on."""
        return self.prefix_runner.provenance() if self.prefix_runner is not None else {}

    async def close(self) -> None:
        await self.rows.close()
        if self.prefix_scheduler is not None:
            await self.prefix_scheduler.close()
        if self._owns_executor:
            self.executor.shutdown(wait=True)

    # ---------------------------------------------------------------------------------- planning

    def plan(self, prepared: Prepared) -> Plan | None:
        """The shared-prefix plan of a prepared request, or None (runs on the prepare thread)."""
        runner = self.prefix_runner
        if runner is None or len(prepared.rows) < runner.min_rows:
            return None
        plan = runner.plan(prepared)
        if plan is not None:
            self.metrics.count_prefix_request("shared")
        return plan

    # ------------------------------------------------------------------------------------ running

    async def run(self, items: Sequence[RequestRecord]) -> AsyncIterator[list[RequestRecord]]:
        """Answer every row of ``items``, yielding the requests whose rows are all answered, a pass at a time
        (a request does not wait for the last pass of its fetch). Full-prompt rows are queued in one submission,
        without a future or a task per request; a request with a shared-prefix plan runs on that scheduler."""
        submitted = time.perf_counter()
        # Requests settled since the last look, with their rows' outcomes (None: a shared-prefix run, done), and a
        # wake-up for when there are none (lighter than a Queue: a pass settles dozens of requests at once).
        finished: list[tuple[RequestRecord, list[Outcome] | None]] = []
        settled = asyncio.Event()
        plain = [item for item in items if item.plan is None]
        shared = [item for item in items if item.plan is not None]

        def arrived(index: int, outcomes: list[Outcome]) -> None:
            finished.append((plain[index], outcomes))
            settled.set()

        def ran(item: RequestRecord, task: asyncio.Future[None]) -> None:
            finished.append((item, None))
            settled.set()

        for item in items:
            item.submitted_at = submitted
        if plain:
            self.rows.enqueue_many([(_rows(item), item.position, item.scheduling) for item in plain], arrived)
        tasks = []
        for item in shared:
            task = asyncio.ensure_future(self._run_shared(item))
            task.add_done_callback(partial(ran, item))
            tasks.append(task)
        left = len(items)
        while left:
            if not finished:
                settled.clear()
                await settled.wait()
            done = finished[:]
            finished.clear()
            left -= len(done)
            chunk = []
            # Requests settled by one pass spent the same time in it and before it: observed once, with a count.
            times: dict[tuple[float, float], int] = {}
            now = time.perf_counter()
            for item, outcomes in done:
                if outcomes is not None:
                    self._take_outcomes(item, outcomes, submitted, now, times)
                item.advance(Stage.SCORED)
                chunk.append(item)
            for (forward, queued), count in times.items():
                self.metrics.observe_stage("forward", forward, count)
                self.metrics.observe_stage("queued", queued, count)
            for task in tasks:
                if task.done():
                    task.result()  # a shared-prefix run's own fault is the caller's
            tasks = [task for task in tasks if not task.done()]
            yield chunk

    async def _run_rows(self, item: RequestRecord) -> None:
        """One request's rows as full prompts (the fallback of a failed shared-prefix call)."""
        submitted = time.perf_counter()
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        self.rows.enqueue_many([(_rows(item), item.position, item.scheduling)],
                               lambda _, outcomes: resolve(future, outcomes))
        self._take_outcomes(item, await future, submitted)

    def _take_outcomes(self, item: RequestRecord, outcomes: list[Outcome], submitted: float, now: float | None = None,
                       times: dict[tuple[float, float], int] | None = None) -> None:
        """A request's probabilities from its rows' outcomes; a row whose pass failed alone fails its question,
        a row dropped at its deadline expires the request. ``now`` and ``times``: as for ``_account``."""
        prepared = item.prepared
        assert prepared is not None  # it rode the passes: it was prepared
        rows = prepared.rows
        record = _one_pass(outcomes)
        if record is not None:  # the common case: every row answered, all in one pass
            answered = cast("list[tuple[list[float], PassRecord]]", outcomes)
            item.probabilities = {row: result for row, (result, _) in zip(rows, answered, strict=True)}
            # Its rows are those it was prepared with (only a failed row is ever dropped): ``tokens`` counts them.
            item.device_seconds += _share(record.seconds, item.tokens, record.real_tokens)
            item.padded_tokens += len(rows) * (record.padded_tokens // max(record.rows, 1))
            self._account(item, submitted, [record], now, times)
            return
        probabilities = item.probabilities
        mine: dict[int, tuple[PassRecord, list[int]]] = {}  # per pass: its record, the lengths of our rows in it
        failed = False
        for row, outcome in zip(rows, outcomes, strict=True):
            if type(outcome) is tuple:
                result, record = outcome
                probabilities[row] = result
                seen = mine.get(id(record))
                if seen is None:
                    mine[id(record)] = (record, [row.length])
                else:
                    seen[1].append(row.length)
            elif isinstance(outcome, DeadlineExceeded):
                item.expired = outcome
            else:
                failed = True
                question = prepared.questions[row.key]
                prepared.errors[row.key] = {
                    "type": question.kind,
                    "error": "invalid_model_output",
                    "message": f"the forward pass failed for this question: {type(outcome).__name__}: {outcome}",
                }
        if failed:
            prepared.rows = [row for row in rows if row.key not in prepared.errors]
        for record, lengths in mine.values():
            item.device_seconds += _share(record.seconds, sum(lengths), record.real_tokens)
            item.padded_tokens += len(lengths) * (record.padded_tokens // max(record.rows, 1))
        self._account(item, submitted, [record for record, _ in mine.values()], now, times)

    async def _run_shared(self, item: RequestRecord) -> None:
        """A multi-question request on its shared prefix; if that fails, its rows run as full prompts."""
        assert self.prefix_scheduler is not None
        plan = item.plan
        assert plan is not None  # only requests with a plan run here
        submitted = item.submitted_at = time.perf_counter()
        try:
            [((probabilities, passes), _)] = await self.prefix_scheduler.submit([plan], item.scheduling)
        except DeadlineExceeded as exc:
            item.expired = exc
            return
        except Exception as exc:  # noqa: BLE001 - the full-prompt path splits and reports row failures
            log.warning("shared-prefix run failed; running full prompts", error=f"{type(exc).__name__}: {exc}")
            await self._run_rows(item)
            return
        # Shared only if each row's answer came from a suffix pass (a failed check re-answers from full prompts).
        answered_by = {row: info.kind for info in passes if info.kind in ("suffix", "full") for row in info.done}
        reused = bool(answered_by) and all(kind == "suffix" for kind in answered_by.values())
        self._share_prefix_passes(item, plan, passes)
        self._account(item, submitted, passes, shared_prefix=reused,
                      saved_tokens=(len(plan.rows) - 1) * plan.length if reused else 0)
        item.probabilities = probabilities

    @staticmethod
    def _share_prefix_passes(item: RequestRecord, plan: Plan, passes: Sequence[PassInfo]) -> None:
        """The request's share of the shared-prefix runner's passes, by the tokens it ran in each: its prefix
        in a prefix pass, its rows' suffixes (or whole prompts) in the passes that answered them. Exact-replay
        check passes are not attributed to any request (docs/SCHEDULING.md)."""
        rows = set(plan.rows)
        for info in passes:
            if info.kind == "prefix":
                tokens, count = (plan.length, 1) if plan in info.prefixes else (0, 0)
            else:
                answered = [row for row in info.done if row in rows]
                count = len(answered)
                tokens = sum(plan.suffix_length(row) if info.kind == "suffix" else row.length for row in answered)
            item.device_seconds += _share(info.seconds, tokens, info.real_tokens)
            item.padded_tokens += count * (info.padded_tokens // max(info.rows, 1))

    def _account(self, item: RequestRecord, submitted: float, passes: Sequence[PassRecord | PassInfo],
                 now: float | None = None, times: dict[tuple[float, float], int] | None = None,
                 **batch: Unpack[SharedPrefix]) -> None:
        """The request's forward and queueing time and its batch record, from the passes that carried it
        (``PassRecord`` or the prefix runner's ``PassInfo``: both have rows, tokens and seconds), as of ``now``
        (default: now). With ``times`` its (forward, queued) seconds are counted there, for the caller to
        observe together with those of the other requests it settles at once; else they are observed here."""
        if len(passes) == 1 and not batch:  # the common case: the pass's own record, shared by its requests
            [only] = passes
            forward = only.seconds
            item.batch = only.batch if type(only) is PassRecord else BatchRecord(
                passes=1, rows=only.rows, real_tokens=only.real_tokens, padded_tokens=only.padded_tokens)
        else:
            forward = sum(record.seconds for record in passes)
            item.batch = BatchRecord(
                passes=len(passes),
                rows=sum(record.rows for record in passes),
                real_tokens=sum(record.real_tokens for record in passes),
                padded_tokens=sum(record.padded_tokens for record in passes),
                **batch,
            )
        queued = max(0.0, (time.perf_counter() if now is None else now) - submitted - forward)
        item.timings.forward = ms(forward)
        item.timings.queued = ms(queued)
        if times is None:
            self.metrics.observe_stage("forward", forward)
            self.metrics.observe_stage("queued", queued)
        else:
            key = (forward, queued)
            times[key] = times.get(key, 0) + 1

    # ------------------------------------------------------------------------- shared-prefix reuse

    @staticmethod
    def _reuse_wanted(batching: BatchingSettings, model: DecisionModel) -> bool:
        if batching.prefix_reuse == "off":
            return False
        if model.attention_mode == "causal":
            return True
        if batching.prefix_reuse == "on":
            raise ValueError(
                f"prefix_reuse=on needs a causal checkpoint; {model.model_name} uses attention_mode="
                f"{model.attention_mode!r}, where the prefix reads the question. Set prefix_reuse to auto or off."
            )
        return False

    def _prefix_runner(self, batching: BatchingSettings, model: DecisionModel) -> PrefixRunner | None:
        if not self._reuse_wanted(batching, model):
            return None
        from d3stream.runtime.prefix import PrefixRunner

        def checked(check: Check) -> None:
            # The runner counts a check into its running maximum before reporting it: the maximum is set.
            largest = runner.max_abs_dp
            self.metrics.observe_prefix_check(check.passed, check.max_abs_dp if largest is None else largest)

        # The runner reaches into the backbone: a causal model here is a D3 (or a test's wrapper of one).
        runner = PrefixRunner(
            cast("D3", model),
            max_batch_tokens=self.budget,
            max_batch_rows=batching.max_batch_rows,
            verify_every=batching.prefix_verify_every,
            tolerance=batching.prefix_tolerance,
            on_pass=self._runner_pass,
            on_check=checked,
            on_fallback=lambda reason, prepared: self.metrics.count_prefix_request(reason),
        )
        return runner

    def _runner_pass(self, info: PassInfo) -> None:
        self._call_passes.append(info)
        self.metrics.observe_pass_record(info)

    def _run_shared_prefix(self, plans: list[Plan]) -> list[SharedRun]:
        """One call of the prefix runner on the model thread: each request's probabilities, and the passes
        that answered its rows (for its provenance)."""
        runner = self.prefix_runner
        assert runner is not None  # the shared-prefix scheduler runs beside a runner only
        self._call_passes = []
        results = runner.run_requests(plans)
        passes = self._call_passes
        return [
            (result, [info for info in passes if plan in info.prefixes or any(row in result for row in info.done)])
            for plan, result in zip(plans, results, strict=True)
        ]


def _rows(record: RequestRecord) -> list[Row]:
    prepared = record.prepared
    assert prepared is not None  # only prepared requests are handed to the passes
    return prepared.rows


def _one_pass(outcomes: list[Outcome]) -> PassRecord | None:
    """The pass that answered every row, when they all rode the same one (None otherwise)."""
    record = None
    for outcome in outcomes:
        if not isinstance(outcome, tuple):
            return None
        if record is None:
            record = outcome[1]
        elif outcome[1] is not record:
            return None
    return record


def _share(seconds: float, tokens: int, pass_tokens: int) -> float:
    """A pass's device time attributed to ``tokens`` of its ``pass_tokens`` real tokens."""
    return seconds * tokens / pass_tokens if pass_tokens > 0 else 0.0
