"""The worker's metric families, declared in groups, each with the methods that feed it.

Each group is a mixin of ``metrics.Metrics``: its ``__init__`` registers its families on the worker's registry
(one declaration per family: name, HELP text, labels, buckets), and its methods are the measurements the
service makes of that part of the worker. Families and the methods that write them sit side by side, so a
change to one shows the other; ``Metrics`` is the groups on one registry, plus readiness.

    PartitionSeries   per-partition progress: lag, oldest unanswered request, stalled commits
    GroupSeries       consumer group membership: rebalances, partitions assigned, revoked, owned
    FlowSeries        in-flight work, backpressure and tenant quotas
    PassSeries        forward passes: rows, tokens, device time
    RequestSeries     per request, fed on the event loop without locks: stage latencies, answers, cost
    DeliverySeries    Kafka delivery: dead letters, records failed, publish retries, offset commits, transactions
    InputSeries       media fetched and cached, shared-prefix reuse
    ShadowSeries      shadow evaluation: live against shadow answers
    ModelSeries       what the worker serves: model, model swaps (rollout), kernels, version

Every family is named ``d3stream_*``; the HELP texts say what each one means for an operator. Methods are
thread-safe unless a group says otherwise (``RequestSeries``: the event loop thread only).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from d3stream import __version__
from d3stream.ops.loop_collectors import LoopCounter, LoopHistogram

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
    "schema_not_found",
    "invalid_request",
    "model_not_served",
    "media_not_allowed",
    "media_missing",
    "media_too_large",
    "media_unreadable",
    "media_unavailable",
    "internal_error",
)
"""Request-level error codes of the answer contract (docs/EVENTS.md); pre-created so rates start at zero."""

# Seconds: from a cache-hot inline image (~1 ms) to a slow S3 video plus a long forward pass (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PASS_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

_PARTITION = ["topic", "partition"]  # the labels of every per-partition series
_PAIR = ["live", "shadow"]  # the labels naming the two models of a shadow comparison


class PassLike(Protocol):
    """What ``observe_pass_record`` reads of a pass (``batching.PassRecord`` is one)."""

    @property
    def rows(self) -> int: ...
    @property
    def real_tokens(self) -> int: ...
    @property
    def padded_tokens(self) -> int: ...
    @property
    def seconds(self) -> float: ...


class PartitionSeries:
    """Where each partition this worker owns stands: records not yet read, not yet committed, the oldest
    unanswered request, how long its committed offset has not moved."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.consumer_lag = Gauge(
            f"{PREFIX}_consumer_lag",
            "Records in a partition this worker owns after its committed offset (last stable offset minus "
            "committed offset): records read but not yet answered and committed count too, so it stays above 0 "
            "while work waits. The lag the group shows on the broker (what KEDA scales on). Growing on every "
            "partition: workers are too slow, add replicas; growing on one: a hot or stuck partition.",
            _PARTITION,
            registry=registry,
        )
        self.read_lag = Gauge(
            f"{PREFIX}_consumer_read_lag",
            "Records in a partition this worker owns that it has not read yet (last stable offset minus its "
            "read position): 0 once records are fetched, answered or not (compare d3stream_consumer_lag).",
            _PARTITION,
            registry=registry,
        )
        self.oldest_unanswered = Gauge(
            f"{PREFIX}_oldest_unanswered_seconds",
            "Age of the oldest request of a partition that was read and is not answered yet (0: none). Growing "
            "without bound: a request is stuck (a hung pass, a media fetch that never returns).",
            _PARTITION,
            registry=registry,
        )
        self.commit_stalled = Gauge(
            f"{PREFIX}_commit_stalled_seconds",
            "Seconds since a partition's committed offset last moved while it had work (0: nothing waiting). "
            "/readyz fails once it passes stall_unready_s.",
            _PARTITION,
            registry=registry,
        )

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


