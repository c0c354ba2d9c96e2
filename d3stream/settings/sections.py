"""The settings of a worker, in one typed section per concern, each field with its help text.

A component takes the section it needs (the Kafka connection takes ``ConnectionSettings``, the object store
``StorageSettings``), so what it can read is what it depends on. The help text lives on the field, in
``msgspec.Meta(description=...)``: ``--help`` and docs/SETTINGS.md are both made from it, and nothing keeps
a second list of names. Each section checks its own values (``check``); checks that span sections live on
``Settings`` (catalog.py).

The field names are the names an operator writes (flags, ``D3STREAM_*`` variables, TOML keys). The two
fields whose name would repeat their section's take a clearer attribute and keep their written name:
``DeliverySettings.mode`` is ``delivery`` and ``ModelSettings.checkpoints`` is ``model``.
"""

from typing import Annotated, Literal

import msgspec

from d3stream.settings.secret import Secret

# The delivery setting's values (each a registered sink and commit policy: commits.DELIVERY_MODES, which a
# test keeps in step with this list); also what chaos and the benchmarks pass as a mode. A mode's name only:
# the mode itself, its sink and policy, is commits.DeliveryMode.
DeliveryName = Literal["exactly_once", "at_least_once"]
# Which answers may leave before earlier requests of their partition are answered (kafka/offsets.py).
Ordering = Literal["key", "partition", "none"]

# Kept free within the rebalance timeout after the drain: the revoked partitions' final commit and the
# closing of their producers (a transaction's round trips, a slow broker).
REBALANCE_MARGIN_S = 5.0


def doc(text: str) -> msgspec.Meta:
    """A field's help text, as ``--help`` and docs/SETTINGS.md print it."""
    return msgspec.Meta(description=text)


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    def check(self) -> None:
        """Refuse values that cannot work, naming the setting and what to write instead (ValueError)."""


def _at_least(name: str, value: float, least: float, meaning: str) -> None:
    if value < least:
        raise ValueError(f"{name} must be {least:g} ({meaning}) or more, got {value}")


class ConnectionSettings(_Section, frozen=True, kw_only=True):
    """How every d3stream command reaches Kafka: brokers, client id, TLS and SASL."""

    bootstrap_servers: Annotated[str, doc(
        'Kafka bootstrap servers, host:port[,host:port]'
    )] = "127.0.0.1:9092"
    client_id: Annotated[str, doc('Kafka client id (shows in broker logs and metrics)')] = "d3stream"
    security_protocol: Annotated[Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"], doc(
        'Kafka security protocol: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL (SASL over TLS)'
    )] = "PLAINTEXT"
    sasl_mechanism: Annotated[Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None, doc(
        'SASL mechanism (with SASL_PLAINTEXT or SASL_SSL); OAUTHBEARER takes its token from '
        'sasl_oauth_token_provider'
    )] = None
    sasl_username: Annotated[str | None, doc('SASL user name (PLAIN, SCRAM)')] = None
    sasl_password: Annotated[Secret | None, doc(
        'SASL password (prefer the environment variable to a flag)'
    )] = None
    sasl_oauth_token_provider: Annotated[str | None, doc(
        'token source of sasl_mechanism OAUTHBEARER: aws-msk-iam (AWS MSK IAM, needs the msk-iam extra and '
        'AWS_REGION), or module:callable returning an access token'
    )] = None
    ssl_cafile: Annotated[str | None, doc(
        "CA bundle (PEM) that signs the brokers' certificates (default: the system's CAs)"
    )] = None
    ssl_certfile: Annotated[str | None, doc(
        "client certificate (PEM, chain allowed) for mutual TLS, e.g. a Strimzi KafkaUser's user.crt"
    )] = None
    ssl_keyfile: Annotated[str | None, doc(
        'private key (PEM) of ssl_certfile (default: inside ssl_certfile)'
    )] = None
    ssl_key_password: Annotated[Secret | None, doc(
        'password of an encrypted ssl_keyfile (prefer the environment variable to a flag)'
    )] = None
    ssl_check_hostname: Annotated[bool, doc(
        "check that the broker's certificate names the host connected to"
    )] = True
    kafka_options: Annotated[list[str], doc(
        'other aiokafka client options as key=value (flag repeatable, also as -X; or comma-separated), e.g. '
        'request_timeout_ms=30000; each goes to the clients that take it, unknown keys are refused'
    )] = msgspec.field(default_factory=list)


