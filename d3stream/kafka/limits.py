"""The size limits on what the worker publishes, and whether a record fits them.

A record reaches a topic only if two limits allow it: the producer's ``max_request_size`` (aiokafka
checks the *uncompressed* record against it before sending) and the topic's ``max.message.bytes`` (the
broker checks the *compressed* batch; its default is the broker's ``message.max.bytes``, 1,048,588
bytes out of the box). A record over either is refused every time it is sent, so retrying it would halt
its partition for good. The worker therefore reads the topics' limits from the broker at start
(``read_topic_limits``) and checks each answer and dead letter before it is handed to the producer
(``Limits.fits``): what does not fit is replaced (an ``answer_too_large`` error answer, a dead letter
without the raw bytes) instead of being retried.

aiokafka puts a record larger than its batch size alone in a batch, so the compressed size of the one
record plus the batch overhead is what the broker sees for every record that could be too large; ``fits``
compresses with the producer's own codec to know it. A batch of several records is the broker's to refuse
too, so the producer's batch size (``producer_batch_bytes``) is kept under the smallest limit of the topics
written (``batch_bytes``): records that each fit never make a batch that does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from d3stream_client.contract import HEADERS

from d3stream.core.outgoing import Fit

log = structlog.get_logger(__name__)

# The broker's message.max.bytes out of the box: what a topic allows when its own setting cannot be read.
BROKER_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
# A record batch's header (61 bytes) and one record's framing (attributes, timestamp and offset deltas,
# length varints) with room to spare: an estimate must never be smaller than what the broker counts.
BATCH_OVERHEAD = 256

# Kafka's error code for a topic the broker does not know.
UNKNOWN_TOPIC_OR_PARTITION = 3


class WorkerFatal(RuntimeError):
    """Publishing or committing cannot succeed however often it is retried (no permission, a missing
    topic, a limit that not even an error answer fits): the worker stops and exits non-zero. The message
    names the topic, the cause and the knob to turn."""


@dataclass
class Limits:
    """The limits of the topics this worker publishes to."""

    max_request_size: int
    compression: str | None  # the producer's compression_type (None: uncompressed)
    topics: dict[str, int] = field(default_factory=dict)  # topic -> max.message.bytes

    def topic_limit(self, topic: str) -> int:
        return self.topics.get(topic, BROKER_DEFAULT_MAX_MESSAGE_BYTES)

    def fit(self, topic: str, key: bytes | None, value: bytes,
            headers: Sequence[tuple[str, bytes]] = HEADERS) -> Fit:
        limit = self.topic_limit(topic)
        uncompressed = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        if uncompressed > self.max_request_size:
            return Fit(False, uncompressed, uncompressed, limit,
                       f"{uncompressed} bytes uncompressed, over the producer's max_request_size "
                       f"({self.max_request_size})")
        if uncompressed + BATCH_OVERHEAD <= limit:  # fits even uncompressed: no need to compress twice
            return Fit(True, uncompressed, uncompressed, limit)
        on_wire = self.compressed_size(key, value, headers) + BATCH_OVERHEAD
        if on_wire > limit:
            codec = self.compression or "no compression"
            return Fit(False, uncompressed, on_wire, limit,
                       f"{on_wire} bytes on the wire ({codec}; {uncompressed} uncompressed), over topic "
                       f"{topic!r}'s max.message.bytes ({limit})")
        return Fit(True, uncompressed, on_wire, limit)

    def batch_bytes(self, wanted: int) -> int:
        """The producer's batch size: ``wanted``, or less where a topic written allows less, with room for the
        batch's framing and for what compressing incompressible bytes can add (under 1 %)."""
        smallest = min(self.topics.values(), default=BROKER_DEFAULT_MAX_MESSAGE_BYTES)
        return max(1024, min(wanted, smallest - BATCH_OVERHEAD - smallest // 100))

    def compressed_size(self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = HEADERS) -> int:
        """The record's key, value and headers compressed with the producer's codec."""
        payload = (key or b"") + value + b"".join(name.encode() + data for name, data in headers)
        return len(compress(self.compression, payload))


def compress(codec: str | None, payload: bytes) -> bytes:
    """``payload`` as the producer would compress it (aiokafka's codecs, at their default levels)."""
    from aiokafka import codec as codecs

    if codec is None or codec == "none":
        return payload
    encoders = {"zstd": codecs.zstd_encode, "lz4": codecs.lz4_encode, "gzip": codecs.gzip_encode}
    return encoders[codec](payload)


def producer_compression(setting: str) -> str | None:
    """The producer's ``compression_type`` for the ``compression`` setting; refuses a codec whose library
    is missing with the fix, instead of the producer failing later."""
    from aiokafka import codec as codecs

    if setting == "none":
        return None
    available = {"zstd": codecs.has_zstd, "lz4": codecs.has_lz4, "gzip": codecs.has_gzip}[setting]()
    if not available:
        raise ValueError(
            f"compression={setting} needs the cramjam package (pip install cramjam); or set compression to gzip or none"
        )
    return setting


async def read_topic_limits(
    admin_options: Mapping[str, object], topics: Sequence[str], *, create_topics: bool
) -> dict[str, int]:
    """Each topic's ``max.message.bytes``, read from the broker (``DescribeConfigs``).

    A topic the broker does not know is fatal when this worker may not create it (``create_topics`` off):
    every record for it would be retried forever. A topic whose configuration cannot be read (no
    DescribeConfigs permission, an old broker) gets the broker default, with a warning.
    """
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import KafkaError, for_code

    from d3stream.kafka.connection import raw_client

    wanted = sorted(set(topics))
    admin = raw_client("admin", **admin_options)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": None}) for topic in wanted]
        )
    except KafkaError as exc:
        log.warning("topic limits not readable; assuming the broker default", topics=wanted,
                    limit=BROKER_DEFAULT_MAX_MESSAGE_BYTES, error=f"{type(exc).__name__}: {exc}")
        return {}
    finally:
        await admin.close()
    limits: dict[str, int] = {}
    for response in responses:
        for error_code, _message, _kind, topic, entries in (tuple(r)[:5] for r in response.resources):
            if error_code == UNKNOWN_TOPIC_OR_PARTITION and not create_topics:
                raise WorkerFatal(
                    f"topic {topic!r} does not exist and create_topics is off: create the topic, or turn "
                    "create_topics on (answer_topic, dead_letter_topic and provenance_topic must exist)"
                )
            if error_code != 0:
                log.warning("topic limit not readable; assuming the broker default", topic=topic,
                            limit=BROKER_DEFAULT_MAX_MESSAGE_BYTES, error=for_code(error_code).__name__)
                continue
            for name, value, *_ in entries:
                if name == "max.message.bytes" and value is not None:
                    limits[topic] = int(value)
    return limits