class GroupSeries:
    """This worker in its consumer group: the rebalances it took part in and the partitions they moved."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rebalances = Counter(
            f"{PREFIX}_rebalances",
            "Group generations this worker joined (one per rebalance it took part in). A steady rate over "
            "minutes with no deployment going on is a rebalance storm: see rebalance_timeout_ms.",
            registry=registry,
        )
        self.partitions_assigned_total = Counter(
            f"{PREFIX}_partitions_assigned",
            "Partitions handed to this worker by rebalances.",
            registry=registry,
        )
        self.partitions_kept_total = Counter(
            f"{PREFIX}_partitions_kept",
            "Partitions a rebalance revoked and handed straight back, kept with their producer, work and offsets "
            "(rebalance_keep_partitions): what a rebalance cost this worker nothing for.",
            registry=registry,
        )
        self.partitions_revoked_total = Counter(
            f"{PREFIX}_partitions_revoked",
            "Partitions taken from this worker by rebalances.",
            registry=registry,
        )
        self.revoked_abandoned = Counter(
            f"{PREFIX}_revoked_requests_abandoned",
            "Requests of partitions that moved to another worker while they were unanswered (with "
            "rebalance_keep_partitions off, or at_least_once: not answered within rebalance_drain_s): never committed by this "
            "worker (exactly_once), the partition's new owner answers them.",
            registry=registry,
        )
        self.rebalance_paused = Counter(
            f"{PREFIX}_rebalance_paused_seconds",
            "Seconds this worker's partitions stood still for rebalances: from the revocation's start until "
            "every partition of the next assignment is read again (settled). What a rolling restart or a scale "
            "step costs each member.",
            registry=registry,
        )
        self.generation = Gauge(
            f"{PREFIX}_group_generation",
            "The consumer group generation of this worker's current assignment (moves on every rebalance).",
            registry=registry,
        )
        self.partitions_owned = Gauge(
            f"{PREFIX}_partitions_owned",
            "Partitions this worker owns now; over all workers of a settled group, the topic's partition count.",
            registry=registry,
        )

    def count_rebalance(self, generation: int | None, assigned: int, owned: int, kept: int = 0) -> None:
        """A rebalance this worker took part in: ``assigned`` partitions it received (``kept`` of them handed
        back with their work in hand), ``owned`` it holds now."""
        self.rebalances.inc()
        self.partitions_assigned_total.inc(assigned)
        self.partitions_kept_total.inc(kept)
        self.partitions_owned.set(owned)
        if generation is not None:
            self.generation.set(generation)

    def count_rebalance_pause(self, seconds: float) -> None:
        """A rebalance held this worker's partitions for ``seconds`` (revocation to reading again)."""
        self.rebalance_paused.inc(max(0.0, seconds))

    def count_revoked(self, revoked: int, abandoned: int) -> None:
        """Partitions taken away, and the requests of theirs left unanswered when the drain ended."""
        self.partitions_revoked_total.inc(revoked)
        self.revoked_abandoned.inc(abandoned)


