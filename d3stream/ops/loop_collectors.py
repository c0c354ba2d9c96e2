"""Lock-free labelled histograms and counters, for series fed on the event loop thread.

The per-request series (stage latencies, answers, cost; ``series.RequestSeries``) are observed once or more
per request, too often for prometheus_client's locked ``Histogram`` and ``Counter`` (see ``LoopHistogram``).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class LoopHistogram(Collector):
    """A labelled histogram for measurements made once or more per request on the event loop thread.

    prometheus_client's ``Histogram`` takes a lock for the bucket and again for the sum of every observation;
    at several observations per request that was a tenth of the Kafka path's CPU (bench/README.md). Here an
    observation is a bisection and two additions; the scrape (another thread) reads a snapshot, so a scrape
    may see a count one observation ahead of its sum, never a wrong total."""

    def __init__(self, name: str, documentation: str, label: str, values: Iterable[str],
                 buckets: Iterable[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = list(buckets)
        self.counts = {value: [0] * (len(self.bounds) + 1) for value in values}  # the last: above every bound
        self.sums = dict.fromkeys(self.counts, 0.0)
        registry.register(self)

    def observe(self, value: str, amount: float, count: int = 1) -> None:
        """``count`` observations of ``amount`` (several requests that spent the same time, e.g. in one pass)."""
        counts = self.counts.get(value)
        if counts is None:
            raise ValueError(f"unknown {self.label} {value!r}; one of {', '.join(self.counts)}")
        counts[bisect_left(self.bounds, amount)] += count  # the first bound at or above it: le="bound"
        self.sums[value] += amount * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, counts in self.counts.items():
            snapshot, total, cumulative = list(counts), self.sums[value], 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip([*self.bounds, math.inf], snapshot, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([value], buckets, sum_value=total)
        yield family


class LoopCounter(Collector):
    """A labelled counter incremented on the event loop thread, without a lock per increment (see
    ``LoopHistogram``); a new label set is a dictionary entry."""

    def __init__(self, name: str, documentation: str, labels: Iterable[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self.totals: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.totals[labels] = self.totals.get(labels, 0.0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, total in list(self.totals.items()):
            family.add_metric(list(labels), total)
        yield family
