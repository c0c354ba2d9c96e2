"""What an eager rebalance costs a worker, on the real broker: the partitions handed back are kept, the ones
that move are let go, and exactly once holds either way.

aiokafka revokes every partition of every member at each join or leave. With ``rebalance_keep_partitions``
(on by default in exactly_once: docs/SCALEOUT.md) a worker holds its revoked partitions until the next
assignment: those handed back keep their transactional producer (no new ``init_transactions``), their work in
flight and their offsets; those that moved to the joining worker are closed, and the answers this worker still
had in hand for them are never committed (the new owner answers them). With the setting off, every partition is drained, closed and settled afresh.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.service import Service
from tests.support.stream_helpers import Q_NOUL, GatedModel, Reader, assigned_and_ready, record, run, stop

pytestmark = pytest.mark.timeout(240)


def _sample(service: Service, name: str) -> float:
    return service.metrics.registry.get_sample_value(name) or 0.0


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "drain"])
def test_a_join_keeps_the_partitions_handed_back_and_answers_each_request_once(stack, qwen35_model, keep):
    """A worker stuck in a forward pass with work on every partition; a second worker joins and takes some
    partitions. Kept: the first worker's partitions that came back have the very producers they had (no
    re-initialisation), their stuck work is answered and committed by it once the pass ends; the moved ones'
    stuck work is answered by the second worker only. Not kept: every producer is new. Either way every request
    has exactly one committed answer."""
    settings = stack.settings(max_batch_rows=1, linger_ms=0, commit_interval_ms=100, rebalance_drain_s=0.5,
                              rebalance_keep_partitions=keep)
    stuck = [{"id": f"stuck-{n}", "state": f"stuck {n}", "questions": {"noul": Q_NOUL}} for n in range(8)]
    later = [{"id": f"later-{n}", "state": f"later {n}", "questions": {"noul": Q_NOUL}} for n in range(8)]
    ids = {r["id"] for r in stuck + later}
    gated = GatedModel(qwen35_model)

    async def scenario() -> tuple[dict[str, Any], Any]:
        bootstrap = stack.broker.bootstrap_servers
        first, second = Service(settings, gated), Service(settings, qwen35_model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(first.run())
            joining = None
            try:
                await reader.wait(lambda: assigned_and_ready(first) and not first.loop.settling, 60, task,
                                  what="the first worker's assignment")
                before = dict(first.delivery.producers)
                await produce(bootstrap, stack.requests, [record(r) for r in stuck])
                await reader.wait(lambda: first.in_flight.requests == len(stuck), 30, task, what="requests stuck")
                joining = asyncio.create_task(second.run())
                await reader.wait(lambda: assigned_and_ready(second) and not second.loop.settling
                                  and assigned_and_ready(first) and not first.loop.settling, 60, task, joining,
                                  what="both workers settled")
                kept = set(first.consumer.assignment())
                moved = set(before) - kept
                figures = {
                    "kept": kept, "moved": moved,
                    "same_producers": {tp for tp in kept if first.delivery.producers.get(tp) is before[tp]},
                    "kept_total": _sample(first, "d3stream_partitions_kept_total"),
                    "abandoned": _sample(first, "d3stream_revoked_requests_abandoned_total"),
                    "paused_s": _sample(first, "d3stream_rebalance_paused_seconds_total"),
                }
                await produce(bootstrap, stack.requests, [record(r) for r in later])
                gated.gate.set()
                await reader.wait_ids(ids, 60, task, joining)
                await asyncio.sleep(1.0)  # a few commit intervals: a late duplicate would show now
            finally:
                gated.gate.set()
                first.stop()
                second.stop()
                await asyncio.wait_for(asyncio.gather(task, *([joining] if joining else []),
                                                      return_exceptions=True), 90)
            await reader.caught_up()
            return figures, reader.counts()

    figures, counts = run(scenario())
    assert set(counts) == ids, f"unanswered: {sorted(ids - set(counts))}"
    assert all(count == 1 for count in counts.values()), f"answered twice: {counts}"
    assert figures["kept"] and figures["moved"], f"the join moved no partition, or all of them: {figures}"
    assert figures["paused_s"] > 0, figures
    if keep:
        assert figures["same_producers"] == figures["kept"], f"a kept partition's producer was made anew: {figures}"
        assert figures["kept_total"] == len(figures["kept"]), figures
    else:
        assert not figures["same_producers"], f"a partition kept its producer with the setting off: {figures}"
        assert figures["kept_total"] == 0, figures


def test_a_leave_hands_the_partitions_back_with_nothing_redone(stack, qwen35_model):
    """The second worker leaves while the first is stuck with work on the partitions it kept: the first keeps
    them through the leave too (their producers and work stay), takes the leaver's partitions afresh (settled
    from the leaver's commits), and every request is answered once."""
    settings = stack.settings(max_batch_rows=1, linger_ms=0, commit_interval_ms=100, rebalance_keep_partitions=True)
    warm = [{"id": f"warm-{n}", "state": f"warm {n}", "questions": {"noul": Q_NOUL}} for n in range(8)]
    stuck = [{"id": f"stuck-{n}", "state": f"stuck {n}", "questions": {"noul": Q_NOUL}} for n in range(8)]
    ids = {r["id"] for r in warm + stuck}
    gated = GatedModel(qwen35_model)

    async def scenario() -> tuple[dict[str, Any], Any]:
        bootstrap = stack.broker.bootstrap_servers
        first, second = Service(settings, gated), Service(settings, qwen35_model)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(first.run())
            joining = asyncio.create_task(second.run())
            try:
                await reader.wait(lambda: all(assigned_and_ready(s) and not s.loop.settling for s in (first, second))
                                  and len(first.consumer.assignment()) + len(second.consumer.assignment()) == 4,
                                  90, task, joining, what="two workers sharing the partitions")
                gated.gate.set()
                await produce(bootstrap, stack.requests, [record(r) for r in warm])
                await reader.wait_ids({r["id"] for r in warm}, 60, task, joining)
                gated.gate.clear()  # the first worker's next passes wait: its work stays in flight
                held = set(first.consumer.assignment())
                before = dict(first.delivery.producers)
                await produce(bootstrap, stack.requests, [record(r) for r in stuck])
                await reader.wait(lambda: first.in_flight.requests > 0, 30, task, what="work stuck at the first")
                await stop(second, joining)
                await reader.wait(lambda: len(first.consumer.assignment()) == 4 and not first.loop.settling, 60,
                                  task, what="every partition back at the first worker")
                figures = {
                    "held": held,
                    "same_producers": {tp for tp in held if first.delivery.producers.get(tp) is before[tp]},
                    "abandoned": _sample(first, "d3stream_revoked_requests_abandoned_total"),
                }
                gated.gate.set()
                await reader.wait_ids(ids, 60, task)
                await asyncio.sleep(1.0)
            finally:
                gated.gate.set()
                first.stop()
                second.stop()
                await asyncio.wait_for(asyncio.gather(task, joining, return_exceptions=True), 90)
            await reader.caught_up()
            return figures, reader.counts()

    figures, counts = run(scenario())
    assert set(counts) == ids, f"unanswered: {sorted(ids - set(counts))}"
    assert all(count == 1 for count in counts.values()), f"answered twice: {counts}"
    assert figures["held"] and figures["same_producers"] == figures["held"], figures
    assert figures["abandoned"] == 0, f"the first worker let work go although none of its partitions moved: {figures}"