class FlowSeries:
    """Work read and not answered yet, and what holds more back: backpressure and tenant quotas."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests_in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "Requests read from Kafka and not answered yet. At max_inflight_requests the worker pauses "
            "its partitions (backpressure).",
            registry=registry,
        )
        self.questions_in_flight = Gauge(
            f"{PREFIX}_questions_in_flight",
            "Questions of the in-flight requests (each becomes one prompt row in a forward pass).",
            registry=registry,
        )
        self.tokens_in_flight = Gauge(
            f"{PREFIX}_tokens_in_flight",
            "Prompt tokens of the in-flight requests; at max_inflight_tokens partitions are paused.",
            registry=registry,
        )
        self.paused = Gauge(
            f"{PREFIX}_partitions_paused",
            "1 while backpressure has paused the assigned partitions (in-flight work at its limit), else 0. "
            "Paused most of the time: the device is the bottleneck, add replicas or GPUs.",
            registry=registry,
        )
        self.tenants_held = Gauge(
            f"{PREFIX}_tenants_held",
            "Tenants over tenant_max_inflight_tokens with requests held (their partitions paused).",
            registry=registry,
        )
        self.quota_held_requests = Gauge(
            f"{PREFIX}_quota_held_requests", "Requests read and held by their tenant's quota.", registry=registry,
        )
        self.quota_paused_partitions = Gauge(
            f"{PREFIX}_quota_paused_partitions",
            "Partitions paused because a request of theirs is held by its tenant's quota.",
            registry=registry,
        )
        self.quota_held_total = Counter(
            f"{PREFIX}_quota_held", "Requests held by their tenant's quota before they could be scheduled.",
            registry=registry,
        )
        self._quota_held_counted = 0  # the caller's monotonic total already added to quota_held_total

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


class PassSeries:
    """Forward passes: how full each one was (rows, real and padded tokens) and its device time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pass_rows = Histogram(
            f"{PREFIX}_pass_rows",
            "Prompt rows (questions, possibly from many requests) per forward pass. Mostly 1: the "
            "stream is sparse or linger_ms too short; always max_batch_rows: the device is saturated.",
            buckets=ROW_BUCKETS,
            registry=registry,
        )
        self.pass_real_tokens = Histogram(
            f"{PREFIX}_pass_real_tokens",
            "Prompt tokens (without padding) per forward pass. rate(d3stream_pass_real_tokens_sum) / "
            "rate(d3stream_pass_padded_tokens_sum) is the padding efficiency.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.pass_padded_tokens = Histogram(
            f"{PREFIX}_pass_padded_tokens",
            "Padded tokens (rows x longest prompt) per forward pass, what the device computed; compare "
            "with max_batch_tokens.",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.pass_seconds = Histogram(
            f"{PREFIX}_pass_seconds",
            "Device time of one forward pass (_count: passes run).",
            buckets=PASS_SECONDS_BUCKETS,
            registry=registry,
        )
        self.last_pass_rows = Gauge(
            f"{PREFIX}_last_pass_rows", "Rows of the most recent forward pass.", registry=registry
        )
        self.last_pass_real_tokens = Gauge(
            f"{PREFIX}_last_pass_real_tokens", "Real (unpadded) prompt tokens of the most recent pass.",
            registry=registry,
        )
        self.last_pass_padded_tokens = Gauge(
            f"{PREFIX}_last_pass_padded_tokens", "Padded tokens of the most recent forward pass.", registry=registry
        )
        self.last_pass_seconds = Gauge(
            f"{PREFIX}_last_pass_seconds", "Device time of the most recent forward pass.", registry=registry
        )

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

    def observe_pass_record(self, record: PassLike) -> None:
        """``observe_pass`` from a ``batching.PassRecord`` (usable directly as a per-pass callback)."""
        self.observe_pass(record.rows, record.real_tokens, record.padded_tokens, record.seconds)


class RequestSeries:
    """Per request: the time spent in each stage, the answer published, and what it cost (provenance.cost of
    each answer, summed; docs/SCHEDULING.md). Observed once or more per request, so these are the lock-free
    ``loop_collectors``: their methods are called on the event loop thread only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.stage_seconds = LoopHistogram(
            f"{PREFIX}_stage_seconds",
            "Time a request spends in each stage: fetch (media from S3), decode (media bytes to pixels), "
            "prepare (prompts), queued (waiting for a forward pass), forward (its passes), publish (answer "
            "acknowledged by the broker), end_to_end (read to answered).",
            "stage", STAGES, LATENCY_BUCKETS, registry,
        )
        self.answers = LoopCounter(
            f"{PREFIX}_answers",
            "Answer events published, by code: 'ok' for an answered request, else the request's error code "
            "(invalid_request, media_missing, internal_error, ...; see docs/EVENTS.md).",
            ["code"], registry,
        )
        self.device_seconds = LoopCounter(
            f"{PREFIX}_device_seconds",
            "Forward-pass device seconds, attributed to requests by their share of each pass's real tokens, by "
            f"tenant and model (at most {MAX_TENANT_LABELS} tenants are named; the rest count as '{OTHER_TENANT}').",
            ["tenant", "model"], registry,
        )
        self.tokens = LoopCounter(
            f"{PREFIX}_tokens",
            "Tokens answered requests used, by tenant, model and kind: 'prompt' (their prompts' tokens) or "
            "'padded' (the padded grid of the passes they rode in).",
            ["tenant", "model", "kind"], registry,
        )
        self._tenants: set[str] = set()
        # The cost series' label sets of each (tenant, model) seen: built once, not per answered request.
        self._cost_labels: dict[tuple[str, str], tuple[tuple[str, ...], ...]] = {}
        for code in ("ok", *ERROR_CODES):  # so that rates start at zero
            self.answers.inc((code,), 0)

    def observe_stage(self, stage: str, seconds: float, requests: int = 1) -> None:
        """Seconds one request (or each of ``requests``) spent in ``stage`` (one of ``STAGES``)."""
        self.stage_seconds.observe(stage, seconds if seconds > 0.0 else 0.0, requests)

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


class DeliverySeries:
    """Kafka delivery: records that could only be dead-lettered (and those the worker failed on), sends retried,
    offsets committed or not, transactions aborted."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.dead_letters = Counter(
            f"{PREFIX}_dead_letters",
            "Records copied to the dead-letter topic: not even a JSON object (any rate here means a producer is "
            "publishing garbage), framed for a schema the registry does not know, or skipped because the worker "
            "failed on them (d3stream_records_failed_total).",
            registry=registry,
        )
        self.records_failed = Counter(
            f"{PREFIX}_records_failed",
            "Records whose handling raised what the worker did not expect, by the exception's type: each was "
            "answered internal_error naming the exception and dead-lettered, and its partition went on past it. "
            "Any rate here is a fault of the worker: its log has the traceback.",
            ["exception"],
            registry=registry,
        )
        self.publish_retries = Counter(
            f"{PREFIX}_publish_retries",
            "Sends to Kafka that failed and were retried with backoff (broker outage, leader election); with "
            "exactly_once, a partition's transaction retried, under the topic it publishes to.",
            ["topic"],
            registry=registry,
        )
        self.commits = Counter(
            f"{PREFIX}_commits",
            "Successful commits of consumed offsets (with exactly_once delivery: committed transactions).",
            registry=registry,
        )
        self.commit_failures = Counter(
            f"{PREFIX}_commit_failures",
            "Offset commits that failed (usually a rebalance in progress); the work is redone by the next "
            "owner of the partition.",
            registry=registry,
        )
        self.transaction_aborts = Counter(
            f"{PREFIX}_transaction_aborts",
            "Kafka transactions aborted (exactly_once delivery): their answers are invisible to "
            "read_committed consumers and the requests are served again.",
            registry=registry,
        )

    def count_dead_letter(self) -> None:
        self.dead_letters.inc()

    def count_record_failed(self, exception: str) -> None:
        """A record the worker failed on (the type name of what its handling raised) was skipped."""
        self.records_failed.labels(exception=exception).inc()

    def count_publish_retry(self, topic: str) -> None:
        self.publish_retries.labels(topic=topic).inc()

    def count_commit(self, ok: bool = True) -> None:
        """One offset commit (or committed transaction), or with ``ok=False`` one that failed."""
        (self.commits if ok else self.commit_failures).inc()

    def count_transaction_abort(self) -> None:
        self.transaction_aborts.inc()


