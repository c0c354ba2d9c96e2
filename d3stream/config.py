"""Service settings from flags, ``D3STREAM_*`` environment variables and a TOML file.

One Struct, ``Settings``, lists every knob with its default and a one-line meaning; the command line
flags, the environment variable names and the TOML keys are all derived from its field names, so the
three can never disagree. Precedence: flag > environment > file > default.

    d3stream serve --model ckpt --bootstrap-servers kafka:9092      # flag
    D3STREAM_BOOTSTRAP_SERVERS=kafka:9092 d3stream serve ...         # environment
    d3stream serve --config d3stream.toml                            # file: bootstrap_servers = "..."

List values take a comma-separated string in flags and the environment, a TOML array in the file.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec

ENV_PREFIX = "D3STREAM_"
CONFIG_ENV = "D3STREAM_CONFIG"

# The delivery setting's values (each a registered sink and commit policy: commits.DELIVERY_MODES, which a
# test keeps in step with this list); also what chaos and the benchmarks pass as a mode.
DeliveryMode = Literal["exactly_once", "at_least_once"]
# Which answers may leave before earlier requests of their partition are answered (kafka/offsets.py).
Ordering = Literal["key", "partition", "none"]


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Kafka
    bootstrap_servers: str = "127.0.0.1:9092"
    request_topics: list[str] = msgspec.field(default_factory=lambda: ["d3.requests"])
    answer_topic: str = "d3.answers"
    dead_letter_topic: str = "d3.dead-letters"
    provenance_topic: str = "d3.provenance"
    group_id: str = "d3stream"
    group_instance_id: str | None = None
    session_timeout_ms: int = 10_000
    rebalance_timeout_ms: int = 30_000
    client_id: str = "d3stream"
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    create_topics: bool = True
    topic_partitions: int = 4
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    sasl_oauth_token_provider: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: str | None = None
    ssl_check_hostname: bool = True
    kafka_options: list[str] = msgspec.field(default_factory=list)
    commit_interval_ms: int = 500
    delivery: DeliveryMode = "exactly_once"
    ordering: Ordering = "key"
    offset_metadata_max_bytes: int = 4096
    transactional_id_prefix: str = "d3stream"
    compression: Literal["zstd", "lz4", "gzip", "none"] = "zstd"
    max_request_size: int = 4_194_304
    dead_letter_max_bytes: int = 65_536
    # Model
    model: list[str] = msgspec.field(default_factory=list)
    model_name: str | None = None
    model_memory_bytes: int | None = None
    shadow: str | None = None
    shadow_share: float = 1.0
    shadow_topic: str | None = None
    model_source: str | None = None
    model_source_poll_ms: int = 5_000
    canary: str | None = None
    device: str | None = None
    verify: Literal["fast", "full", "none"] = "fast"
    permutation_average: bool = False
    warmup: bool = False
    max_prompt_tokens: int | None = 32_768
    # Request limits, checked before any media fetch, decoding or device time (invalid_request)
    max_request_bytes: int | None = 262_144
    max_request_questions: int | None = 256
    max_request_options: int | None = 8_192
    max_request_tokens: int | None = 262_144
    torch_threads: int | None = None
    # Batching and backpressure
    max_batch_rows: int = 64
    max_batch_tokens: int | None = None
    linger_ms: float = 5.0
    # Shared traffic (docs/SCHEDULING.md)
    priority_lanes: bool = True
    lane_ageing_ms: float = 2_000.0
    lane_pass_tokens: int | None = None
    honor_deadlines: bool = True
    tenant_header: str | None = None
    max_inflight_requests: int = 256
    max_inflight_tokens: int = 262_144
    tenant_max_inflight_tokens: int = 0
    prefix_reuse: Literal["auto", "on", "off"] = "auto"
    prefix_verify_every: int = 200
    prefix_tolerance: float = 1e-2
    media_cache_bytes: int = 268_435_456
    max_inflight_media_bytes: int = 1_073_741_824
    # Media limits (per request, checked before the work)
    max_media_references: int = 32
    max_media_pixels: int = 100_000_000
    max_video_frames: int = 128
    media_decode_timeout_s: float = 10.0
    media_decode_processes: int = 4
    # Object storage
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    media_allowlist: list[str] = msgspec.field(default_factory=list)
    model_allowlist: list[str] = msgspec.field(default_factory=list)
    model_cache_dir: str | None = None
    s3_max_concurrency: int = 8
    s3_connect_timeout: float = 5.0
    s3_read_timeout: float = 20.0
    s3_max_attempts: int = 4
    # Observability
    metrics_port: int | None = 9464
    metrics_host: str = "127.0.0.1"
    forward_headers: list[str] = msgspec.field(default_factory=list)
    forward_headers_max_bytes: int = 4_096
    otlp_endpoint: str | None = None
    # Live evaluation (d3stream evaluate)
    label_topic: str = "d3.labels"
    evaluation_topic: str = "d3.evaluations"
    label_dead_letter_topic: str = "d3.labels.dead-letters"
    evaluate_group_id: str = "d3stream-evaluate"
    evaluate_state_topic: str = "d3.evaluate.state"
    evaluate_window_s: float = 604_800.0
    evaluate_max_state_bytes: int = 68_719_476_736
    evaluate_state_dir: str | None = None
    evaluate_drift_window: int = 1_000
    evaluate_drift_reference: str | None = None
    # Lifecycle and logs
    shutdown_timeout_s: float = 120.0
    gc_young_threshold: int = 1_000_000
    rebalance_drain_s: float = 5.0
    stall_unready_s: float = 300.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"


HELP: dict[str, str] = {
    "label_topic": "topic labels are read from (key = request id; as many partitions as the answer topic)",
    "evaluation_topic": "topic d3stream evaluate publishes one evaluation per joined request and model to",
    "label_dead_letter_topic": "topic malformed or misplaced label records go to, with the reason",
    "evaluate_group_id": "consumer group of the evaluate workers (they split the partitions)",
    "evaluate_state_topic": "compacted topic holding the evaluator's waiting answers and labels (its changelog)",
    "evaluate_window_s": "how long (in stream time) an answer waits for its label, and a label for its answer",
    "evaluate_max_state_bytes": "bytes of waiting answers and labels one evaluate worker keeps on local disk at "
    "most (the default, 64 GiB, holds a week of about 270 answers of three questions a second: 410 bytes each); "
    "over it the oldest are evicted first, counted as evicted",
    "evaluate_state_dir": "where d3stream evaluate keeps its waiting answers and labels, a file per partition (a "
    "volume of its own in Kubernetes; default: $D3STREAM_CACHE/evaluate, else ~/.cache/d3stream/evaluate)",
    "evaluate_drift_window": "answers per model and question in the drift window (and in the reference window)",
    "evaluate_drift_reference": "JSON-lines file of answers whose distribution is the drift reference "
    "(default: each model's first window of answers)",
    "bootstrap_servers": "Kafka bootstrap servers, host:port[,host:port]",
    "request_topics": "topics to read requests from (comma-separated)",
    "answer_topic": "topic answers are published to (key = request id)",
    "dead_letter_topic": "topic for records that cannot be read as a request",
    "provenance_topic": "compacted topic that receives the model's provenance record once per load",
    "group_id": "Kafka consumer group; workers in one group split the partitions",
    "group_instance_id": "static group membership id (e.g. the pod name): a restarted worker rejoins at once",
    "session_timeout_ms": "how long the group waits for a silent worker before moving its partitions",
    "rebalance_timeout_ms": "how long a rebalance waits for every worker to rejoin (its revocation drain and "
    "final commit run first); must exceed rebalance_drain_s plus a 5 s margin",
    "client_id": "Kafka client id (shows in broker logs and metrics)",
    "auto_offset_reset": "where a new consumer group starts reading",
    "create_topics": "create missing answer, dead-letter and provenance topics at start",
    "topic_partitions": "partitions for topics this worker creates",
    "security_protocol": "Kafka security protocol",
    "sasl_mechanism": "SASL mechanism (with SASL_PLAINTEXT or SASL_SSL); OAUTHBEARER takes its token from "
    "sasl_oauth_token_provider",
    "sasl_username": "SASL user name (PLAIN, SCRAM)",
    "sasl_password": "SASL password (prefer the environment variable to a flag)",
    "sasl_oauth_token_provider": "token source of sasl_mechanism OAUTHBEARER: aws-msk-iam (AWS MSK IAM, needs "
    "the msk-iam extra and AWS_REGION), or module:callable returning an access token",
    "ssl_cafile": "CA bundle (PEM) that signs the brokers' certificates (default: the system's CAs)",
    "ssl_certfile": "client certificate (PEM, chain allowed) for mutual TLS, e.g. a Strimzi KafkaUser's user.crt",
    "ssl_keyfile": "private key (PEM) of ssl_certfile (default: inside ssl_certfile)",
    "ssl_key_password": "password of an encrypted ssl_keyfile (prefer the environment variable to a flag)",
    "ssl_check_hostname": "check that the broker's certificate names the host connected to",
    "kafka_options": "other aiokafka client options as key=value (flag repeatable, also as -X; or "
    "comma-separated), e.g. request_timeout_ms=30000; each goes to the clients that take it, unknown keys are "
    "refused",
    "commit_interval_ms": "how often finished offsets are committed (exactly_once: answers become visible then)",
    "delivery": "exactly_once: answers and offsets commit in one Kafka transaction; at_least_once: faster, "
    "duplicates possible after a crash",
    "ordering": "which answers may leave before earlier requests of their partition are answered: key (answers "
    "of one record key in offset order, other keys pass), partition (offset order), none",
    "offset_metadata_max_bytes": "the broker's offset.metadata.max.bytes: bounds how far past its oldest unanswered "
    "request a partition is read (about 6 offsets per byte; the rest waits)",
    "transactional_id_prefix": "prefix of the per-partition transactional ids (exactly_once)",
    "compression": "compression of published records (answers, dead letters); what the broker counts against a "
    "topic's max.message.bytes is the compressed batch",
    "max_request_size": "largest uncompressed record the producer sends (aiokafka max_request_size); an answer "
    "over it, or over the answer topic's max.message.bytes once compressed, becomes answer_too_large",
    "dead_letter_max_bytes": "raw bytes of a record a dead letter carries (base64); beyond, only the first this "
    "many, with the size and SHA-256 of the whole",
    "model": "checkpoints to serve: each a directory or s3://bucket/prefix/ (downloaded once to model_cache_dir), "
    "optionally as NAME=... (the name requests route by and answers carry); several (repeat the flag or separate "
    "with commas): one worker serves them all, the first is the default; serve needs it or model_source",
    "model_name": "name the default (first) model's answers carry (default: the checkpoint's manifest name)",
    "model_memory_bytes": "memory the served models' weights may take together, checked at start (default: the "
    "device's free memory: torch.cuda.mem_get_info on a GPU, available RAM on a CPU)",
    "shadow": "a model that also answers requests, its answers going to shadow_topic only (never to the live "
    "answer topic): NAME=PATH (a checkpoint directory or s3:// prefix, loaded like model) or the NAME of a served "
    "model (README, Shadow evaluation)",
    "shadow_share": "share of requests (0 to 1) the shadow also answers, chosen by a hash of the request id: the "
    "same requests on every worker and replay",
    "shadow_topic": "topic the shadow's answers go to (default: the answer topic's name + .shadow)",
    "model_source": "a directory or s3://bucket/prefix/ of checkpoints with a pointer CURRENT.json (docs/MODELS.md): "
    "the worker serves the pointer's current checkpoint as its default model, watches the pointer and swaps to a "
    "new one without a stop (same model_allowlist and credentials as s3:// checkpoints)",
    "model_source_poll_ms": "how often the model_source pointer is read for a change",
    "canary": "NAME=SHARE: a deterministic share (0 to 1, by a hash of the request id) of the requests that name "
    "no model goes to the served model NAME, the rest to the default; a model_source pointer's canary replaces it",
    "device": "torch device (default: cuda:0 when present, else cpu)",
    "verify": "checkpoint manifest verification at load",
    "permutation_average": "score choice questions in both option orders and average (requests may ask too)",
    "max_prompt_tokens": "longest question prompt served (tighter of this and the checkpoint's own limit); "
    "longer ones get max_length_exceeded, never truncated",
    "max_request_bytes": "largest request record value in bytes; larger ones get invalid_request unread (unset: "
    "no limit)",
    "max_request_questions": "most questions in one request (the answer carries one object per question)",
    "max_request_options": "most answer options summed over a request's questions (choice options, score levels, "
    "2 per noul): each option is echoed in the answer, which must fit the answer topic's message limit",
    "max_request_tokens": "most prompt tokens summed over a request's question prompts (media tokens included); "
    "over it the request gets invalid_request before any device time",
    "torch_threads": "intra-op threads of the model thread for CPU inference (default: torch's choice; the other "
    "threads run torch ops on one); on a shared CPU leave a core to the event loop and Kafka clients",
    "warmup": "run the model over a spread of batch shapes before consuming",
    "max_batch_rows": "most question prompts in one forward pass",
    "max_batch_tokens": "most padded tokens (rows x longest prompt) in one pass; default 16384 on GPU, 4096 on CPU",
    "linger_ms": "how long a question may wait for others to share its pass",
    "priority_lanes": "fill passes from the higher request priority lanes first (high, normal, low); off: one lane",
    "lane_ageing_ms": "a waiting question moves up one priority lane per this many milliseconds, so no lane starves",
    "lane_pass_tokens": "while high-priority requests arrived within lane_ageing_ms, passes hold at most this many "
                        "padded tokens, so a high request waits for short passes only; default a sixteenth of "
                        "max_batch_tokens, 0: no cap",
    "honor_deadlines": "answer requests past their deadline or ttl_ms deadline_exceeded without device time "
    "(replays turn it off)",
    "tenant_header": "record header naming a request's tenant when the request has no tenant field (unset or "
    "absent: the topic)",
    "max_inflight_requests": "requests read but not yet answered before partitions are paused",
    "max_inflight_tokens": "prompt tokens in flight before partitions are paused",
    "tenant_max_inflight_tokens": "prompt tokens one tenant may have in flight (0: no limit); over it, its next "
    "requests are held and their partitions paused while other partitions flow (docs/SCHEDULING.md)",
    "prefix_reuse": "run the prompt prefix a request's questions share once (causal checkpoints); auto: on "
    "where the checkpoint allows it, off for noncausal_full_attention",
    "prefix_verify_every": "with prefix reuse, also run every Nth question from its full prompt and compare "
    "(0: never)",
    "prefix_tolerance": "largest |dp| a verification may show; above it the worker logs it and serves full prompts",
    "media_cache_bytes": "bytes of vision-tower features kept for media seen again (LRU by content hash; 0: off)",
    "max_inflight_media_bytes": "bytes decoded media, the processor's copies and the vision inputs hold at once: a "
    "request waits for its share (estimated from headers) before it decodes; partitions pause while it is full",
    "max_media_references": "most images + videos one request may name (more: invalid_request, nothing fetched)",
    "max_media_pixels": "most decoded pixels of one request's media, every image reference and sampled video "
    "frame counted, from the headers before decoding (more: invalid_request)",
    "max_video_frames": "most sampled video frames of one request, from the headers before decoding "
    "(more: invalid_request)",
    "media_decode_timeout_s": "deadline of one request's media decode; a video decode past it is killed, and the "
    "request answered media_unreadable",
    "media_decode_processes": "media decodes that run side by side: videos in as many worker processes (killed "
    "and replaced at the deadline), images on as many threads. Decodes past it wait for a free slot, each held "
    "for at most media_decode_timeout_s",
    "s3_endpoint_url": "S3-compatible endpoint (default: AWS)",
    "s3_region": "S3 region",
    "media_allowlist": "buckets or bucket/prefix pairs requests may name (comma-separated); empty allows none",
    "model_allowlist": "buckets or bucket/prefix pairs an s3:// model may come from (comma-separated); empty "
    "allows none. Separate from media_allowlist: producers name media, operators name models",
    "model_cache_dir": "where s3:// checkpoints are downloaded and verified, one folder per manifest "
    "(default: $D3STREAM_CACHE/models, else ~/.cache/d3stream/models)",
    "s3_max_concurrency": "objects fetched at once",
    "s3_connect_timeout": "seconds to connect to the object store",
    "s3_read_timeout": "seconds to wait for object store data",
    "s3_max_attempts": "attempts per object store call (retries back off on throttling, 5xx, timeouts)",
    "metrics_port": "port of the Prometheus /metrics, /healthz and /readyz endpoints (unset: no endpoint)",
    "metrics_host": "address the metrics endpoint listens on (0.0.0.0: every interface, e.g. in a pod that "
    "Prometheus scrapes)",
    "forward_headers": "request record headers the answer record carries back (comma-separated names); "
    "traceparent and tracestate always travel",
    "forward_headers_max_bytes": "most bytes (names and values) of request headers one answer carries; a header "
    "beyond it is left out (trace headers come first)",
    "otlp_endpoint": "OTLP/HTTP collector address for a span per request and its stages, e.g. "
    "http://otel-collector:4318 (unset: no tracing; needs the otel extra)",
    "shutdown_timeout_s": "on SIGTERM, how long in-flight work may take to finish before exit",
    "gc_young_threshold": "while serving, the start-up heap is frozen and the garbage collector's young threshold "
                          "raised to this many allocations (Python's own: 700); 0 leaves the collector alone",
    "rebalance_drain_s": "on rebalance, how long revoked partitions' work may take to finish (exactly_once: "
    "what is unfinished then is abandoned and answered by the new owner)",
    "stall_unready_s": "/readyz fails while a partition's committed offset has not moved for this long although "
    "it has work (0: never)",
    "log_format": "auto: console on a terminal, JSON otherwise",
    "log_level": "log level",
}

FIELDS = {name: field for name, field in zip(Settings.__struct_fields__, msgspec.structs.fields(Settings), strict=True)}


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _default_text(default: Any) -> str:
    """A setting's default as it is written in a flag or the environment (nothing when it has none: unset)."""
    if default is None:
        return ""
    if isinstance(default, bool):
        return "; default: " + ("true" if default else "false")
    if isinstance(default, list):
        return "; default: " + (",".join(default) if default else "empty")
    return f"; default: {default}"


