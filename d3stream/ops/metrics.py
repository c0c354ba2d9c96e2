"""Prometheus metrics and the health endpoints of a worker.

``Metrics`` owns its own ``CollectorRegistry`` (never the process-wide default, so tests and embedded
workers can hold several) and offers one small typed method per thing the service measures.
``MetricsServer`` serves it over HTTP from a daemon thread, beside the probes Kubernetes uses:

    GET /metrics   the Prometheus text exposition of the registry (also at ``/``)
    GET /healthz   200 while the process is alive and its HTTP thread answers (liveness)
    GET /readyz    200 when the readiness check returns True, else 503 (readiness)

Ready means: the model is loaded (and warmed up, when asked), the consumer has joined its group, and no
partition's committed offset has stood still with work waiting for ``stall_unready_s``.
A worker that is loading, warming up, rebalancing out or shutting down answers 503 on ``/readyz`` but
200 on ``/healthz``, so Kubernetes waits for it instead of restarting it.

    metrics = Metrics(ready=lambda: service.ready)
    server = MetricsServer(metrics, host=settings.metrics_host, port=settings.metrics_port)
    server.start()           # port 0 picks a free port; server.port tells which
    ...
    server.stop()

Every metric is named ``d3stream_*``; the docstrings (and the HELP lines Prometheus shows) say what
each one means for an operator. All methods are thread-safe: they may be called from the event loop,
the model thread or the S3 threads.
"""

from __future__ import annotations

import math
import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from d3stream import __version__

log = structlog.get_logger(__name__)

PREFIX = "d3stream"
# Tenants are named by requests (untrusted): a bounded number get series of their own.
MAX_TENANT_LABELS = 100
OTHER_TENANT = "_other"

# What a rollout did with a changed model source pointer (d3stream_model_swaps_total's outcome label).
SWAP_OUTCOMES = ("swapped", "canary", "refused_verification", "refused_memory", "refused_warmup", "refused_pointer")

STAGES = ("fetch", "decode", "prepare", "queued", "forward", "publish", "end_to_end")
"""Stages a request walks, as ``observe_stage`` takes them (``queued``: waiting for a forward pass)."""

ERROR_CODES = (
    "undecodable_event",
    "invalid_request",
    "model_not_served",
    "media_not_allowed",
    "media_missing",
    "media_too_large",
    "media_unreadable",
    "media_unavailable",
    "internal_error",
)
"""Request-level error codes of the answer contract (README); pre-created so rates start at zero."""

# Seconds: from a cache-hot inline image (~1 ms) to a slow S3 video plus a long forward pass (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PASS_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _PassLike(Protocol):
    @property
    def rows(self) -> int: ...
    @property
    def real_tokens(self) -> int: ...
    @property
    def padded_tokens(self) -> int: ...
    @property
    def seconds(self) -> float: ...


