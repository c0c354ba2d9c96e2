"""Tenant quotas (``tenant_max_inflight_tokens``, d3stream/core/quotas.py; docs/SCHEDULING.md) on their own: a
tenant over its quota is held and goes on as its tokens come back. On the broker: tests/integration/test_quotas.py."""

from __future__ import annotations

import asyncio

import pytest

from d3stream.core.quotas import TenantQuotas
from d3stream.core.seams import InFlight
from tests.support.stream_helpers import run

pytestmark = pytest.mark.timeout(300)


def test_a_tenant_over_its_quota_is_held_and_goes_on_as_its_tokens_come_back():
    async def scenario() -> None:
        in_flight = InFlight()
        quotas = TenantQuotas(100, in_flight)
        assert quotas.try_take("a", 60) and quotas.try_take("a", 40)
        assert not quotas.try_take("a", 10), "at its limit: held"
        assert quotas.try_take("b", 500), "another tenant is not held; one request always goes (soft by one)"
        held = asyncio.create_task(quotas.take("a", 10, ("req", 0)))
        await asyncio.sleep(0)
        assert quotas.held_partitions() == {("req", 0)} and quotas.held_tenants() == 1
        assert in_flight.held_requests == 1 and in_flight.held_tokens == 10
        assert not quotas.try_take("a", 1), "no overtaking a held request"
        quotas.give_back("a", 40)
        await asyncio.wait_for(held, 5)
        assert quotas.tokens_of("a") == 70 and quotas.held_partitions() == set() and in_flight.held_requests == 0
        assert TenantQuotas(0, in_flight).try_take("a", 10**9), "0 turns the limit off"

    run(scenario())
