"""Cross-event batching (d3stream.core.batching): ``pack`` and the ``BatchScheduler``, with plain-Python passes."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d3stream.core.batching import BatchScheduler, PassRecord
from d3stream.core.seams import DeadlineExceeded, Scheduling
from d3stream.runtime.packing import pack


@dataclass(eq=False)
class Item:
    """A row stand-in: identity matters (two rows of the same length are still two rows)."""

    length: int
    name: str = ""


def _length(item: Item) -> int:
    return item.length


def _padded(group: list[Item]) -> int:
    return len(group) * max(item.length for item in group)


# --------------------------------------------------------------------------------------------- pack


def test_pack_empty():
    assert pack([], _length, 4, 100) == []


def test_pack_groups_similar_lengths():
    items = [Item(n) for n in (10, 100, 12, 98, 11, 99)]
    passes = pack(items, _length, 3, 1000)
    assert [[i.length for i in group] for group in passes] == [[100, 99, 98], [12, 11, 10]]


def test_pack_respects_rows_and_tokens():
    items = [Item(50) for _ in range(10)]
    assert [len(g) for g in pack(items, _length, 4, 10_000)] == [4, 4, 2]
    assert [len(g) for g in pack(items, _length, 64, 160)] == [3, 3, 3, 1]


def test_single_over_budget_row_runs_alone():
    items = [Item(10), Item(5000), Item(10), Item(20)]
    passes = pack(items, _length, 8, 100)
    alone = [g for g in passes if any(i.length == 5000 for i in g)]
    assert len(alone) == 1 and len(alone[0]) == 1
    assert sorted(i.length for g in passes for i in g) == [10, 10, 20, 5000]


@settings(max_examples=400, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=3000), max_size=80),
    max_rows=st.integers(min_value=1, max_value=20),
    max_tokens=st.integers(min_value=1, max_value=8000),
)
def test_pack_properties(lengths, max_rows, max_tokens):
    items = [Item(n, str(i)) for i, n in enumerate(lengths)]
    passes = pack(items, _length, max_rows, max_tokens)
    # Every row exactly once.
    seen = [id(item) for group in passes for item in group]
    assert sorted(seen) == sorted(map(id, items))
    assert len(seen) == len(set(seen))
    for group in passes:
        assert group, "no empty passes"
        assert len(group) <= max_rows
        if len(group) > 1:
            assert _padded(group) <= max_tokens
        if any(item.length > max_tokens for item in group):
            assert len(group) == 1, "an over-budget row runs alone"
    # Similar lengths together: the passes cover disjoint, descending length ranges.
    for first, second in zip(passes, passes[1:], strict=False):
        assert min(i.length for i in first) >= max(i.length for i in second)
    # Greedy cuts: a pass is cut only when the next row would not fit.
    for first, second in zip(passes, passes[1:], strict=False):
        nxt = second[0]
        assert len(first) >= max_rows or (len(first) + 1) * max(first[0].length, nxt.length) > max_tokens


# ------------------------------------------------------------------------------------- BatchScheduler


class FakeModel:
    """run(rows) -> [row.length * 2]; records each pass's rows; fails on demand."""

    def __init__(self, *, fail_if=None, delay: float = 0.0):
        self.calls: list[list[Item]] = []
        self.fail_if = fail_if
        self.delay = delay
        self.threads: set[int] = set()

    def __call__(self, rows: list[Item]) -> list[int]:
        self.calls.append(list(rows))
        self.threads.add(threading.get_ident())
        if self.delay:
            time.sleep(self.delay)
        if self.fail_if is not None:
            self.fail_if(rows)
        return [row.length * 2 for row in rows]


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


def test_linger_batches_rows_submitted_close_together():
    model = FakeModel()

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=100, max_batch_rows=64, max_batch_tokens=10_000)
        items = [Item(10 + n) for n in range(5)]

        async def later(item, pause):
            await asyncio.sleep(pause)
            return await scheduler.submit([item])

        results = await asyncio.gather(*(later(item, 0.01 * n) for n, item in enumerate(items)))
        await scheduler.close()
        return items, results, scheduler

    items, results, scheduler = _run(scenario())
    assert len(model.calls) == 1 and len(model.calls[0]) == 5
    for item, [(value, record)] in zip(items, results, strict=True):
        assert value == item.length * 2
        assert isinstance(record, PassRecord)
        assert record.rows == 5
        assert record.real_tokens == sum(i.length for i in items)
        assert record.padded_tokens == 5 * 14
        assert record.real_tokens <= record.padded_tokens and record.seconds >= 0
    assert (scheduler.passes_run, scheduler.rows_run) == (1, 5)
    assert scheduler.real_tokens == sum(i.length for i in items) and scheduler.padded_tokens == 70