# How answers, dead letters and evaluations are written: plain JSON, or through the Schema Registry in Confluent's
# wire format (a magic byte 0, the 4-byte schema id, then the Avro or JSON payload).
RecordFormat = Literal["json", "avro", "json_schema"]
# Which subject a topic's schema is registered under (Confluent's TopicNameStrategy, RecordNameStrategy and
# TopicRecordNameStrategy).
SubjectNameStrategy = Literal["topic", "record", "topic_record"]


class RegistrySettings(_Section, frozen=True, kw_only=True):
    """The Schema Registry (Confluent's API; Apicurio's /apis/ccompat/v7): framed requests in, the chosen
    format out."""

    schema_registry_url: Annotated[str | None, doc(
        "Schema Registry URL (Confluent's API, e.g. http://registry:8081 or Apicurio's .../apis/ccompat/v7); with "
        "it, requests framed by the registry (Avro, JSON Schema) are read beside plain JSON ones"
    )] = None
    schema_registry_basic_auth: Annotated[Secret | None, doc(
        "user:password for the registry's basic auth (prefer the environment variable to a flag)"
    )] = None
    schema_registry_bearer_token: Annotated[Secret | None, doc(
        "a static bearer token for the registry (prefer the environment variable to a flag)"
    )] = None
    schema_registry_ssl_cafile: Annotated[str | None, doc(
        "CA bundle (PEM) that signs the registry's certificate (default: the system's CAs)"
    )] = None
    schema_registry_ssl_certfile: Annotated[str | None, doc(
        "client certificate (PEM) for mutual TLS with the registry"
    )] = None
    schema_registry_ssl_keyfile: Annotated[str | None, doc(
        "private key (PEM) of schema_registry_ssl_certfile"
    )] = None
    answer_format: Annotated[RecordFormat, doc(
        "how answers, dead letters and evaluations are written: json (plain), avro or json_schema (both in the "
        "registry's wire format; need schema_registry_url)"
    )] = "json"
    subject_name_strategy: Annotated[SubjectNameStrategy, doc(
        "the subject a schema is registered under: topic (<topic>-value), record (d3stream.v2.Answer) or "
        "topic_record (<topic>-d3stream.v2.Answer)"
    )] = "topic"
    schema_auto_register: Annotated[bool, doc(
        "register the answer schemas at start (the demo does); off in production: each subject's latest "
        "registered version is written with (d3stream schemas register), and the worker stops at start when "
        "there is none or it cannot carry the event"
    )] = False
    schema_registry_timeout_s: Annotated[float, doc(
        "how long one registry request may take before it counts as a fault (then retried with backoff)"
    )] = 10.0
    schema_registry_backoff_max_s: Annotated[float, doc(
        "the longest wait between retries while the registry is down (the partition waits; nothing is "
        "dead-lettered for it)"
    )] = 30.0
    schema_registry_require_subject: Annotated[bool, doc(
        "read a framed record only if its writer schema is registered under the subject of its topic (per "
        "subject_name_strategy); off, any schema id the registry knows is read, whoever registered it and where"
    )] = True
    schema_registry_unknown_id_ttl_s: Annotated[float, doc(
        "how long a schema id the registry said it does not know is answered schema_not_found without asking "
        "again (a later registration of that id is read after it)"
    )] = 30.0

    def check(self) -> None:
        if self.answer_format != "json" and not self.schema_registry_url:
            raise ValueError(f"answer_format {self.answer_format} writes through a Schema Registry: set "
                             "schema_registry_url, or answer_format json")
        if self.schema_registry_basic_auth is not None and ":" not in self.schema_registry_basic_auth.reveal():
            raise ValueError("schema_registry_basic_auth is user:password")
        if self.schema_registry_ssl_keyfile and not self.schema_registry_ssl_certfile:
            raise ValueError("schema_registry_ssl_keyfile needs schema_registry_ssl_certfile (the certificate it signs)")
        _at_least("schema_registry_timeout_s", self.schema_registry_timeout_s, 0.1, "a tenth of a second")
        _at_least("schema_registry_backoff_max_s", self.schema_registry_backoff_max_s, 0.1, "a tenth of a second")
        _at_least("schema_registry_unknown_id_ttl_s", self.schema_registry_unknown_id_ttl_s, 0.0, "zero")