class InputSeries:
    """What the model is fed: media read from object storage and its cache, and shared-prefix reuse."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.media_bytes = Counter(
            f"{PREFIX}_media_fetched_bytes",
            "Bytes of media read from object storage (inline data: URLs excluded).",
            registry=registry,
        )
        self.media_cache = Counter(
            f"{PREFIX}_media_cache_lookups",
            "Media cache lookups by result (hit, miss); hit / (hit + miss) is the cache hit ratio.",
            ["result"],
            registry=registry,
        )
        self.prefix_requests = Counter(
            f"{PREFIX}_prefix_requests",
            "Requests with two or more questions by how they ran: 'shared' (the prompt prefix once, each "
            "question's tail on its cached state) or the reason they ran as full prompts (disabled, "
            "media_in_suffix, ...).",
            ["path"],
            registry=registry,
        )
        self.prefix_checks = Counter(
            f"{PREFIX}_prefix_checks",
            "Exact-replay checks of prefix reuse (every prefix_verify_every-th question also run from its "
            "full prompt), by result; one 'failed' turns reuse off for the worker's lifetime.",
            ["result"],
            registry=registry,
        )
        self.prefix_max_abs_dp = Gauge(
            f"{PREFIX}_prefix_max_abs_dp",
            "Largest |dp| between a prefix-reuse answer and its full-prompt replay so far (prefix_tolerance "
            "is the limit).",
            registry=registry,
        )
        self.registry_faults = Counter(
            f"{PREFIX}_registry_faults",
            "Schema Registry lookups that failed for the registry's sake (down, slow, refusing): each is "
            "retried with backoff while the fetch that needs it waits; no request is refused for one.",
            registry=registry,
        )
        for hit_or_miss in ("hit", "miss"):  # so that rates start at zero
            self.media_cache.labels(result=hit_or_miss)
        for passed_or_failed in ("passed", "failed"):
            self.prefix_checks.labels(result=passed_or_failed)

    def add_media_bytes(self, nbytes: int) -> None:
        """Bytes of one object read from object storage."""
        if nbytes > 0:
            self.media_bytes.inc(nbytes)

    def count_media_cache(self, hit: bool) -> None:
        """One media cache lookup."""
        self.media_cache.labels(result="hit" if hit else "miss").inc()

    def count_prefix_request(self, path: str) -> None:
        """A multi-question request ran on a shared prefix (``shared``) or as full prompts (the reason)."""
        self.prefix_requests.labels(path=path).inc()

    def observe_prefix_check(self, passed: bool, max_abs_dp: float) -> None:
        """One exact-replay check of prefix reuse, and the largest |dp| of all checks so far."""
        self.prefix_checks.labels(result="passed" if passed else "failed").inc()
        self.prefix_max_abs_dp.set(max_abs_dp)


class ShadowSeries:
    """Shadow evaluation (core/shadow.py): the live answer and the shadow's, per model pair and question
    type, summed so that agreement and mean |dp| are ratios of two counters (as ``d3stream compare`` has them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.shadow_requests = Counter(
            f"{PREFIX}_shadow_requests",
            "Requests the shadow model also answered (outcome answered), or whose shadow answer is an error "
            "(outcome errored: the live answer is unaffected).",
            [*_PAIR, "outcome"],
            registry=registry,
        )
        self.shadow_questions = Counter(
            f"{PREFIX}_shadow_questions",
            "Questions answered by both models and compared (outcome compared), or that the shadow answered "
            "with an error while the live model answered them (outcome errored).",
            [*_PAIR, "type", "outcome"],
            registry=registry,
        )
        self.shadow_agreements = Counter(
            f"{PREFIX}_shadow_agreements",
            "Compared questions whose top choice (d3stream compare's decision) is the same for both models; "
            "agreement = this / d3stream_shadow_questions{outcome=\"compared\"}.",
            [*_PAIR, "type"],
            registry=registry,
        )
        self.shadow_abs_dp = Counter(
            f"{PREFIX}_shadow_abs_dp",
            "Sum of |dp| over every option of the compared questions (live vs shadow probability); mean |dp| = "
            "this / d3stream_shadow_dp_options, as d3stream compare averages it.",
            [*_PAIR, "type"],
            registry=registry,
        )
        self.shadow_dp_options = Counter(
            f"{PREFIX}_shadow_dp_options",
            "Options whose |dp| d3stream_shadow_abs_dp sums.",
            [*_PAIR, "type"],
            registry=registry,
        )
        self.shadow_max_abs_dp = Gauge(
            f"{PREFIX}_shadow_max_abs_dp",
            "Largest |dp| of any option between the live and the shadow answer since the worker started.",
            [*_PAIR, "type"],
            registry=registry,
        )
        # The largest |dp| so far per (live, shadow, type): compared and set under one lock, so that two
        # threads cannot leave the smaller of their maxima in the gauge.
        self._shadow_max: dict[tuple[str, str, str], float] = {}
        self._shadow_lock = threading.Lock()

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


class ModelSeries:
    """What this worker serves: the model, the model swaps a rollout acted on, the kernels bound, the
    d3stream version."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.model_info = Info(
            f"{PREFIX}_model",
            "The model this worker serves: name, SHA-256 of its provenance record, torch device.",
            registry=registry,
        )
        self.model_swaps = Counter(
            f"{PREFIX}_model_swaps",
            "Changes of a watched model_source pointer acted on (rollout.py), by outcome: swapped (a new default "
            "model serves), canary (the canary or its share changed), refused_verification (manifest, SHA-256 or "
            "format version), refused_memory (it and the served models do not fit), refused_warmup, refused_pointer (unreadable or invalid pointer). A refusal leaves "
            "the served models serving.",
            ["outcome"],
            registry=registry,
        )
        self.kernels = Gauge(
            f"{PREFIX}_kernel_info",
            "The implementation bound for each Gated DeltaNet op (1 per op): a kernel package (fla..., "
            "causal_conv1d...) or torch-reference; op=path sums them up as fast, reference, mixed or none.",
            ["op", "implementation"],
            registry=registry,
        )
        self.build_info = Info(f"{PREFIX}_build", "The d3stream version of this worker.", registry=registry)
        self.build_info.info({"version": __version__})
        for outcome in SWAP_OUTCOMES:  # so that rates start at zero
            self.model_swaps.labels(outcome=outcome)

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