def test_rows_submitted_apart_run_in_separate_passes():
    model = FakeModel()

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=5)
        first = await scheduler.submit([Item(3)])
        await asyncio.sleep(0.1)
        second = await scheduler.submit([Item(4)])
        await scheduler.close()
        return first, second

    first, second = _run(scenario())
    assert len(model.calls) == 2
    assert first[0][0] == 6 and second[0][0] == 8


def test_a_full_pass_does_not_wait_for_the_linger():
    model = FakeModel()

    async def scenario():
        # An hour's linger: a pass that waited for it would never come back within the guard below.
        scheduler = BatchScheduler(model, length=_length, linger_ms=3_600_000, max_batch_rows=4)
        results = await asyncio.wait_for(scheduler.submit([Item(n + 1) for n in range(4)]), 120)
        await scheduler.close()
        return results

    results = _run(scenario())
    assert [value for value, _ in results] == [2, 4, 6, 8]  # results in submission order


def test_token_budget_full_does_not_wait_for_the_linger():
    model = FakeModel()

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=20_000, max_batch_tokens=100)
        started = time.perf_counter()
        await scheduler.submit([Item(60), Item(50)])
        elapsed = time.perf_counter() - started
        await scheduler.close()
        return elapsed

    assert _run(scenario()) < 5
    assert all(_padded(call) <= 100 for call in model.calls)  # 2 x 60 > 100: two passes
    assert len(model.calls) == 2


def test_passes_respect_rows_and_tokens_and_sort_by_length():
    model = FakeModel()

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=50, max_batch_rows=3, max_batch_tokens=400)
        items = [Item(n) for n in (100, 5, 90, 6, 95, 7, 8)]
        results = await asyncio.gather(*(scheduler.submit([item]) for item in items))
        await scheduler.close()
        return items, results

    items, results = _run(scenario())
    assert all(len(call) <= 3 and _padded(call) <= 400 for call in model.calls)
    ran = sorted(id(i) for call in model.calls for i in call)
    assert ran == sorted(map(id, items))
    assert [sorted(i.length for i in call) for call in model.calls] == [[90, 95, 100], [6, 7, 8], [5]]
    for item, [(value, _)] in zip(items, results, strict=True):
        assert value == item.length * 2


def test_failing_pass_is_split_and_a_row_failing_alone_gets_the_exception():
    class Poisoned(Exception):
        pass

    def fail_if(rows):
        if any(row.name == "bad" for row in rows):
            raise Poisoned("bad row in this pass")

    model = FakeModel(fail_if=fail_if)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=50)
        items = [Item(10 + n, "bad" if n == 5 else f"ok{n}") for n in range(8)]
        outcomes = await asyncio.gather(*(scheduler.submit([item]) for item in items), return_exceptions=True)
        await scheduler.close()
        return items, outcomes

    items, outcomes = _run(scenario())
    for item, outcome in zip(items, outcomes, strict=True):
        if item.name == "bad":
            assert isinstance(outcome, Poisoned)
        else:
            assert not isinstance(outcome, BaseException), outcome
            assert outcome[0][0] == item.length * 2
    assert len(model.calls[0]) == 8  # tried together first
    assert [c for c in model.calls if len(c) == 1 and c[0].name == "bad"], "the bad row was retried alone"
    assert sum(1 for c in model.calls if any(r.name == "bad" for r in c)) <= 4  # halving: 8, 4, 2, 1


def test_out_of_memory_style_failures_halve_until_the_pass_fits():
    def fail_if(rows):
        if len(rows) > 2:
            raise RuntimeError("CUDA out of memory (pretend)")

    model = FakeModel(fail_if=fail_if)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=50)
        items = [Item(n + 1) for n in range(8)]
        outcomes = await asyncio.gather(*(scheduler.submit([i]) for i in items))
        await scheduler.close()
        return items, outcomes, scheduler

    items, outcomes, scheduler = _run(scenario())
    assert [o[0][0] for o in outcomes] == [i.length * 2 for i in items]
    assert all(o[0][1].rows <= 2 for o in outcomes)
    assert scheduler.rows_run == 8 and scheduler.passes_run == 4