class DeliverySettings(_Section, frozen=True, kw_only=True):
    """Which topics a worker reads and writes, its consumer group, and how answers and offsets are committed."""

    request_topics: Annotated[list[str], doc(
        'topics to read requests from (comma-separated)'
    )] = msgspec.field(default_factory=lambda: ["d3.requests"])
    answer_topic: Annotated[str, doc('topic answers are published to (key = request id)')] = "d3.answers"
    dead_letter_topic: Annotated[str, doc(
        'topic for records that cannot be read as a request'
    )] = "d3.dead-letters"
    provenance_topic: Annotated[str, doc(
        "compacted topic that receives the model's provenance record once per load"
    )] = "d3.provenance"
    group_id: Annotated[str, doc(
        'Kafka consumer group; workers in one group split the partitions'
    )] = "d3stream"
    group_instance_id: Annotated[str | None, doc(
        'static group membership id (e.g. the pod name): a restarted worker rejoins at once'
    )] = None
    session_timeout_ms: Annotated[int, doc(
        'how long the group waits for a silent worker before moving its partitions'
    )] = 10_000
    heartbeat_interval_ms: Annotated[int | None, doc(
        'how often a worker tells its group it is alive, and so how soon it hears that a rebalance began: every '
        "member's partitions stand still from the first revocation until the last member has heard (unset: a "
        'third of session_timeout_ms, at most 3 s)'
    )] = None
    rebalance_timeout_ms: Annotated[int, doc(
        'how long a rebalance waits for every worker to rejoin (its revocation drain and final commit run '
        'first); must exceed rebalance_drain_s plus a 5 s margin'
    )] = 30_000
    auto_offset_reset: Annotated[Literal["earliest", "latest"], doc(
        'where a new consumer group starts reading'
    )] = "earliest"
    create_topics: Annotated[bool, doc(
        'create missing answer, dead-letter and provenance topics at start'
    )] = True
    topic_partitions: Annotated[int, doc('partitions for topics this worker creates')] = 4
    commit_interval_ms: Annotated[int, doc(
        'how often finished offsets are committed (exactly_once: answers become visible then)'
    )] = 500
    mode: Annotated[DeliveryName, doc(
        'exactly_once: answers and offsets commit in one Kafka transaction; at_least_once: faster, duplicates'
        ' possible after a crash'
    )] = msgspec.field(default="exactly_once", name="delivery")
    ordering: Annotated[Ordering, doc(
        'which answers may leave before earlier requests of their partition are answered: key (answers of one'
        ' record key in offset order, other keys pass), partition (offset order), none'
    )] = "key"
    offset_metadata_max_bytes: Annotated[int, doc(
        "the broker's offset.metadata.max.bytes: bounds how far past its oldest unanswered request a "
        'partition is read (about 6 offsets per byte; the rest waits)'
    )] = 4096
    transactional_id_prefix: Annotated[str, doc(
        'prefix of the per-partition transactional ids (exactly_once)'
    )] = "d3stream"
    compression: Annotated[Literal["zstd", "lz4", "gzip", "none"], doc(
        "compression of published records (answers, dead letters); what the broker counts against a topic's "
        'max.message.bytes is the compressed batch'
    )] = "zstd"
    max_request_size: Annotated[int, doc(
        'largest uncompressed record the producer sends (aiokafka max_request_size); an answer over it, or '
        "over the answer topic's max.message.bytes once compressed, becomes answer_too_large"
    )] = 4_194_304
    producer_batch_bytes: Annotated[int, doc(
        "most bytes of records the producer puts in one batch for one partition (Kafka's batch.size, aiokafka "
        "max_batch_size): fewer, larger batches cost less CPU per answer; kept under the smallest "
        "max.message.bytes of the topics written"
    )] = 131_072
    dead_letter_max_bytes: Annotated[int, doc(
        'raw bytes of a record a dead letter carries (base64); beyond, only the first this many, with the '
        'size and SHA-256 of the whole'
    )] = 65_536

    def check(self) -> None:
        if self.heartbeat_interval_ms is not None and not 0 < self.heartbeat_interval_ms * 3 <= self.session_timeout_ms:
            raise ValueError(f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be positive and at most a "
                             f"third of session_timeout_ms ({self.session_timeout_ms}), so that one late heartbeat "
                             "does not drop a healthy worker from its group; lower it or raise session_timeout_ms")
        if self.producer_batch_bytes < 1024:
            raise ValueError(f"producer_batch_bytes must be at least 1024, got {self.producer_batch_bytes}")
        if self.offset_metadata_max_bytes < 64:
            raise ValueError(f"offset_metadata_max_bytes must be at least 64 (the broker's offset.metadata.max.bytes, "
                             f"4096 by default), got {self.offset_metadata_max_bytes}")