# The settings of a connection to Kafka: every command that talks to Kafka takes these (and only serve and
# replay take the rest). d3stream/kafka/connection.py turns them into aiokafka keyword arguments.
CONNECTION_FIELDS = (
    "bootstrap_servers",
    "client_id",
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "sasl_oauth_token_provider",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_key_password",
    "ssl_check_hostname",
    "kafka_options",
)


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting (or per setting in ``only``); unset flags stay None so the environment and file
    can fill them. A list setting's flag may be repeated, each value comma-separated or not."""
    parser.add_argument("--config", default=None, help=f"TOML settings file (or ${CONFIG_ENV})")
    title = "Kafka connection settings" if only == CONNECTION_FIELDS else "settings"
    group = parser.add_argument_group(f"{title} (flag > environment > TOML file > default)")
    for name, field in FIELDS.items():
        if only is not None and name not in only:
            continue
        default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
        text = f"{HELP.get(name, '')} (env {env_name(name)}{_default_text(default)})".replace("%", "%%")
        if _is_bool(field.type):
            group.add_argument(flag_name(name), dest=name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            choices = None
            args = get_args(field.type)
            literal = next((a for a in (field.type, *args) if get_origin(a) is Literal), None)
            if literal is not None:
                choices = list(get_args(literal))
            action = "append" if _is_list(field.type) else "store"
            # -X key=value, as kcat spells its client options
            names = (flag_name(name), "-X") if name == "kafka_options" else (flag_name(name),)
            group.add_argument(*names, dest=name, default=None, choices=choices, action=action, help=text)


def _optional(annotation: Any) -> bool:
    return type(None) in get_args(annotation)


def _coerce_text(name: str, text: str) -> Any:
    """Environment and flag strings into the shape msgspec converts: lists split on commas, an empty
    string for an optional setting means unset."""
    annotation = FIELDS[name].type
    if _optional(annotation) and text.strip().lower() in ("", "none"):
        return None
    if _is_list(annotation):
        return [part.strip() for part in text.split(",") if part.strip()]
    if _is_bool(annotation):
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{env_name(name)} must be true or false, got {text!r}")
    return text


def load_settings(
    flags: argparse.Namespace | dict[str, Any] | None = None,
    *,
    environ: dict[str, str] | None = None,
    config_file: str | os.PathLike | None = None,
) -> Settings:
    """Settings from the three sources; ValueError names the offending setting and source."""
    environ = dict(os.environ if environ is None else environ)
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    merged: dict[str, Any] = {}
    path = config_file or given.get("config") or environ.get(CONFIG_ENV)
    if path:
        try:
            document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read the settings file {path}: {exc}") from exc
        section = document.get("d3stream", document)
        unknown = sorted(set(section) - set(FIELDS))
        if unknown:
            raise ValueError(f"{path}: unknown settings {', '.join(unknown)}; see `d3stream serve --help`")
        merged.update(section)
    if isinstance(merged.get("model"), str):  # model = "ckpt", as written before a worker served several
        merged["model"] = [merged["model"]]
    for name in FIELDS:
        if env_name(name) in environ:
            merged[name] = _coerce_text(name, environ[env_name(name)])
    for name in FIELDS:
        value = given.get(name)
        if isinstance(value, list) and _is_list(FIELDS[name].type):  # a repeated flag: each may hold a, b
            value = [part for item in value for part in (_coerce_text(name, item) if isinstance(item, str) else [item])]
        if value is not None:
            merged[name] = _coerce_text(name, value) if isinstance(value, str) else value
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid setting: {exc} (flag, {ENV_PREFIX}* variable or settings file)") from exc
    return check_settings(settings)


# Kept free within the rebalance timeout after the drain: the revoked partitions' final commit and the
# closing of their producers (a transaction's round trips, a slow broker).
REBALANCE_MARGIN_S = 5.0


def check_settings(settings: Settings) -> Settings:
    """Refuse settings that cannot work together, naming them (ValueError).

    A rebalance waits ``rebalance_timeout_ms`` for every member to rejoin, and a member rejoins only after
    its revocation callback (drain, final commit) returned. A member slower than that is dropped from the
    group, rejoins as a new member and starts the next rebalance: with drains longer than the timeout the
    group never settles (a rebalance storm). aiokafka would take the timeout from ``session_timeout_ms``."""
    drain_ms = settings.rebalance_drain_s * 1000
    if settings.rebalance_drain_s < 0:
        raise ValueError(f"rebalance_drain_s must be 0 or more, got {settings.rebalance_drain_s}")
    if drain_ms + REBALANCE_MARGIN_S * 1000 > settings.rebalance_timeout_ms:
        raise ValueError(
            f"rebalance_drain_s ({settings.rebalance_drain_s:g} s) plus a {REBALANCE_MARGIN_S:g} s margin for the "
            f"final commit must fit in rebalance_timeout_ms ({settings.rebalance_timeout_ms} ms): a worker still "
            "draining when the rebalance times out is dropped from the group and starts the next rebalance. Lower "
            f"rebalance_drain_s or raise rebalance_timeout_ms to at least {int(drain_ms + REBALANCE_MARGIN_S * 1000)}"
        )
    if settings.lane_pass_tokens is not None and settings.lane_pass_tokens < 0:
        raise ValueError(f"lane_pass_tokens must be 0 (no cap) or more, got {settings.lane_pass_tokens}")
    if settings.tenant_max_inflight_tokens < 0:
        raise ValueError(f"tenant_max_inflight_tokens must be 0 (off) or more, got {settings.tenant_max_inflight_tokens}")
    if not 0.0 <= settings.shadow_share <= 1.0:
        raise ValueError(f"shadow_share must be between 0 and 1, got {settings.shadow_share}")
    if settings.shadow_topic is not None and settings.shadow_topic == settings.answer_topic:
        raise ValueError("shadow_topic must not be the answer topic: a shadow's answers never go to the live topic")
    if settings.offset_metadata_max_bytes < 64:
        raise ValueError(f"offset_metadata_max_bytes must be at least 64 (the broker's offset.metadata.max.bytes, "
                         f"4096 by default), got {settings.offset_metadata_max_bytes}")
    if settings.stall_unready_s < 0:
        raise ValueError(f"stall_unready_s must be 0 (off) or more, got {settings.stall_unready_s}")
    if settings.gc_young_threshold < 0:
        raise ValueError(f"gc_young_threshold must be 0 (leave the collector alone) or more, "
                         f"got {settings.gc_young_threshold}")
    reserved = sorted({"content-type", "d3stream-schema"} & set(settings.forward_headers))
    if reserved:
        raise ValueError(f"forward_headers may not name {', '.join(reserved)}: the answer sets it itself")
    if settings.forward_headers_max_bytes < 0:
        raise ValueError(f"forward_headers_max_bytes must be 0 (none) or more, got {settings.forward_headers_max_bytes}")
    return settings


# Where d3stream keeps what it builds or downloads (tokenizers, demo checkpoints, downloaded models).
CACHE_ENV = "D3STREAM_CACHE"


def cache_root() -> Path:
    """``$D3STREAM_CACHE`` or ``~/.cache/d3stream``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "d3stream"

def heartbeat_interval_ms(settings: Settings) -> int:
    """aiokafka's 3 s heartbeat, or a third of a shorter session timeout, so one late heartbeat does not
    drop a healthy worker from the group."""
    return min(3000, settings.session_timeout_ms // 3)