def test_a_multi_row_submit_fails_when_one_of_its_rows_fails_alone():
    def fail_if(rows):
        if any(row.name == "bad" for row in rows):
            raise ValueError("nope")

    model = FakeModel(fail_if=fail_if)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=10)
        neighbour = asyncio.ensure_future(scheduler.submit([Item(3, "ok")]))
        with pytest.raises(ValueError, match="nope"):
            await scheduler.submit([Item(4, "ok"), Item(5, "bad")])
        result = await neighbour
        await scheduler.close()
        return result

    assert _run(scenario())[0][0] == 6


def test_passes_run_one_at_a_time_on_one_thread():
    model = FakeModel(delay=0.01)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=1, max_batch_rows=1)
        await asyncio.gather(*(scheduler.submit([Item(n + 1)]) for n in range(6)))
        await scheduler.close()

    _run(scenario())
    assert len(model.calls) == 6
    assert len(model.threads) == 1


def test_close_finishes_submitted_rows_then_refuses_new_ones():
    model = FakeModel(delay=0.02)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=30)
        pending = [asyncio.ensure_future(scheduler.submit([Item(n + 1)])) for n in range(3)]
        await asyncio.sleep(0)  # let the submits register
        await scheduler.close()
        results = [(await p)[0][0] for p in pending]
        with pytest.raises(RuntimeError, match="closed"):
            await scheduler.submit([Item(1)])
        return results

    assert _run(scenario()) == [2, 4, 6]


def test_invalid_limits_are_refused():
    with pytest.raises(ValueError):
        BatchScheduler(lambda rows: rows, length=len, max_batch_rows=0)
    with pytest.raises(ValueError):
        BatchScheduler(lambda rows: rows, length=len, max_batch_tokens=0)


def test_a_pass_with_the_wrong_number_of_results_fails_its_rows_and_the_scheduler_keeps_going():
    def run(rows):
        if any(row.name == "short" for row in rows):
            return [0]  # a broken run: one result for several rows
        return [row.length * 2 for row in rows]

    async def scenario():
        scheduler = BatchScheduler(run, length=_length, linger_ms=20)
        outcomes = await asyncio.wait_for(
            asyncio.gather(scheduler.submit([Item(1, "short")]), scheduler.submit([Item(2)]), return_exceptions=True),
            timeout=1,
        )
        later = await asyncio.wait_for(scheduler.submit([Item(3)]), timeout=1)
        return outcomes, later

    outcomes, later = _run(scenario())
    assert any(isinstance(o, BaseException) for o in outcomes)
    assert later[0][0] == 6


# ------------------------------------------------------------------------- lanes, ageing, deadlines

HIGH, NORMAL, LOW = Scheduling(lane=0), Scheduling(lane=1), Scheduling(lane=2)


def test_a_high_row_arriving_behind_a_low_flood_rides_the_next_pass():
    """Passes are cut one at a time: a high-priority row submitted while a flood of low rows is queued runs
    in the very next pass, not after the flood; with lanes off it waits behind the flood's longer rows."""

    def order(lanes: bool) -> list[str]:
        model = FakeModel(delay=0.05)

        async def scenario():
            scheduler = BatchScheduler(model, length=_length, linger_ms=1, max_batch_rows=2, lanes=lanes)
            flood = [scheduler.enqueue([Item(20, f"low{n}")], None, LOW) for n in range(12)]
            await asyncio.sleep(0.02)  # the first pass of the flood is running
            urgent = scheduler.enqueue([Item(10, "high")], None, HIGH)
            await asyncio.gather(urgent, *flood)
            await scheduler.close()

        _run(scenario())
        return [item.name for call in model.calls for item in call]

    with_lanes, without = order(True), order(False)
    assert with_lanes.index("high") <= 3, with_lanes  # the first pass (2 rows) was running; it rode the second
    assert without.index("high") == len(without) - 1, without  # lanes off: shorter, so after every longer row