class ModelSettings(_Section, frozen=True, kw_only=True):
    """Which checkpoints a worker serves, beside which shadow or canary, on which device."""

    checkpoints: Annotated[list[str], doc(
        'checkpoints to serve: each a directory or s3://bucket/prefix/ (downloaded once to model_cache_dir), '
        'optionally as NAME=... (the name requests route by and answers carry); several (repeat the flag or '
        'separate with commas): one worker serves them all, the first is the default; serve needs it or '
        'model_source'
    )] = msgspec.field(default_factory=list, name="model")
    model_name: Annotated[str | None, doc(
        "name the default (first) model's answers carry (default: the checkpoint's manifest name)"
    )] = None
    model_memory_bytes: Annotated[int | None, doc(
        "memory the served models' weights may take together, checked at start (default: the device's free "
        'memory: torch.cuda.mem_get_info on a GPU, available RAM on a CPU)'
    )] = None
    shadow: Annotated[str | None, doc(
        'a model that also answers requests, its answers going to shadow_topic only (never to the live answer'
        ' topic): NAME=PATH (a checkpoint directory or s3:// prefix, loaded like model) or the NAME of a '
        'served model (docs/MODELS.md, Shadow evaluation)'
    )] = None
    shadow_share: Annotated[float, doc(
        'share of requests (0 to 1) the shadow also answers, chosen by a hash of the request id: the same '
        'requests on every worker and replay'
    )] = 1.0
    shadow_topic: Annotated[str | None, doc(
        "topic the shadow's answers go to (default: the answer topic's name + .shadow)"
    )] = None
    model_source: Annotated[str | None, doc(
        'a directory or s3://bucket/prefix/ of checkpoints with a pointer CURRENT.json (docs/MODELS.md): the '
        "worker serves the pointer's current checkpoint as its default model, watches the pointer and swaps "
        'to a new one without a stop (same model_allowlist and credentials as s3:// checkpoints)'
    )] = None
    model_source_poll_ms: Annotated[int, doc(
        'how often the model_source pointer is read for a change'
    )] = 5_000
    canary: Annotated[str | None, doc(
        'NAME=SHARE: a deterministic share (0 to 1, by a hash of the request id) of the requests that name no'
        " model goes to the served model NAME, the rest to the default; a model_source pointer's canary "
        'replaces it'
    )] = None
    device: Annotated[str | None, doc('torch device (default: cuda:0 when present, else cpu)')] = None
    verify: Annotated[Literal["fast", "full", "none"], doc(
        'checkpoint manifest verification at load'
    )] = "fast"
    permutation_average: Annotated[bool, doc(
        'score choice questions in both option orders and average (requests may ask too)'
    )] = False
    warmup: Annotated[bool, doc('run the model over a spread of batch shapes before consuming')] = False
    torch_threads: Annotated[int | None, doc(
        "intra-op threads of the model thread for CPU inference (default: torch's choice; the other threads "
        'run torch ops on one); on a shared CPU leave a core to the event loop and Kafka clients'
    )] = None

    def check(self) -> None:
        if not 0.0 <= self.shadow_share <= 1.0:
            raise ValueError(f"shadow_share must be between 0 and 1, got {self.shadow_share}")


