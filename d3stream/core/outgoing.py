"""What the core hands to a sink: records to publish, how an event becomes one, and whether it fits its topic.

The core builds every record a request ends in (its answer, a dead letter, a shadow answer) and sizes it
before anything is sent, so that a record too large for its topic is replaced by a smaller one instead
of being refused forever. How large is too large is the broker's business: the core asks a ``RecordFit``
(``d3stream.kafka.limits.Limits.fit`` reads the topics' limits from the broker) and never imports Kafka.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec
from d3stream_client.contract import HEADERS, encode

from d3stream.core.seams import RecordKind


@dataclass(slots=True)
class Outgoing:
    """A record to publish because of one consumed offset (its answer, maybe a dead letter)."""

    topic: str
    key: bytes | None
    value: bytes
    kind: RecordKind = "answer"  # what it is, for a sink that is not a set of topics (a file keeps answers)
    # content-type and d3stream-schema, and the request headers an answer carries back (ops/tracing.py).
    headers: list[tuple[str, bytes]] = field(default_factory=lambda: HEADERS, repr=False)
    # What to publish instead when this record is refused as too large (the refusal's text as argument);
    # None: nothing smaller exists, and a refusal is worker-fatal.
    replacement: Callable[[str], Outgoing] | None = field(default=None, repr=False, compare=False)
    # Sent in a batch of its own: the broker refused a batch it shared, and it may fit alone (the broker judges
    # a whole batch). Only a record refused alone is replaced.
    alone: bool = field(default=False, repr=False, compare=False)


class Fit(NamedTuple):
    """How large a record is, and whether it fits its topic."""

    fits: bool
    uncompressed: int  # the record as the producer sizes it (before compression)
    on_wire: int  # what the broker counts: the compressed batch (the uncompressed one without compression)
    limit: int  # the topic's max.message.bytes
    reason: str = ""  # why it does not fit, naming the limit and its knob


class RecordFit(Protocol):
    """Whether a record of this topic, key, value and headers fits what the topic accepts."""

    def __call__(self, topic: str, key: bytes | None, value: bytes,
                 headers: Sequence[tuple[str, bytes]] = HEADERS) -> Fit: ...


Headers = list[tuple[str, bytes]]


class Framing(Protocol):
    """A sink's own format for the records of some topics (``kafka/registry.py``: a Schema Registry's wire
    format): an event's value and headers, or None for a topic it leaves to JSON."""

    def write(self, topic: str, event: msgspec.Struct, headers: Headers) -> tuple[bytes, Headers] | None: ...


class RecordWriter:
    """How an event becomes a record's value and headers: the contract's JSON, unless the framing chosen at
    start (``answer_format``) writes the topic's records its own way. Built before the sink starts and shared by
    a worker's answer builders, which size what it writes: the bytes checked against a topic's limit are the
    bytes sent."""

    def __init__(self) -> None:
        self.framing: Framing | None = None

    def __call__(self, topic: str, event: msgspec.Struct, headers: Headers) -> tuple[bytes, Headers]:
        framing = self.framing
        if framing is not None:
            written = framing.write(topic, event, headers)
            if written is not None:
                return written
        return encode(event), headers
