"""The typed seams between d3stream's parts: what each part needs of the others, and nothing more.

A worker is four parts joined at these seams (docs/ARCHITECTURE.md draws them):

* the **request pipeline** (``pipeline.py``) turns records into answers; it sees the model only as a
  ``DecisionModel`` and the records only as ``InputRecord`` (no Kafka in it);
* the **consume loop** (``consume.py``) reads records from Kafka under a ``ReadPolicy`` (the live stream,
  or a replay's range) and hands them to the pipeline a fetch at a time;
* a **sink** (``sinks.py``) is where answers go: Kafka topics, or a JSON-lines file;
* a **commit policy** (``commits.py``) decides when a consumed offset is committed: in one transaction with
  its answers, or once its answers are durably written. A delivery mode is a registered (sink, commit
  policy) pair (``commits.DELIVERY_MODES``).

Each seam is a ``typing.Protocol``: a part is whatever has these members, so a test's stand-in model or a
new sink needs no base class, and the type checker (mypy, ``make lint``) checks every use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from d3stream.runtime import Prepared, Row

if TYPE_CHECKING:
    import torch

# ------------------------------------------------------------------------------------------- records


class InputRecord(Protocol):
    """One request as read from a topic: an aiokafka ``ConsumerRecord`` is one, so is any object with
    these attributes (the pipeline's tests build them without a broker). A record that a framing layer
    could not read (kafka/registry.py) also has ``unreadable``, the ``EventError`` it is answered with."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]] | None: ...


# Where a request was read: (topic, partition, offset). Schedulers that order passes by the source
# (deterministic replays) are handed it with each request's rows.
Position = tuple[str, int, int]


def position_of(record: InputRecord) -> Position:
    return (record.topic, record.partition, record.offset)


# ----------------------------------------------------------------------------------------------- model


class DecisionModel(Protocol):
    """What the service needs of a model (``runtime.model.D3`` is one; so is the benchmark's null model)."""

    # Read-only here: a plain attribute or a property satisfies each.
    @property
    def model_name(self) -> str: ...
    @property
    def device(self) -> torch.device | str:
        """Where its passes run; ``str`` of it names the device (``cpu``, ``cuda:0``)."""
        ...
    @property
    def attention_mode(self) -> str:
        """"causal" lets a request's questions share one prefix pass (runtime/prefix.py); anything else does not."""
        ...
    @property
    def image_unavailable(self) -> str | None:
        """Why image inputs cannot be answered (None: they can)."""
        ...
    @property
    def video_unavailable(self) -> str | None:
        """Why video inputs cannot be answered (None: they can)."""
        ...

    def provenance(self) -> Mapping[str, object]: ...

    def kernel_record(self) -> dict[str, str]:
        """Which kernels its passes run (``path`` and one implementation per op); empty if it has none."""
        ...

    def limit_prompt_tokens(self, limit: int | None) -> None: ...

    def limit_request_tokens(self, limit: int | None) -> None: ...

    def request_may_exceed_tokens(self, record_bytes: int, questions: int) -> bool:
        """A cheap bound: whether a request this large could be over the request token limit."""
        ...

    def check_request_tokens(self, state: object, questions: Mapping[str, object], *,
                             permutation_average: bool | None = None) -> None:
        """Raise ``ValueError`` if the request's prompts are certainly over the request token limit."""
        ...

    def prepare(
        self,
        state: object,
        questions: Mapping[str, object],
        *,
        # The runtime takes list[Image.Image] and list[Video], a stand-in model (the benchmark's) lists of anything:
        # list is invariant, so only an untyped element fits both.
        decoded_images: list[Any] | None = None,
        decoded_videos: list[Any] | None = None,
        permutation_average: bool | None = None,
    ) -> Prepared: ...

    def forward(self, rows: Sequence[Row]) -> list[list[float]]: ...


# ---------------------------------------------------------------------------------------------- output

# "shadow": a shadow model's answer, to the shadow topic (shadow.py); a file sink keeps "answer" records only.
RecordKind = Literal["answer", "dead_letter", "provenance", "shadow"]


# ------------------------------------------------------------------------------------------- in flight


@dataclass
class InFlight:
    """Work read and not yet answered: what backpressure bounds (``max_inflight_requests`` / ``_tokens``)."""

    requests: int = 0
    questions: int = 0
    tokens: int = 0
    # Of those, requests held by their tenant's quota and their tokens (quotas.py): not counted against the
    # worker-wide limits, since they are bounded by the pause of their partitions instead.
    held_requests: int = 0
    held_tokens: int = 0


# ------------------------------------------------------------------------------------------ scheduling


@dataclass(frozen=True)
class Scheduling:
    """How a request's rows are scheduled (docs/SCHEDULING.md): its lane (0 is the highest; ``events.PRIORITIES``
    names them) and its deadline (epoch seconds; None: none). A scheduler that cannot use them ignores them."""

    lane: int = 1
    deadline: float | None = None


DEFAULT_SCHEDULING = Scheduling()


class DeadlineExceeded(Exception):  # it names the answer's error code
    """A request's deadline passed before a pass carried its rows: they were dropped, not run."""

    def __init__(self, late_seconds: float):
        self.late_ms = max(0, round(late_seconds * 1000.0))
        super().__init__(f"the request's deadline passed {self.late_ms:,} ms before a forward pass could carry it")