class LimitSettings(_Section, frozen=True, kw_only=True):
    """Request limits, checked before any media fetch, decoding or device time (invalid_request)."""

    max_prompt_tokens: Annotated[int | None, doc(
        "longest question prompt served (tighter of this and the checkpoint's own limit); longer ones get "
        'max_length_exceeded, never truncated'
    )] = 32_768
    max_request_bytes: Annotated[int | None, doc(
        'largest request record value in bytes; larger ones get invalid_request unread (unset: no limit)'
    )] = 262_144
    max_request_questions: Annotated[int | None, doc(
        'most questions in one request (the answer carries one object per question)'
    )] = 256
    max_request_options: Annotated[int | None, doc(
        "most answer options summed over a request's questions (choice options, score levels, 2 per noul): "
        "each option is echoed in the answer, which must fit the answer topic's message limit"
    )] = 8_192
    max_request_tokens: Annotated[int | None, doc(
        "most prompt tokens summed over a request's question prompts (media tokens included); over it the "
        'request gets invalid_request before any device time'
    )] = 262_144


class BatchingSettings(_Section, frozen=True, kw_only=True):
    """How questions share forward passes, and how much work is read ahead before partitions pause (docs/SCHEDULING.md)."""

    max_batch_rows: Annotated[int, doc('most question prompts in one forward pass')] = 64
    max_batch_tokens: Annotated[int | None, doc(
        'most padded tokens (rows x longest prompt) in one pass; default 16384 on GPU, 4096 on CPU'
    )] = None
    linger_ms: Annotated[float, doc('how long a question may wait for others to share its pass')] = 5.0
    priority_lanes: Annotated[bool, doc(
        'fill passes from the higher request priority lanes first (high, normal, low); off: one lane'
    )] = True
    lane_ageing_ms: Annotated[float, doc(
        'a waiting question moves up one priority lane per this many milliseconds, so no lane starves'
    )] = 2_000.0
    lane_pass_tokens: Annotated[int | None, doc(
        'while high-priority requests arrived within lane_ageing_ms, passes hold at most this many padded '
        'tokens, so a high request waits for short passes only; default a sixteenth of max_batch_tokens, 0: '
        'no cap'
    )] = None
    honor_deadlines: Annotated[bool, doc(
        'answer requests past their deadline or ttl_ms deadline_exceeded without device time (replays turn it'
        ' off)'
    )] = True
    tenant_header: Annotated[str | None, doc(
        "record header naming a request's tenant when the request has no tenant field (unset or absent: the "
        'topic)'
    )] = None
    max_inflight_requests: Annotated[int, doc(
        'requests read but not yet answered before partitions are paused'
    )] = 256
    max_inflight_tokens: Annotated[int, doc('prompt tokens in flight before partitions are paused')] = 262_144
    tenant_max_inflight_tokens: Annotated[int, doc(
        'prompt tokens one tenant may have in flight (0: no limit); over it, its next requests are held and '
        'their partitions paused while other partitions flow (docs/SCHEDULING.md)'
    )] = 0
    prefix_reuse: Annotated[Literal["auto", "on", "off"], doc(
        "run the prompt prefix a request's questions share once (causal checkpoints); auto: on where the "
        'checkpoint allows it, off for noncausal_full_attention'
    )] = "auto"
    prefix_verify_every: Annotated[int, doc(
        'with prefix reuse, also run every Nth question from its full prompt and compare (0: never)'
    )] = 200
    prefix_tolerance: Annotated[float, doc(
        'largest |dp| a verification may show; above it the worker logs it and serves full prompts'
    )] = 1e-2

    def check(self) -> None:
        if self.lane_pass_tokens is not None:
            _at_least("lane_pass_tokens", self.lane_pass_tokens, 0, "no cap")
        _at_least("tenant_max_inflight_tokens", self.tenant_max_inflight_tokens, 0, "off")