def test_ageing_lets_a_low_row_through_a_steady_high_stream():
    """High rows arrive faster than passes run; a low row submitted first still runs after about two ageing
    steps instead of never (without ageing it would wait for the stream to end)."""
    model = FakeModel(delay=0.02)

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=1, max_batch_rows=1, lane_ageing_ms=60)
        low = scheduler.enqueue([Item(5, "low")], None, LOW)
        highs = []
        for n in range(60):  # one every ~10 ms: twice what one-row passes of 20 ms can take
            highs.append(scheduler.enqueue([Item(5, f"high{n}")], None, HIGH))
            await asyncio.sleep(0.01)
        await asyncio.gather(low, *highs)
        await scheduler.close()

    _run(scenario())
    ran = [item.name for call in model.calls for item in call]
    assert len(ran) == 61
    assert ran.index("low") < 40, ran  # well before the stream's end, with 20+ high rows still waiting


def test_rows_past_their_deadline_are_dropped_without_a_pass():
    """Expired before it was queued: settled with DeadlineExceeded, never run. Expiring while it lingers:
    dropped when the pass is cut; its neighbour runs alone."""
    model = FakeModel()

    async def scenario():
        scheduler = BatchScheduler(model, length=_length, linger_ms=300)
        gone = scheduler.enqueue([Item(4, "gone"), Item(5, "gone2")], None, Scheduling(deadline=time.time() - 2))
        soon = scheduler.enqueue([Item(6, "soon")], None, Scheduling(deadline=time.time() + 0.05))
        kept = scheduler.enqueue([Item(7, "kept")], None, NORMAL)
        results = await asyncio.gather(gone, soon, kept)
        await scheduler.close()
        return results, scheduler

    (gone, soon, kept), scheduler = _run(scenario())
    assert all(isinstance(outcome, DeadlineExceeded) for outcome in gone + soon)
    assert gone[0].late_ms >= 1900 and soon[0].late_ms > 0
    assert [[item.name for item in call] for call in model.calls] == [["kept"]]
    assert kept[0][0] == 14 and scheduler.rows_expired == 3
    assert scheduler.device_seconds == pytest.approx(kept[0][1].seconds)


def test_while_high_rows_come_passes_are_capped_so_a_flood_delays_a_high_row_by_one_short_pass():
    """lane_pass_tokens: once a high row was queued (within lane_ageing_ms), every pass holds at most that many
    padded tokens; a high row arriving behind a flood rides the pass after the one running, and both are short.
    With no high row for lane_ageing_ms, passes are full again. Without the cap the high row's pass is filled
    with flood rows up to max_batch_tokens."""

    def scenario(cap: int):
        model = FakeModel(delay=0.02)

        async def go():
            scheduler = BatchScheduler(model, length=_length, linger_ms=1, max_batch_rows=64, max_batch_tokens=2000,
                                       lane_ageing_ms=1000, lane_pass_tokens=cap)
            await scheduler.enqueue([Item(50, "h0")], None, HIGH)  # high traffic seen
            flood = [scheduler.enqueue([Item(100, f"low{n}")], None, LOW) for n in range(30)]
            while not model.calls or model.calls[-1][0].name == "h0":  # the flood's first pass is running
                await asyncio.sleep(0.002)
            running = len(model.calls)
            await asyncio.gather(scheduler.enqueue([Item(50, "h1")], None, HIGH), *flood)
            await asyncio.sleep(1.1)  # no high row for longer than lane_ageing_ms
            quiet_from = len(model.calls)
            await asyncio.gather(*(scheduler.enqueue([Item(100, f"late{n}")], None, LOW) for n in range(30)))
            await scheduler.close()
            return running, quiet_from

        running, quiet_from = _run(go())
        high_pass = next(n for n, call in enumerate(model.calls) if any(item.name == "h1" for item in call))
        return model.calls, running, quiet_from, high_pass

    calls, running, quiet_from, high_pass = scenario(300)
    assert high_pass <= running, "one pass (the one running) at most between the high row and its pass"
    assert all(_padded(call) <= 300 for call in calls[:quiet_from]), [_padded(call) for call in calls]
    assert max(_padded(call) for call in calls[quiet_from:]) > 300, "no high traffic: full passes again"
    assert sum(len(call) for call in calls) == 62

    calls, _, _, high_pass = scenario(0)  # no cap: the high row's pass is filled with flood rows
    assert _padded(calls[high_pass]) > 300
