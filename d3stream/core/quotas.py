"""Per-tenant in-flight token limits (``tenant_max_inflight_tokens``): one tenant's flood cannot take the
whole worker (docs/SCHEDULING.md, "Tenant quotas").

A request's prompt tokens are known once it is prepared. Before its rows go to the scheduler it *takes*
them from its tenant's quota; if the tenant already has ``limit`` tokens or more in flight, the request is
**held** (prepared, not yet scheduled) until the tenant's answered requests give enough back. While any
request of a partition is held, the consume loop pauses that partition (``held_partitions``), so no more of
its records are read; other partitions keep flowing. Nothing else changes: a held record is an ordinary
in-flight record, uncommitted until it is answered, so exactly-once and the per-partition commit order hold
as they do without quotas (a worker that stops while records are held has simply not answered them yet).

A tenant with nothing in flight always gets its next request through, however large, so a request bigger
than the limit is never held forever; the limit is therefore soft by at most one request. Held requests are
not counted against the worker-wide ``max_inflight_requests`` / ``max_inflight_tokens`` (``InFlight.held_*``):
were they, one tenant's held flood could pause every partition and the quota would isolate nobody. They are
bounded instead by the pause of their partitions: at most what was fetched before the pause took effect.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from d3stream.core.seams import InFlight

# (topic, partition) of a held request's record.
PartitionKey = tuple[str, int]


@dataclass
class _Tenant:
    """One tenant's tokens in flight, and a condition its held requests wait on."""

    tokens: int = 0
    held: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class TenantQuotas:
    """Per-tenant in-flight token accounting and the holding of requests over the limit (0: no limit)."""

    def __init__(self, limit: int, in_flight: InFlight):
        self.limit = limit
        self.in_flight = in_flight
        self._tenants: dict[str, _Tenant] = {}
        self._held_partitions: Counter[PartitionKey] = Counter()
        self.held_total = 0  # requests ever held (a counter for /metrics)

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def _fits(self, tenant: _Tenant, tokens: int) -> bool:
        return tenant.tokens == 0 or tenant.tokens + tokens <= self.limit

    def try_take(self, tenant: str, tokens: int) -> bool:
        """Take ``tokens`` of ``tenant``'s quota if they fit now (always, with the limit off)."""
        if not self.enabled:
            return True
        state = self._tenants.setdefault(tenant, _Tenant())
        if state.held or not self._fits(state, tokens):  # held ones go first: no overtaking
            return False
        state.tokens += tokens
        return True

    async def take(self, tenant: str, tokens: int, partition: PartitionKey) -> None:
        """Hold until ``tokens`` fit in ``tenant``'s quota, then take them. While held, ``partition`` is
        reported by ``held_partitions`` (the consume loop pauses it)."""
        state = self._tenants.setdefault(tenant, _Tenant())
        state.held += 1
        self._held_partitions[partition] += 1
        self.in_flight.held_requests += 1
        self.in_flight.held_tokens += tokens
        self.held_total += 1
        try:
            async with state.changed:
                await state.changed.wait_for(lambda: self._fits(state, tokens))
                state.tokens += tokens
        finally:
            state.held -= 1
            self._held_partitions[partition] -= 1
            if not self._held_partitions[partition]:
                del self._held_partitions[partition]
            self.in_flight.held_requests -= 1
            self.in_flight.held_tokens -= tokens

    def give_back(self, tenant: str, tokens: int) -> None:
        """An answered request's tokens return to its tenant's quota; its held requests look again."""
        state = self._tenants.get(tenant)
        if state is None or not tokens:
            return
        state.tokens -= tokens
        if state.held:
            asyncio.get_running_loop().create_task(self._wake(state))
        elif state.tokens == 0:
            del self._tenants[tenant]  # tenant names are untrusted: keep no state for idle ones

    @staticmethod
    async def _wake(state: _Tenant) -> None:
        async with state.changed:
            state.changed.notify_all()

    def held_partitions(self) -> set[PartitionKey]:
        """Partitions with a request held now: the consume loop keeps them paused."""
        return set(self._held_partitions)

    def held_tenants(self) -> int:
        """How many tenants are over their limit with requests held."""
        return sum(1 for state in self._tenants.values() if state.held)

    def tokens_of(self, tenant: str) -> int:
        """``tenant``'s tokens in flight (taken, not yet given back)."""
        state = self._tenants.get(tenant)
        return state.tokens if state is not None else 0