class MediaSettings(_Section, frozen=True, kw_only=True):
    """What one request's images and videos may cost, and how they are decoded (docs/MEMORY.md)."""

    media_cache_bytes: Annotated[int, doc(
        'bytes of vision-tower features kept for media seen again (LRU by content hash; 0: off)'
    )] = 268_435_456
    max_inflight_media_bytes: Annotated[int, doc(
        "bytes decoded media, the processor's copies and the vision inputs hold at once: a request waits for "
        'its share (estimated from headers) before it decodes; partitions pause while it is full'
    )] = 1_073_741_824
    max_media_references: Annotated[int, doc(
        'most images + videos one request may name (more: invalid_request, nothing fetched)'
    )] = 32
    max_media_pixels: Annotated[int, doc(
        "most decoded pixels of one request's media, every image reference and sampled video frame counted, "
        'from the headers before decoding (more: invalid_request)'
    )] = 100_000_000
    max_video_frames: Annotated[int, doc(
        'most sampled video frames of one request, from the headers before decoding (more: invalid_request)'
    )] = 128
    media_decode_timeout_s: Annotated[float, doc(
        "deadline of one request's media decode; a video decode past it is killed, and the request answered "
        'media_unreadable'
    )] = 10.0
    media_decode_processes: Annotated[int, doc(
        'media decodes that run side by side: videos in as many worker processes (killed and replaced at the '
        'deadline), images on as many threads. Decodes past it wait for a free slot, each held for at most '
        'media_decode_timeout_s'
    )] = 4


class StorageSettings(_Section, frozen=True, kw_only=True):
    """The S3-compatible object store media and s3:// checkpoints come from."""

    s3_endpoint_url: Annotated[str | None, doc('S3-compatible endpoint (default: AWS)')] = None
    s3_region: Annotated[str | None, doc('region of the object store (default: the AWS environment or profile)')] = None
    media_allowlist: Annotated[list[str], doc(
        'buckets or bucket/prefix pairs requests may name (comma-separated); empty allows none'
    )] = msgspec.field(default_factory=list)
    model_allowlist: Annotated[list[str], doc(
        'buckets or bucket/prefix pairs an s3:// model may come from (comma-separated); empty allows none. '
        'Separate from media_allowlist: producers name media, operators name models'
    )] = msgspec.field(default_factory=list)
    model_cache_dir: Annotated[str | None, doc(
        'where s3:// checkpoints are downloaded and verified, one folder per manifest (default: '
        '$D3STREAM_CACHE/models, else ~/.cache/d3stream/models)'
    )] = None
    s3_max_concurrency: Annotated[int, doc('object store fetches one worker runs at once')] = 8
    s3_connect_timeout: Annotated[float, doc('seconds to connect to the object store')] = 5.0
    s3_read_timeout: Annotated[float, doc('seconds to wait for object store data')] = 20.0
    s3_max_attempts: Annotated[int, doc(
        'attempts per object store call (retries back off on throttling, 5xx, timeouts)'
    )] = 4


class ObservabilitySettings(_Section, frozen=True, kw_only=True):
    """Metrics endpoint, traces, logs, and the request headers answers carry back."""

    metrics_port: Annotated[int | None, doc(
        'port of the Prometheus /metrics, /healthz and /readyz endpoints (unset: no endpoint)'
    )] = 9464
    metrics_host: Annotated[str, doc(
        'address the metrics endpoint listens on (0.0.0.0: every interface, e.g. in a pod that Prometheus '
        'scrapes)'
    )] = "127.0.0.1"
    forward_headers: Annotated[list[str], doc(
        'request record headers the answer record carries back (comma-separated names); traceparent and '
        'tracestate always travel'
    )] = msgspec.field(default_factory=list)
    forward_headers_max_bytes: Annotated[int, doc(
        'most bytes (names and values) of request headers one answer carries; a header beyond it is left out '
        '(trace headers come first)'
    )] = 4_096
    otlp_endpoint: Annotated[str | None, doc(
        'OTLP/HTTP collector address for a span per request and its stages, e.g. http://otel-collector:4318 '
        '(unset: no tracing; needs the otel extra)'
    )] = None
    log_format: Annotated[Literal["auto", "json", "console"], doc(
        'auto: console on a terminal, JSON otherwise'
    )] = "auto"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], doc('least severe log lines written')] = "info"

    def check(self) -> None:
        reserved = sorted({"content-type", "d3stream-schema"} & set(self.forward_headers))
        if reserved:
            raise ValueError(f"forward_headers may not name {', '.join(reserved)}: the answer sets it itself")
        _at_least("forward_headers_max_bytes", self.forward_headers_max_bytes, 0, "none")