class LoopHistogram(Collector):
    """A labelled histogram for measurements made once or more per request on the event loop thread.

    prometheus_client's ``Histogram`` takes a lock for the bucket and again for the sum of every observation;
    at several observations per request that was a tenth of the Kafka path's CPU (bench/README.md). Here an
    observation is a bisection and two additions; the scrape (another thread) reads a snapshot, so a scrape
    may see a count one observation ahead of its sum, never a wrong total."""

    def __init__(self, name: str, documentation: str, label: str, values: Iterable[str],
                 buckets: Iterable[float], registry: CollectorRegistry):
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
            buckets = []
            for bound, count in zip([*self.bounds, math.inf], snapshot, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([value], buckets, sum_value=total)
        yield family


class LoopCounter(Collector):
    """A labelled counter incremented on the event loop thread, without a lock per increment (see
    ``LoopHistogram``); a new label set is a dictionary entry."""

    def __init__(self, name: str, documentation: str, labels: Iterable[str], registry: CollectorRegistry):
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


class Metrics:
    """The worker's metrics on a private registry, with one method per measurement the service makes."""

    def __init__(
        self, *, registry: CollectorRegistry | None = None, ready: Callable[[], bool] | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._ready_check: Callable[[], bool] = ready or (lambda: False)
        r = self.registry

        # ---- Kafka consumption
        self.consumer_lag = Gauge(
            f"{PREFIX}_consumer_lag",
            "Records in a partition this worker owns after its committed offset (last stable offset minus "
            "committed offset): records read but not yet answered and committed count too, so it stays above 0 "
            "while work waits. The lag the group shows on the broker (what KEDA scales on). Growing on every "
            "partition: workers are too slow, add replicas; growing on one: a hot or stuck partition.",
            ["topic", "partition"],
            registry=r,
        )
        self.read_lag = Gauge(
            f"{PREFIX}_consumer_read_lag",
            "Records in a partition this worker owns that it has not read yet (last stable offset minus its "
            "read position): 0 once records are fetched, answered or not (compare d3stream_consumer_lag).",
            ["topic", "partition"],
            registry=r,
        )
        self.oldest_unanswered = Gauge(
            f"{PREFIX}_oldest_unanswered_seconds",
            "Age of the oldest request of a partition that was read and is not answered yet (0: none). Growing "
            "without bound: a request is stuck (a hung pass, a media fetch that never returns).",
            ["topic", "partition"],
            registry=r,
        )
        self.commit_stalled = Gauge(
            f"{PREFIX}_commit_stalled_seconds",
            "Seconds since a partition's committed offset last moved while it had work (0: nothing waiting). "
            "/readyz fails once it passes stall_unready_s.",
            ["topic", "partition"],
            registry=r,
        )
        # ---- consumer group
        self.rebalances = Counter(
            f"{PREFIX}_rebalances",
            "Group generations this worker joined (one per rebalance it took part in). A steady rate over "
            "minutes with no deployment going on is a rebalance storm: see rebalance_timeout_ms.",
            registry=r,
        )
        self.partitions_assigned_total = Counter(
            f"{PREFIX}_partitions_assigned",
            "Partitions handed to this worker by rebalances.",
            registry=r,
        )
        self.partitions_revoked_total = Counter(
            f"{PREFIX}_partitions_revoked",
            "Partitions taken from this worker by rebalances.",
            registry=r,
        )
        self.revoked_abandoned = Counter(
            f"{PREFIX}_revoked_requests_abandoned",
            "Requests of revoked partitions not answered within rebalance_drain_s: never committed by this "
            "worker (exactly_once), the partition's new owner answers them.",
            registry=r,
        )
        self.generation = Gauge(
            f"{PREFIX}_group_generation",
            "The consumer group generation of this worker's current assignment (moves on every rebalance).",
            registry=r,
        )
        self.partitions_owned = Gauge(
            f"{PREFIX}_partitions_owned",
            "Partitions this worker owns now; over all workers of a settled group, the topic's partition count.",
            registry=r,
        )
        self.requests_in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "Requests read from Kafka and not answered yet. At max_inflight_requests the worker pauses "
            "its partitions (backpressure).",
            registry=r,
        )
        self.questions_in_flight = Gauge(
            f"{PREFIX}_questions_in_flight",
            "Questions of the in-flight requests (each becomes one prompt row in a forward pass).",
            registry=r,
        )
        self.tokens_in_flight = Gauge(
            f"{PREFIX}_tokens_in_flight",
            "Prompt tokens of the in-flight requests; at max_inflight_tokens partitions are paused.",
            registry=r,
        )
        self.paused = Gauge(
            f"{PREFIX}_partitions_paused",
            "1 while backpressure has paused the assigned partitions (in-flight work at its limit), else 0. "
            "Paused most of the time: the device is the bottleneck, add replicas or GPUs.",
            registry=r,
        )
        self.tenants_held = Gauge(
            f"{PREFIX}_tenants_held",
            "Tenants over tenant_max_inflight_tokens with requests held (their partitions paused).",
            registry=r,
        )
        self.quota_held_requests = Gauge(
            f"{PREFIX}_quota_held_requests", "Requests read and held by their tenant's quota.", registry=r,
        )
        self.quota_paused_partitions = Gauge(
            f"{PREFIX}_quota_paused_partitions",
            "Partitions paused because a request of theirs is held by its tenant's quota.",
            registry=r,
        )
        self.quota_held_total = Counter(
            f"{PREFIX}_quota_held", "Requests held by their tenant's quota before they could be scheduled.",
            registry=r,
        )
        self._quota_held_counted = 0
        # ---- forward passes
        self.pass_rows = Histogram(
            f"{PREFIX}_pass_rows",
            "Prompt rows (questions, possibly from many requests) per forward pass. Mostly 1: the "
            "stream is sparse or linger_ms too short; always max_batch_rows: the device is saturated.",
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.pass_real_tokens = Histogram(
            f"{PREFIX}_pass_real_tokens",
            "Prompt tokens (without padding) per forward pass. rate(d3stream_pass_real_tokens_sum) / "
            "rate(d3stream_pass_padded_tokens_sum) is the padding efficiency.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.pass_padded_tokens = Histogram(
            f"{PREFIX}_pass_padded_tokens",
            "Padded tokens (rows x longest prompt) per forward pass, what the device computed; compare "
            "with max_batch_tokens.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.pass_seconds = Histogram(
            f"{PREFIX}_pass_seconds",
            "Device time of one forward pass (_count: passes run).",
            buckets=PASS_SECONDS_BUCKETS,
            registry=r,
        )
        self.last_pass_rows = Gauge(f"{PREFIX}_last_pass_rows", "Rows of the most recent forward pass.", registry=r)
        self.last_pass_real_tokens = Gauge(
            f"{PREFIX}_last_pass_real_tokens", "Real (unpadded) prompt tokens of the most recent pass.", registry=r
        )
        self.last_pass_padded_tokens = Gauge(
            f"{PREFIX}_last_pass_padded_tokens", "Padded tokens of the most recent forward pass.", registry=r
        )
        self.last_pass_seconds = Gauge(
            f"{PREFIX}_last_pass_seconds", "Device time of the most recent forward pass.", registry=r
        )
        # ---- latency
        self.stage_seconds = LoopHistogram(
            f"{PREFIX}_stage_seconds",
            "Time a request spends in each stage: fetch (media from S3), decode (media bytes to pixels), "
            "prepare (prompts), queued (waiting for a forward pass), forward (its passes), publish (answer "
            "acknowledged by the broker), end_to_end (read to answered).",
            "stage", STAGES, LATENCY_BUCKETS, r,
        )
        # ---- outcomes
        self.answers = LoopCounter(
            f"{PREFIX}_answers",
            "Answer events published, by code: 'ok' for an answered request, else the request's error code "
            "(invalid_request, media_missing, internal_error, ...; see the README's table).",
            ["code"], r,
        )
        # ---- cost (provenance.cost of each answer, summed; docs/SCHEDULING.md)
        self.device_seconds = LoopCounter(
            f"{PREFIX}_device_seconds",
            "Forward-pass device seconds, attributed to requests by their share of each pass's real tokens, by "
            f"tenant and model (at most {MAX_TENANT_LABELS} tenants are named; the rest count as '{OTHER_TENANT}').",
            ["tenant", "model"], r,
        )
        self.tokens = LoopCounter(
            f"{PREFIX}_tokens",
            "Tokens answered requests used, by tenant, model and kind: 'prompt' (their prompts' tokens) or "
            "'padded' (the padded grid of the passes they rode in).",
            ["tenant", "model", "kind"], r,
        )
        self._tenants: set[str] = set()
        # The cost series' label sets of each (tenant, model) seen: built once, not per answered request.
        self._cost_labels: dict[tuple[str, str], tuple[tuple[str, ...], ...]] = {}
        self.dead_letters = Counter(
            f"{PREFIX}_dead_letters",
            "Records that were not even a JSON object, copied to the dead-letter topic. Any rate here "
            "means a producer is publishing garbage.",
            registry=r,
        )
        self.publish_retries = Counter(
            f"{PREFIX}_publish_retries",
            "Sends to Kafka that failed and were retried with backoff (broker outage, leader election); with "
            "exactly_once, a partition's transaction retried, under the topic it publishes to.",
            ["topic"],
            registry=r,
        )
        # ---- media
        self.media_bytes = Counter(
            f"{PREFIX}_media_fetched_bytes",
            "Bytes of media read from object storage (inline data: URLs excluded).",
            registry=r,
        )
        self.media_cache = Counter(
            f"{PREFIX}_media_cache_lookups",
            "Media cache lookups by result (hit, miss); hit / (hit + miss) is the cache hit ratio.",
            ["result"],
            registry=r,
        )
        # ---- shared-prefix reuse
        self.prefix_requests = Counter(
            f"{PREFIX}_prefix_requests",
            "Requests with two or more questions by how they ran: 'shared' (the prompt prefix once, each "
            "question's tail on its cached state) or the reason they ran as full prompts (disabled, "
            "tokenization_boundary, ...).",
            ["path"],
            registry=r,
        )
        self.prefix_checks = Counter(
            f"{PREFIX}_prefix_checks",
            "Exact-replay checks of prefix reuse (every prefix_verify_every-th question also run from its "
            "full prompt), by result; one 'failed' turns reuse off for the worker's lifetime.",
            ["result"],
            registry=r,
        )
        self.prefix_max_abs_dp = Gauge(
            f"{PREFIX}_prefix_max_abs_dp",
            "Largest |dp| between a prefix-reuse answer and its full-prompt replay so far (prefix_tolerance "
            "is the limit).",
            registry=r,
        )
        # ---- shadow evaluation (shadow.py): the live answer and the shadow's, per model pair and question type
        pair = ["live", "shadow"]
        self.shadow_requests = Counter(
            f"{PREFIX}_shadow_requests",
            "Requests the shadow model also answered (outcome answered), or whose shadow answer is an error "
            "(outcome errored: the live answer is unaffected).",
            [*pair, "outcome"],
            registry=r,
        )
        self.shadow_questions = Counter(
            f"{PREFIX}_shadow_questions",
            "Questions answered by both models and compared (outcome compared), or that the shadow answered "
            "with an error while the live model answered them (outcome errored).",
            [*pair, "type", "outcome"],
            registry=r,
        )
        self.shadow_agreements = Counter(
            f"{PREFIX}_shadow_agreements",
            "Compared questions whose top choice (d3stream compare's decision) is the same for both models; "
            "agreement = this / d3stream_shadow_questions{outcome=\"compared\"}.",
            [*pair, "type"],
            registry=r,
        )
        self.shadow_abs_dp = Counter(
            f"{PREFIX}_shadow_abs_dp",
            "Sum of |dp| over every option of the compared questions (live vs shadow probability); mean |dp| = "
            "this / d3stream_shadow_dp_options, as d3stream compare averages it.",
            [*pair, "type"],
            registry=r,
        )
        self.shadow_dp_options = Counter(
            f"{PREFIX}_shadow_dp_options",
            "Options whose |dp| d3stream_shadow_abs_dp sums.",
            [*pair, "type"],
            registry=r,
        )
        self.shadow_max_abs_dp = Gauge(
            f"{PREFIX}_shadow_max_abs_dp",
            "Largest |dp| of any option between the live and the shadow answer since the worker started.",
            [*pair, "type"],
            registry=r,
        )
        self._shadow_max: dict[tuple[str, str, str], float] = {}
        self._shadow_lock = threading.Lock()
        # ---- offsets and transactions
        self.commits = Counter(
            f"{PREFIX}_commits",
            "Successful commits of consumed offsets (with exactly_once delivery: committed transactions).",
            registry=r,
        )
        self.commit_failures = Counter(
            f"{PREFIX}_commit_failures",
            "Offset commits that failed (usually a rebalance in progress); the work is redone by the next "
            "owner of the partition.",
            registry=r,
        )
        self.transaction_aborts = Counter(
            f"{PREFIX}_transaction_aborts",
            "Kafka transactions aborted (exactly_once delivery): their answers are invisible to "
            "read_committed consumers and the requests are served again.",
            registry=r,
        )
        # ---- identity and state
        self.model_info = Info(
            f"{PREFIX}_model",
            "The model this worker serves: name, SHA-256 of its provenance record, torch device.",
            registry=r,
        )
        self.model_swaps = Counter(
            f"{PREFIX}_model_swaps",
            "Changes of a watched model_source pointer acted on (rollout.py), by outcome: swapped (a new default "
            "model serves), canary (the canary or its share changed), refused_verification (manifest, SHA-256 or "
            "format version), refused_memory (it and the served models do not fit), refused_warmup, refused_pointer (unreadable or invalid pointer). A refusal leaves "
            "the served models serving.",
            ["outcome"],
            registry=r,
        )
        self.kernels = Gauge(
            f"{PREFIX}_kernel_info",
            "The implementation bound for each Gated DeltaNet op (1 per op): a kernel package (fla..., "
            "causal_conv1d...) or torch-reference; op=path sums them up as fast, reference, mixed or none.",
            ["op", "implementation"],
            registry=r,
        )
        self.build_info = Info(f"{PREFIX}_build", "The d3stream version of this worker.", registry=r)
        self.build_info.info({"version": __version__})
        self.ready_gauge = Gauge(
            f"{PREFIX}_ready",
            "1 when the worker is ready (model loaded and warmed up, consumer joined), else 0; what "
            "/readyz answers.",
            registry=r,
        )
        self.ready_gauge.set_function(lambda: 1.0 if self.is_ready() else 0.0)

        for code in ("ok", *ERROR_CODES):  # so that rates start at zero
            self.answers.inc((code,), 0)
        for result in ("hit", "miss"):
            self.media_cache.labels(result=result)
        for result in ("passed", "failed"):
            self.prefix_checks.labels(result=result)
        for outcome in SWAP_OUTCOMES:
            self.model_swaps.labels(outcome=outcome)

    # ------------------------------------------------------------------------------- readiness

    def set_ready_check(self, check: Callable[[], bool]) -> None:
        """Replace the readiness check (e.g. once the Service object exists)."""
        self._ready_check = check

    def is_ready(self) -> bool:
        """What ``/readyz`` answers; a check that raises counts as not ready."""
        try:
            return bool(self._ready_check())
        except Exception:  # noqa: BLE001 - a broken check must not break the probe thread
            log.warning("readiness check failed", exc_info=True)
            return False

    # -------------------------------------------------------------------------------- consumer

    def set_read_lag(self, topic: str, partition: int, lag: int) -> None:
        """Records of ``topic``/``partition`` after this worker's read position."""
        self.read_lag.labels(topic=topic, partition=str(partition)).set(max(0, lag))

    def set_partition_progress(
        self, topic: str, partition: int, *, committed_lag: int, oldest_unanswered_s: float, stalled_s: float
    ) -> None:
        """Where a partition's committed work stands: lag behind the committed offset, the age of its oldest
        unanswered request, and how long its committed offset has not moved although it has work."""
        labels = {"topic": topic, "partition": str(partition)}
        self.consumer_lag.labels(**labels).set(max(0, committed_lag))
        self.oldest_unanswered.labels(**labels).set(max(0.0, oldest_unanswered_s))
        self.commit_stalled.labels(**labels).set(max(0.0, stalled_s))

    def forget_partitions(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Drop the per-partition series of partitions this worker no longer owns (call on revocation)."""
        for topic, partition in partitions:
            for gauge in (self.consumer_lag, self.read_lag, self.oldest_unanswered, self.commit_stalled):
                try:
                    gauge.remove(topic, str(partition))
                except KeyError:
                    pass

    def count_rebalance(self, generation: int | None, assigned: int, owned: int) -> None:
        """A rebalance this worker took part in: ``assigned`` partitions it received, ``owned`` it holds now."""
        self.rebalances.inc()
        self.partitions_assigned_total.inc(assigned)
        self.partitions_owned.set(owned)
        if generation is not None:
            self.generation.set(generation)

    def count_revoked(self, revoked: int, abandoned: int) -> None:
        """Partitions taken away, and the requests of theirs left unanswered when the drain ended."""
        self.partitions_revoked_total.inc(revoked)
        self.revoked_abandoned.inc(abandoned)

    def set_in_flight(self, requests: int, questions: int, tokens: int = 0) -> None:
        """Requests, their questions and their prompt tokens that are read but not answered yet."""
        self.requests_in_flight.set(requests)
        self.questions_in_flight.set(questions)
        self.tokens_in_flight.set(tokens)

    def set_paused(self, paused: bool) -> None:
        """Whether backpressure has paused the assigned partitions."""
        self.paused.set(1 if paused else 0)

    def set_quota_held(self, tenants: int, requests: int, partitions: int, held_total: int) -> None:
        """Tenant quotas now: tenants over their limit, their held requests and paused partitions; and how
        many requests were ever held (``held_total``, monotonic)."""
        self.tenants_held.set(tenants)
        self.quota_held_requests.set(requests)
        self.quota_paused_partitions.set(partitions)
        if held_total > self._quota_held_counted:
            self.quota_held_total.inc(held_total - self._quota_held_counted)
            self._quota_held_counted = held_total

    # ---------------------------------------------------------------------------------- passes

    def observe_pass(self, rows: int, real_tokens: int, padded_tokens: int, seconds: float) -> None:
        """One forward pass: call once per pass (not once per request that rode in it)."""
        self.pass_rows.observe(rows)
        self.pass_real_tokens.observe(real_tokens)
        self.pass_padded_tokens.observe(padded_tokens)
        self.pass_seconds.observe(seconds)
        self.last_pass_rows.set(rows)
        self.last_pass_real_tokens.set(real_tokens)
        self.last_pass_padded_tokens.set(padded_tokens)
        self.last_pass_seconds.set(seconds)

    def observe_pass_record(self, record: _PassLike) -> None:
        """``observe_pass`` from a ``batching.PassRecord`` (usable directly as a per-pass callback)."""
        self.observe_pass(record.rows, record.real_tokens, record.padded_tokens, record.seconds)

    # --------------------------------------------------------------------------------- latency

    def observe_stage(self, stage: str, seconds: float, requests: int = 1) -> None:
        """Seconds one request (or each of ``requests``) spent in ``stage`` (one of ``STAGES``)."""
        self.stage_seconds.observe(stage, seconds if seconds > 0.0 else 0.0, requests)

    # -------------------------------------------------------------------------------- outcomes

    def count_answer(self, code: str | None, answers: int = 1) -> None:
        """One answer event published (or ``answers`` of them): ``None`` (or "ok") when answered, else the
        request's error code."""
        self.answers.inc((code or "ok",), answers)  # a code outside the documented table still counts

    def count_cost(self, tenant: str, model: str, device_seconds: float, prompt_tokens: int,
                   padded_tokens: int) -> None:
        """What one answered request cost, under its tenant (request fields are untrusted: only the first
        ``MAX_TENANT_LABELS`` tenants get a series of their own)."""
        labels = self._cost_labels.get((tenant, model))
        if labels is None:
            if tenant not in self._tenants:
                if len(self._tenants) >= MAX_TENANT_LABELS:
                    tenant = OTHER_TENANT
                else:
                    self._tenants.add(tenant)
            labels = ((tenant, model), (tenant, model, "prompt"), (tenant, model, "padded"))
            if len(self._cost_labels) < 4 * MAX_TENANT_LABELS:  # bounded: tenants past the limit are looked up
                self._cost_labels[(tenant, model)] = labels
        seconds, prompt, padded = labels
        self.device_seconds.inc(seconds, device_seconds)
        self.tokens.inc(prompt, prompt_tokens)
        self.tokens.inc(padded, padded_tokens)

    def count_shadow_request(self, live: str, shadow: str, *, errored: bool) -> None:
        """One request the shadow also answered (``errored``: its shadow answer is an error answer)."""
        self.shadow_requests.labels(live=live, shadow=shadow, outcome="errored" if errored else "answered").inc()

    def count_shadow_question(self, live: str, shadow: str, kind: str, *, agree: bool | None,
                              abs_dps: Iterable[float] = ()) -> None:
        """One question of a shadowed request: compared (``agree`` and every option's |dp|), or, with
        ``agree`` None, answered by the live model and not by the shadow."""
        if agree is None:
            self.shadow_questions.labels(live=live, shadow=shadow, type=kind, outcome="errored").inc()
            return
        self.shadow_questions.labels(live=live, shadow=shadow, type=kind, outcome="compared").inc()
        # The agreement series exists from the first compared question, at 0 when it disagreed: a shadow that
        # never agrees then reads as agreement 0, not as no data (the alert divides by it).
        self.shadow_agreements.labels(live=live, shadow=shadow, type=kind).inc(1 if agree else 0)
        deltas = list(abs_dps)
        self.shadow_abs_dp.labels(live=live, shadow=shadow, type=kind).inc(sum(deltas))
        self.shadow_dp_options.labels(live=live, shadow=shadow, type=kind).inc(len(deltas))
        largest = max(deltas, default=0.0)
        with self._shadow_lock:
            key = (live, shadow, kind)
            if largest >= self._shadow_max.get(key, -1.0):
                self._shadow_max[key] = largest
                self.shadow_max_abs_dp.labels(live=live, shadow=shadow, type=kind).set(largest)

    def count_dead_letter(self) -> None:
        self.dead_letters.inc()

    def count_publish_retry(self, topic: str) -> None:
        self.publish_retries.labels(topic=topic).inc()

    # ----------------------------------------------------------------------------------- media

    def add_media_bytes(self, nbytes: int) -> None:
        """Bytes of one object read from object storage."""
        if nbytes > 0:
            self.media_bytes.inc(nbytes)

    def count_media_cache(self, hit: bool) -> None:
        """One media cache lookup."""
        self.media_cache.labels(result="hit" if hit else "miss").inc()

    # ------------------------------------------------------------------------- prefix reuse

    def count_prefix_request(self, path: str) -> None:
        """A multi-question request ran on a shared prefix (``shared``) or as full prompts (the reason)."""
        self.prefix_requests.labels(path=path).inc()

    def observe_prefix_check(self, passed: bool, max_abs_dp: float) -> None:
        """One exact-replay check of prefix reuse, and the largest |dp| of all checks so far."""
        self.prefix_checks.labels(result="passed" if passed else "failed").inc()
        self.prefix_max_abs_dp.set(max_abs_dp)

    # ------------------------------------------------------------------------------ offsets

    def count_commit(self, ok: bool = True) -> None:
        """One offset commit (or committed transaction), or with ``ok=False`` one that failed."""
        (self.commits if ok else self.commit_failures).inc()

    def count_transaction_abort(self) -> None:
        self.transaction_aborts.inc()

    # -------------------------------------------------------------------------------- identity

    def set_model(self, name: str, provenance_sha256: str, device: str) -> None:
        """The model being served (``d3stream_model_info``)."""
        self.model_info.info({"name": str(name), "provenance_sha256": str(provenance_sha256), "device": str(device)})

    def count_model_swap(self, outcome: str) -> None:
        """A model source pointer acted on: one of ``SWAP_OUTCOMES``."""
        self.model_swaps.labels(outcome=outcome).inc()

    def set_kernels(self, kernels: dict[str, str]) -> None:
        """The Gated DeltaNet kernels of the served model (``D3.kernel_record()``: op -> implementation),
        one ``d3stream_kernel_info`` series per op; a later call replaces the earlier series."""
        self.kernels.clear()
        for op, implementation in kernels.items():
            self.kernels.labels(op=str(op), implementation=str(implementation)).set(1)


# ------------------------------------------------------------------------------------ HTTP server


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape never keeps the process alive
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # probes every few seconds would flood the logs


def _plain(start_response: Callable, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
    return [data]


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port``, served from a daemon thread."""

    def __init__(self, metrics: Metrics, *, host: str = "127.0.0.1", port: int = 9464) -> None:
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self._prometheus = make_wsgi_app(metrics.registry)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def app(self, environ: dict[str, Any], start_response: Callable) -> list[bytes]:
        """The WSGI application (usable on its own, e.g. in tests)."""
        path = environ.get("PATH_INFO") or "/"
        if path == "/healthz":
            return _plain(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            if self.metrics.is_ready():
                return _plain(start_response, "200 OK", "ready\n")
            return _plain(start_response, "503 Service Unavailable", "not ready\n")
        if path in ("/metrics", "/"):
            return self._prometheus(environ, start_response)
        return _plain(start_response, "404 Not Found", "not found: try /metrics, /healthz or /readyz\n")

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for); only after ``start()``."""
        if self._httpd is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Where a client on this machine reaches it (the loopback address for a wildcard host)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port. OSError when the port is taken."""
        if self._httpd is not None:
            return self.port

        class Server(_ThreadingWSGIServer):
            pass

        infos = socket.getaddrinfo(self.host or None, self.requested_port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        Server.address_family = infos[0][0]
        try:
            self._httpd = make_server(self.host, self.requested_port, self.app, Server, handler_class=_QuietHandler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {self.host}:{self.requested_port}: {exc.strerror}") \
                from exc
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="d3stream-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics endpoint listening", host=self.host, port=self.port)
        return self.port

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_metrics(metrics: Metrics, settings: Any) -> MetricsServer | None:
    """Start the endpoint the settings ask for (``metrics_host``/``metrics_port``); None when the port is unset."""
    port = getattr(settings, "metrics_port", None)
    if port is None:
        return None
    server = MetricsServer(metrics, host=getattr(settings, "metrics_host", "127.0.0.1"), port=int(port))
    server.start()
    return server