class EvaluationSettings(_Section, frozen=True, kw_only=True):
    """Live evaluation (d3stream evaluate): labels joined with answers."""

    label_topic: Annotated[str, doc(
        'topic labels are read from (key = request id; as many partitions as the answer topic)'
    )] = "d3.labels"
    evaluation_topic: Annotated[str, doc(
        'topic d3stream evaluate publishes one evaluation per joined request and model to'
    )] = "d3.evaluations"
    label_dead_letter_topic: Annotated[str, doc(
        'topic malformed or misplaced label records go to, with the reason'
    )] = "d3.labels.dead-letters"
    evaluate_group_id: Annotated[str, doc(
        'consumer group of the evaluate workers (they split the partitions)'
    )] = "d3stream-evaluate"
    evaluate_state_topic: Annotated[str, doc(
        "compacted topic holding the evaluator's waiting answers and labels (its changelog)"
    )] = "d3.evaluate.state"
    evaluate_window_s: Annotated[float, doc(
        'how long (in stream time) an answer waits for its label, and a label for its answer'
    )] = 604_800.0
    evaluate_max_state_bytes: Annotated[int, doc(
        'bytes of waiting answers and labels one evaluate worker keeps on local disk at most (the default, 64'
        ' GiB, holds a week of about 270 answers of three questions a second: 410 bytes each); over it the '
        'oldest are evicted first, counted as evicted'
    )] = 68_719_476_736
    evaluate_state_dir: Annotated[str | None, doc(
        'where d3stream evaluate keeps its waiting answers and labels, a file per partition (a volume of its '
        'own in Kubernetes; default: $D3STREAM_CACHE/evaluate, else ~/.cache/d3stream/evaluate)'
    )] = None
    evaluate_drift_window: Annotated[int, doc(
        'answers per model and question in the drift window (and in the reference window)'
    )] = 1_000
    evaluate_drift_reference: Annotated[str | None, doc(
        "JSON-lines file of answers whose distribution is the drift reference (default: each model's first "
        'window of answers)'
    )] = None


class LifecycleSettings(_Section, frozen=True, kw_only=True):
    """Start, stop, rebalance drains, readiness and the garbage collector."""

    shutdown_timeout_s: Annotated[float, doc(
        'on SIGTERM, how long in-flight work may take to finish before exit'
    )] = 120.0
    gc_young_threshold: Annotated[int, doc(
        "while serving, the start-up heap is frozen and the garbage collector's young threshold raised to "
        "this many allocations (Python's own: 700); 0 leaves the collector alone"
    )] = 1_000_000
    rebalance_keep_partitions: Annotated[bool, doc(
        "exactly_once: on rebalance, a revocation commits what is done and holds its partitions' producers, work "
        'and offsets until the new assignment; those handed back go on untouched, only those that move are '
        'closed (docs/SCALEOUT.md). Off, and always in at_least_once (whose answers of a partition that moved '
        'would be answered again by its next owner): every revocation drains for rebalance_drain_s and closes '
        'every partition'
    )] = True
    rebalance_drain_s: Annotated[float, doc(
        "with rebalance_keep_partitions off or in at_least_once, how long revoked partitions' work may take to "
        'finish on rebalance (exactly_once: what is unfinished then is abandoned and answered by the new owner)'
    )] = 5.0
    stall_unready_s: Annotated[float, doc(
        "/readyz fails while a partition's committed offset has not moved for this long although it has work "
        '(0: never)'
    )] = 300.0

    def check(self) -> None:
        _at_least("rebalance_drain_s", self.rebalance_drain_s, 0, "no drain")
        _at_least("stall_unready_s", self.stall_unready_s, 0, "off")
        _at_least("gc_young_threshold", self.gc_young_threshold, 0, "leave the collector alone")
