"""Records framed by a Schema Registry: requests read in Confluent's wire format, answers written in it.

Many Kafka estates do not carry plain JSON: a producer serializes through a Schema Registry, and each record
value is a magic byte 0, the 4-byte id of the writer's schema, then the Avro (or JSON Schema) payload.
Downstream, Connect sinks and Avro consumers read a topic only through its registered schema.

**In.** A request record that starts with the magic byte is decoded with its writer schema, fetched from the
registry once per id and kept. Avro payloads become the request's JSON document (``d3stream_client.avro``:
free-form values travel as JSON text); JSON Schema payloads are JSON already. The document then goes through
exactly the checks and limits of a plain JSON request (``decode_request``), so a framed request can be refused
for nothing a JSON one could not. A record without the magic byte is read as JSON, so one topic may carry
both during a migration. An id the registry does not know is answered ``schema_not_found`` (and
dead-lettered, naming the id); a payload its schema cannot read is ``invalid_request``.

**A registry that is down or slow is not the request's fault.** Looking up an id waits and retries with
backoff (up to ``schema_registry_backoff_max_s``) for as long as it takes: the fetch that needs it waits, its
partition's offsets stay uncommitted, ``/readyz`` says why, ``d3stream_registry_faults_total`` counts the
attempts, and no request is dead-lettered for it.

**Out.** With ``answer_format`` avro or json_schema, answers and dead letters are written in the wire
format under the subject the naming strategy gives. At start the contract's schema is registered
(``schema_auto_register``, the demo), or else the subject's latest registered version is written with
(production, as Confluent's ``use.latest.version``; a version that adds a field with a default is used as it
is): a schema the registry refuses, a subject with none, or a latest version that requires a field the event
does not carry stops the worker at start with the reason, instead of failing record by record. A registry that does not answer at start is waited for as in an outage (the worker
is not ready meanwhile, and ``/readyz`` says why): a worker may start before its registry does.

confluent-kafka's ``schema_registry`` module is the registry client (its asyncio one, so lookups never block
the loop). The Avro codec is ``d3stream_client.registry.AvroCodec``: code compiled once per writer schema and
event writes and reads the records, fastavro behind it for anything else, so the registry's cost stays near
a tenth of the Kafka path (``d3stream bench kafka``). Answers are written from their Structs as the answer
builders make them (``OutgoingFormat.write``, the worker's ``core.outgoing.Framing``), so the size checked
against a topic's limit is the size sent; requests are read into lean documents (defaults left out, JSON text
as it came) that the request checks parse once. The framing, the subject names, the registry client's
configuration and the registered JSON Schema form are the client's (``d3stream_client.registry``,
``d3stream_client.schemas``), which writes requests and reads answers the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import fastavro
import msgspec
import structlog
from confluent_kafka.schema_registry import AsyncSchemaRegistryClient, Schema, SchemaRegistryError
from d3stream_client import avro, writer_schemas
from d3stream_client.avro_binary import PayloadError
from d3stream_client.contract import HEADERS, Answer, DeadLetter, Request, encode
from d3stream_client.registry import (
    AVRO,
    CONTENT_TYPES,
    FRAME,
    JSON_SCHEMA,
    AvroCodec,
    frame,
    is_framed,
    parse_avro_schema,
    record_name,
    registry_client_config,
    subject_name,
)
from d3stream_client.schemas import registry_json_schema
from d3stream_client.validation import TOO_DEEP, EventError
from d3stream_client.writer_schemas import SchemaRefused, admit

from d3stream.core.seams import InputRecord
from d3stream.ops.metrics import Metrics
from d3stream.settings import DeliverySettings, ModelSettings, RegistrySettings

log = structlog.get_logger(__name__)
T = TypeVar("T")



def client_config(settings: RegistrySettings) -> dict[str, object]:
    """confluent-kafka's registry client configuration from the registry settings (the client's own
    ``registry_client_config``, so a worker and a client configure it alike)."""
    assert settings.schema_registry_url is not None
    auth, token = settings.schema_registry_basic_auth, settings.schema_registry_bearer_token
    return registry_client_config(
        settings.schema_registry_url, timeout_s=settings.schema_registry_timeout_s,
        basic_auth=auth.reveal() if auth is not None else None,
        bearer_token=token.reveal() if token is not None else None,
        ssl_cafile=settings.schema_registry_ssl_cafile, ssl_certfile=settings.schema_registry_ssl_certfile,
        ssl_keyfile=settings.schema_registry_ssl_keyfile,
        max_retries=0,  # this module retries with its own backoff, for as long as the registry is down
    )


class SchemaNotFound(Exception):
    """The registry answered that it has no schema of this id."""


class _Refused(Exception):
    """Why a framed record cannot be read: its refusal's code and reason (the request id is its reader's), and
    whether the record also goes to the dead-letter topic (its schema was refused: whoever writes with it must
    see it there, not only the requester)."""

    def __init__(self, code: str, message: str, *, dead_letter: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.dead_letter = dead_letter


Read = Callable[[bytes], bytes]  # a framed record value -> its JSON document; _Refused when it cannot be read


@dataclass(frozen=True)
class _Refusal:
    """The reader of records that are refused whatever their payload."""

    code: str
    message: str
    dead_letter: bool = False

    def __call__(self, value: bytes) -> bytes:
        raise _Refused(self.code, self.message, dead_letter=self.dead_letter)


def _refuse(code: str, message: str, *, dead_letter: bool = False) -> Read:
    return _Refusal(code, message, dead_letter)


# How many writer schemas (admitted or refused) a worker keeps by id, how many ids the registry did not know it
# remembers (each for schema_registry_unknown_id_ttl_s), and how many lookups run at once. Beyond these a
# schema is fetched again: a flood of distinct ids costs lookups, not memory.
KNOWN_SCHEMAS = 256
UNKNOWN_IDS = 4_096
LOOKUPS_AT_ONCE = 16


@dataclass
class WriterSchema:
    """A writer schema as the registry gave it, and what was decided of it: a reader for each event read with
    it (once admitted, ``writer_schemas.admit``) or the refusal, and whether it is registered under a subject of
    each topic it frames records of."""

    schema_id: int
    kind: str
    text: str
    refusal: Read | None = None  # the registry refused to give it: every record framed with it is refused
    readers: dict[type[msgspec.Struct], Read] = field(default_factory=dict, repr=False)
    # (topic, event) -> None when registered under a subject of the topic, or why not
    places: dict[tuple[str, type[msgspec.Struct]], str | None] = field(default_factory=dict, repr=False)

    def reader(self, event: type[msgspec.Struct]) -> Read:
        """How records of ``event`` framed with this schema are read: decided once per event."""
        if self.refusal is not None:
            return self.refusal
        known = self.readers.get(event)
        if known is None:
            known = self.readers[event] = self._decide(event)
        return known

    def admitted(self, event: type[msgspec.Struct]) -> bool:
        """Whether records of ``event`` are read with this schema (not refused whatever subject holds it)."""
        return not isinstance(self.reader(event), _Refusal)

    def _decide(self, event: type[msgspec.Struct]) -> Read:
        schema_id = self.schema_id
        if self.kind == JSON_SCHEMA:
            return functools.partial(_read_json_schema, schema_id=schema_id)
        if self.kind != AVRO:
            return _refuse("invalid_request", f"the record is framed with a {self.kind} schema (id {schema_id}); "
                           "records are read as JSON, Avro or JSON Schema", dead_letter=True)
        try:
            parsed = admit(self.text, event)
        except SchemaRefused as exc:
            return _refuse("invalid_request", f"the writer schema of id {schema_id} is not admitted for "
                           f"{event.__name__} records: {exc} (docs/REGISTRY.md says what a writer schema must be)",
                           dead_letter=True)
        return functools.partial(_read_avro, codec=AvroCodec(parsed, event), schema_id=schema_id)


def _read_avro(value: bytes, *, codec: AvroCodec, schema_id: int) -> bytes:
    try:
        return codec.read(value, FRAME.size, lean=True)  # decoded next: defaults need not travel
    except PayloadError as exc:
        if exc.too_deep:  # refused as the same nesting is in a plain JSON request
            raise _Refused("invalid_request", TOO_DEEP) from exc
        raise _Refused("invalid_request", f"the payload does not match its Avro schema (id {schema_id}): "
                       f"{exc}") from exc


def _read_json_schema(value: bytes, *, schema_id: int) -> bytes:
    """A JSON Schema frame's payload, which must be JSON: the request's checks read it next, as a plain one's."""
    payload = value[FRAME.size:]
    try:
        _RAW_JSON(payload)
    except RecursionError:
        pass  # too deep to check here: the request's checks refuse it with the nesting limit's message
    except msgspec.DecodeError as exc:
        what = "empty" if not payload else f"not JSON ({exc})"
        raise _Refused("invalid_request", f"the payload of a record framed with the JSON Schema of id {schema_id} "
                       f"is {what}") from exc
    return payload


_RAW_JSON = msgspec.json.Decoder(msgspec.Raw).decode


@dataclass
class RegistryHealth:
    """Whether the registry answers, for ``/readyz`` and the metrics."""

    outage: str | None = None  # why the last lookup failed, while it keeps failing
    faults: int = 0  # lookups that failed for the registry's sake (not a request's)


@dataclass(slots=True)  # one per framed record read: not frozen, whose __init__ costs three times as much
class UnframedRecord:
    """A framed request record as the pipeline reads it: its JSON document (``value``), or the refusal that
    ends it (``unreadable``, with ``value`` the record's own bytes, which a dead letter keeps)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] | None
    unreadable: EventError | None = None
    dead_letter: bool = False  # the refusal is dead-lettered too (a refused writer schema), whatever its code


class Registry:
    """The worker's registry connection: writer schemas by id (a bounded number kept once fetched and decided),
    and the schemas it writes."""

    def __init__(self, settings: RegistrySettings, *, metrics: Metrics | None = None,
                 client: AsyncSchemaRegistryClient | None = None, max_record_bytes: int | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        # A framed request longer than a plain one may be is not read (max_request_bytes): Avro is denser than
        # JSON, and its reading costs memory in proportion to its bytes.
        self.max_record_bytes = max_record_bytes
        self.client = client or AsyncSchemaRegistryClient(client_config(settings))
        self.health = RegistryHealth()
        self._known: OrderedDict[int, WriterSchema] = OrderedDict()
        self._unknown: OrderedDict[int, float] = OrderedDict()  # id -> when the registry is asked again
        self._pending: dict[tuple[object, ...], asyncio.Future[object]] = {}
        self._lookups = asyncio.Semaphore(LOOKUPS_AT_ONCE)
        self._fetched = 0  # schemas fetched since the client's own cache (unbounded) was last emptied
        self._closing = False

    def close(self) -> None:
        """Stop waiting for the registry: a lookup still retrying is given up (the worker is shutting down, and
        the records waiting on it stay uncommitted for the partition's next owner)."""
        self._closing = True

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called: a CancelledError out of a lookup then means a wait given up."""
        return self._closing

    async def aclose(self) -> None:
        """Give up any wait and close the registry client's HTTP connections (the worker has stopped)."""
        self.close()
        with contextlib.suppress(Exception):  # closing what may never have connected
            await self.client.aclose()

    # ------------------------------------------------------------------------------ in: requests

    async def unframe(self, records: Sequence[InputRecord], event: type[msgspec.Struct] = Request) -> list[InputRecord]:
        """The records as a JSON reader reads them: framed ones decoded into their ``event`` documents (a request,
        or an answer for the evaluator), the rest as they are. The schemas the fetch needs are looked up at
        once, each distinct id concurrently. Waits while the registry is down (never refuses a record for it)."""
        ready, waiting = self.unframe_known(records, event)
        if not waiting:
            return ready
        read = {(each.topic, each.partition, each.offset): each
                for each in (*ready, *await self.unframe_looked_up(waiting, event))}
        return [read[(record.topic, record.partition, record.offset)] for record in records]

    def unframe_known(self, records: Sequence[InputRecord],
                      event: type[msgspec.Struct] = Request) -> tuple[list[InputRecord], list[InputRecord]]:
        """The records that can be read now (plain ones, and framed ones whose schema ids are known), read; and
        those whose ids must be looked up first, as they came. A worker answers the first while the second's
        lookups run, so that a flood of new ids delays no record whose id is known."""
        readers: dict[tuple[str, int], Read | None] = {}
        ready: list[InputRecord] = []
        waiting: list[InputRecord] = []
        for record in records:
            value = record.value
            if value is None or not is_framed(value):
                ready.append(record)
                continue
            wanted = (record.topic, FRAME.unpack_from(value)[1])
            if wanted not in readers:
                readers[wanted] = self._known_reader(*wanted, event)
            read = readers[wanted]
            if read is None:
                waiting.append(record)
            else:
                ready.append(_unframed(record, value, self._bounded(read, value)))
        return ready, waiting

    async def unframe_looked_up(self, records: Sequence[InputRecord],
                                event: type[msgspec.Struct] = Request) -> list[InputRecord]:
        """Framed records read once their schema ids are looked up: each distinct id once, concurrently."""
        wanted = sorted({(record.topic, FRAME.unpack_from(record.value)[1]) for record in records
                         if record.value is not None})
        found = await asyncio.gather(*(self._reader(topic, schema_id, event) for topic, schema_id in wanted))
        readers = dict(zip(wanted, found, strict=True))
        unframed: list[InputRecord] = []
        for record in records:
            value = record.value
            assert value is not None  # framed (unframe_known)
            read = readers[(record.topic, FRAME.unpack_from(value)[1])]
            unframed.append(_unframed(record, value, self._bounded(read, value)))
        return unframed

    def _bounded(self, read: Read, value: bytes) -> Read:
        """``read``, unless the record is over max_request_bytes: then its refusal, as a plain request's."""
        limit = self.max_record_bytes
        if limit is None or len(value) <= limit or isinstance(read, _Refusal):
            return read
        return _refuse("invalid_request", f"the record is {len(value):,} bytes, over max_request_bytes ({limit:,}); "
                       "it was not read")

    def _subjects(self, topic: str, event: type[msgspec.Struct], writer: WriterSchema) -> list[str]:
        """The subjects that speak for ``topic``: the worker's own strategy's, and the two that name the topic
        (``<topic>-value``, ``<topic>-<record>``), so a producer using either topic strategy is read. The record
        is the event's, or the name the writer schema gives itself (a JSON Schema's title)."""
        subjects = [subject_name(self.settings.subject_name_strategy, topic, record_name(event)),
                    subject_name("topic", topic, "")]
        for name in (record_name(event), writer_schemas.schema_name(writer.text)):
            if name:
                subjects.append(subject_name("topic_record", topic, name))
        return list(dict.fromkeys(subjects))

    def _known_reader(self, topic: str, schema_id: int, event: type[msgspec.Struct]) -> Read | None:
        """The reader of ``schema_id`` for ``topic`` when everything about it is known already; else None."""
        writer = self._known.get(schema_id)
        if writer is None:
            until = self._unknown.get(schema_id)
            return _not_found(schema_id) if until is not None and until > time.monotonic() else None
        self._known.move_to_end(schema_id)
        if self._needs_subject(writer, event) and (topic, event) not in writer.places:
            return None
        return self._placed(writer, topic, event)

    async def _reader(self, topic: str, schema_id: int, event: type[msgspec.Struct]) -> Read:
        writer = await self._writer(schema_id)
        if not isinstance(writer, WriterSchema):
            return writer
        if self._needs_subject(writer, event) and (topic, event) not in writer.places:
            await self._once(("subject", schema_id, topic, event), lambda: self._check_place(writer, topic, event))
        return self._placed(writer, topic, event)

    def _needs_subject(self, writer: WriterSchema, event: type[msgspec.Struct]) -> bool:
        """Whether the subjects holding ``writer`` decide: a schema refused for what it is (checked first, here,
        with no request to the registry) is refused wherever it is registered."""
        return self.settings.schema_registry_require_subject and writer.admitted(event)

    def _placed(self, writer: WriterSchema, topic: str, event: type[msgspec.Struct]) -> Read:
        """The writer schema's reader, or the refusal of a schema not registered under a subject of the topic."""
        reason = writer.places.get((topic, event)) if self._needs_subject(writer, event) else None
        if reason is not None:
            return _refuse("invalid_request", f"the writer schema of id {writer.schema_id} is not registered under "
                           f"a subject of topic {topic!r} ({reason}): register it there, or set "
                           "schema_registry_require_subject false to read any id the registry knows", dead_letter=True)
        return writer.reader(event)

    async def _once(self, key: tuple[object, ...], make: Callable[[], Awaitable[T]]) -> T:
        """``make()`` run once for all who ask for ``key`` at the same time (two fetches needing one new id make
        one lookup); a waiter given up does not cancel it for the others."""
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(make())
            pending.add_done_callback(functools.partial(_settled, self._pending, key))
        return await asyncio.shield(pending)  # type: ignore[arg-type]

    async def _writer(self, schema_id: int) -> WriterSchema | Read:
        """The writer schema of ``schema_id`` (fetched once, and kept while it is among the last KNOWN_SCHEMAS
        used), or the reader refusing what is framed with it: an id the registry does not know (asked again
        after schema_registry_unknown_id_ttl_s). Retried with backoff while the registry fails."""
        known = self._known.get(schema_id)
        if known is not None:
            return known
        until = self._unknown.get(schema_id)
        if until is not None and until > time.monotonic():
            return _not_found(schema_id)
        return await self._once(("schema", schema_id), lambda: self._look_up(schema_id))

    async def _look_up(self, schema_id: int) -> WriterSchema | Read:
        async with self._lookups:
            try:
                schema = await self._until_answered(f"schema id {schema_id}", lambda: self._fetch(schema_id),
                                                    answer=_answered)
            except SchemaNotFound:
                self._unknown[schema_id] = time.monotonic() + self.settings.schema_registry_unknown_id_ttl_s
                self._unknown.move_to_end(schema_id)
                while len(self._unknown) > UNKNOWN_IDS:
                    self._unknown.popitem(last=False)
                return _not_found(schema_id)
            except SchemaRegistryError as exc:  # another refusal of the registry's: remembered like a schema
                message = (f"the Schema Registry refused to give schema id {schema_id}: {exc.error_message} "
                           f"(HTTP {exc.http_status_code})")
                writer = WriterSchema(schema_id, "refused", "",
                                      refusal=_refuse("invalid_request", message, dead_letter=True))
                self._keep(writer)
                return writer
        self._unknown.pop(schema_id, None)
        self._keep(schema)
        return schema

    def _keep(self, writer: WriterSchema) -> None:
        self._known[writer.schema_id] = writer
        while len(self._known) > KNOWN_SCHEMAS:
            self._known.popitem(last=False)

    async def _check_place(self, writer: WriterSchema, topic: str, event: type[msgspec.Struct]) -> None:
        """Whether ``writer`` is registered under a subject of ``topic``: a lookup of its text under each (the
        registry's own answer, normalised as it normalises), until one holds it; remembered on the writer."""
        reasons = []
        for subject in self._subjects(topic, event, writer):
            async with self._lookups:
                try:
                    found = await self._until_answered(
                        f"schema id {writer.schema_id} under subject {subject!r}",
                        functools.partial(self.client.lookup_schema, subject, Schema(writer.text, writer.kind)),
                        answer=_refusal)
                except SchemaRegistryError as exc:
                    reasons.append(f"{subject}: {exc.error_message} (HTTP {exc.http_status_code})")
                    continue
            if found.schema_id == writer.schema_id:
                writer.places[(topic, event)] = None
                return
            reasons.append(f"{subject}: holds it as schema id {found.schema_id}")
        writer.places[(topic, event)] = "; ".join(reasons)

    async def _until_answered(self, what: str, call: Callable[[], Awaitable[T]],
                              answer: Callable[[Exception], bool]) -> T:
        """``call()`` until the registry answers. A failure that ``answer`` accepts is the registry's answer and
        is raised; any other (unreachable, timed out, a server error) is an outage: counted, said by
        ``/readyz``, retried with backoff up to ``schema_registry_backoff_max_s``, given up at shutdown."""
        delay = 0.2
        while True:
            try:
                result = await call()
            except Exception as exc:  # noqa: BLE001 - sorted below: the registry's answer, or its fault
                if answer(exc):
                    raise
                if self._closing:
                    raise asyncio.CancelledError(f"shutting down while the registry is down: {exc}") from exc
                self.health.faults += 1
                if self.metrics is not None:
                    self.metrics.registry_faults.inc()
                reason = f"the Schema Registry did not answer for {what}: {describe(exc)}"
                if self.health.outage is None:
                    log.warning("registry.unavailable", reason=reason, retry_s=delay,
                                setting="schema_registry_url" if self.health.faults == 1 else None)
                self.health.outage = reason
                await self._wait_out(delay)
                delay = min(delay * 2, self.settings.schema_registry_backoff_max_s)
                continue
            if self.health.outage is not None:
                log.info("registry.back", what=what)
            self.health.outage = None
            return result

    async def _wait_out(self, delay: float) -> None:
        """Sleep ``delay`` seconds before the next try, cut short when the worker shuts down (in slices, since
        :meth:`close` may be called from a signal handler, outside the event loop)."""
        deadline = time.monotonic() + delay
        while not self._closing and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))
        if self._closing:
            raise asyncio.CancelledError("shutting down while the Schema Registry is down")

    async def _fetch(self, schema_id: int) -> WriterSchema:
        """The registry's schema of ``schema_id``: its text and type, nothing parsed yet (admission decides)."""
        try:
            schema = await self.client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise SchemaNotFound(f"the Schema Registry has no schema with id {schema_id}") from exc
            raise
        self._fetched += 1
        if self._fetched >= KNOWN_SCHEMAS:  # the client keeps every schema it fetched; ours are bounded
            self._fetched = 0
            with contextlib.suppress(AttributeError):  # a private cache, cleared when this client version has it
                self.client._cache.clear()  # noqa: SLF001
        return WriterSchema(schema_id, schema.schema_type or AVRO, schema.schema_str or "")

    # ------------------------------------------------------------------------------ out: answers

    async def writers_for(self, topics: Mapping[str, type[msgspec.Struct]]) -> OutgoingFormat:
        """The schema each topic's records are written with (``topics``: topic -> the event it carries): the
        contract's, registered now (``schema_auto_register``), or else the latest version registered under the
        subject (Confluent's ``use.latest.version``: production registers ahead, and a compatible later version,
        such as one with a field added with a default, is written as it is). RuntimeError naming the subject
        and the reason when the registry refuses the schema or has none, or when its latest version cannot
        carry the event: the worker stops at start."""
        chosen = self.settings.answer_format
        ids: dict[str, tuple[int, type[msgspec.Struct]]] = {}
        writers: dict[str, dict[str, object]] = {}
        for topic, event in topics.items():
            subject = subject_name(self.settings.subject_name_strategy, topic, record_name(event))
            schema = outgoing_schema(event, chosen)
            try:
                schema_id, written = await self._until_answered(
                    f"the {event.__name__} schema under subject {subject!r}",
                    functools.partial(self._writer_schema, subject, schema), answer=_refusal)
            except SchemaRegistryError as exc:
                action = "refused to register" if self.settings.schema_auto_register else "does not have"
                hint = ("register it first (d3stream schemas register), or set schema_auto_register"
                        if not self.settings.schema_auto_register else
                        "the registry's compatibility check keeps the change out: make it compatible or "
                        "choose another subject (subject_name_strategy)")
                raise RuntimeError(f"the Schema Registry {action} the {event.__name__} schema ({chosen}) under "
                                   f"subject {subject!r}: {exc.error_message} (HTTP {exc.http_status_code}); "
                                   f"{hint}") from exc
            if chosen == "avro":
                writers[topic] = _writable(written, event, subject)
            elif written.schema_type != JSON_SCHEMA:
                raise RuntimeError(f"the latest schema under subject {subject!r} is {written.schema_type}, not "
                                   f"the JSON Schema answer_format json_schema writes: register it (d3stream schemas "
                                   "register), or choose answer_format avro")
            ids[topic] = (schema_id, event)
            log.info("registry.writer", topic=topic, subject=subject, schema_id=schema_id, format=chosen)
        return OutgoingFormat(chosen, ids, writers)

    async def _writer_schema(self, subject: str, schema: Schema) -> tuple[int, Schema]:
        """The id and schema a subject's records are written with: the contract's, registered now, or the
        latest version under the subject."""
        if self.settings.schema_auto_register:
            return await self.client.register_schema(subject, schema), schema
        latest = await self.client.get_latest_version(subject)
        return latest.schema_id or 0, latest.schema or schema


def _writable(schema: Schema, event: type[msgspec.Struct], subject: str) -> dict[str, object]:
    """fastavro's parsed form of a registered Avro schema that the event's records can be written with: each of
    its fields is one the contract fills, or has a default. RuntimeError naming the fields otherwise."""
    if (schema.schema_type or AVRO) != AVRO:
        raise RuntimeError(f"the latest schema under subject {subject!r} is {schema.schema_type}, not the Avro "
                           "answer_format avro writes: register it (d3stream schemas register), or choose "
                           "answer_format json_schema")
    try:
        parsed = parse_avro_schema(schema.schema_str or "")
    except ValueError as exc:
        raise RuntimeError(f"the latest schema under subject {subject!r} is not a valid Avro schema: {exc}") from exc
    contract_fields = avro.avro_schema(event)["fields"]
    assert isinstance(contract_fields, list)  # an event's schema is a record
    ours = {field["name"] for field in contract_fields}
    fields = parsed.get("fields") if isinstance(parsed, dict) else None
    if not isinstance(parsed, dict) or not isinstance(fields, list):
        raise RuntimeError(f"the latest schema under subject {subject!r} is not an Avro record")
    missing = [field["name"] for field in fields if field["name"] not in ours and "default" not in field]
    if missing:
        raise RuntimeError(f"the latest schema under subject {subject!r} requires {', '.join(missing)}, which a "
                           f"{event.__name__} does not carry: give them defaults, or register the contract's schema "
                           "(d3stream schemas register)")
    return parsed


def _refusal(exc: Exception) -> bool:
    """Whether the registry refused a request (a 4xx answer) rather than failing to answer it."""
    return isinstance(exc, SchemaRegistryError) and 400 <= exc.http_status_code < 500


def outgoing_schema(event: type[msgspec.Struct], chosen: str) -> Schema:
    """The schema an event is written with, generated from the contract."""
    if chosen == "avro":
        return Schema(json.dumps(avro.avro_schema(event)), AVRO)
    return Schema(json.dumps(registry_json_schema(event)), JSON_SCHEMA)


@dataclass
class OutgoingFormat:
    """Writes records of the chosen topics in the registry's wire format, each with its topic's schema: a
    worker's answers and dead letters (``write``, its ``core.outgoing.Framing``), an evaluator's records
    (``encode``)."""

    chosen: str
    schemas: dict[str, tuple[int, type[msgspec.Struct]]]  # topic -> its schema id and event
    # topic -> fastavro's parsed form of the Avro schema it is written with (default: the contract's)
    writers: dict[str, dict[str, object]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # topic -> its frame (the magic byte and schema id) and, for Avro, the codec of its event and schema
        self._codecs: dict[str, tuple[bytes, AvroCodec | None]] = {}
        for topic, (schema_id, event) in self.schemas.items():
            codec = None
            if self.chosen == "avro":
                if topic not in self.writers:
                    parsed = fastavro.parse_schema(avro.avro_schema(event))
                    assert isinstance(parsed, dict)  # every event is a record
                    self.writers[topic] = parsed
                codec = AvroCodec(self.writers[topic], event)
            self._codecs[topic] = (frame(schema_id, b""), codec)
        content_type = CONTENT_TYPES[self.chosen]
        self._headers = {id(HEADERS): self._framed_headers(HEADERS, content_type)}
        self._content_type = content_type

    def write(self, topic: str, event: msgspec.Struct,
              headers: list[tuple[str, bytes]]) -> tuple[bytes, list[tuple[str, bytes]]] | None:
        """An event's record value and headers in the wire format (``core.outgoing.Framing``), written from the
        event itself; None for a topic not written through the registry."""
        known = self._codecs.get(topic)
        if known is None:
            return None
        framing, codec = known
        value = framing + (codec.write(event) if codec is not None else encode(event))
        return value, self.headers(headers)

    def headers(self, headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The record's headers with its content type saying the format."""
        known = self._headers.get(id(headers))
        if known is not None:
            return known
        return self._framed_headers(headers, self._content_type)

    @staticmethod
    def _framed_headers(headers: Sequence[tuple[str, bytes]], content_type: bytes) -> list[tuple[str, bytes]]:
        return [(name, content_type if name == "content-type" else value) for name, value in headers]

    def encode(self, topic: str, value: bytes, event: msgspec.Struct | None = None) -> bytes:
        """A JSON event value of ``topic`` (or the event it encodes) in the wire format (unchanged for a topic
        written as JSON)."""
        known = self._codecs.get(topic)
        if known is None:
            return value
        framing, codec = known
        if codec is None:
            return framing + value
        return framing + codec.write(event if event is not None else msgspec.json.decode(value))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _unframed(record: InputRecord, value: bytes, read: Read) -> UnframedRecord:
    """A framed record read with ``read``: its document, or the refusal that ends it."""
    try:
        document = read(value)
    except _Refused as refused:
        request_id = record.key.decode("utf-8", "replace") if record.key else None
        return UnframedRecord(record.topic, record.partition, record.offset, record.timestamp, record.key, value,
                              record.headers, unreadable=EventError(refused.code, refused.message, request_id),
                              dead_letter=refused.dead_letter)
    return UnframedRecord(record.topic, record.partition, record.offset, record.timestamp, record.key, document,
                          record.headers)


def _not_found(schema_id: int) -> Read:
    return _refuse("schema_not_found", f"the Schema Registry has no schema with id {schema_id}; the record is "
                   f"framed for it (magic byte 0, schema id {schema_id})")


def _answered(exc: Exception) -> bool:
    """Whether a failed schema lookup is the registry's answer (it has no such id, or refused the request with
    another 4xx) rather than its fault (unreachable, timed out, a 5xx): only a fault is an outage."""
    return isinstance(exc, SchemaNotFound) or _refusal(exc)


def _settled(pending: dict[tuple[object, ...], asyncio.Future[object]], key: tuple[object, ...],
             done: asyncio.Future[object]) -> None:
    """A lookup ended: it is no longer pending, and its exception (a shutdown's) counts as retrieved, since
    every waiter may have been given up before it ended."""
    pending.pop(key, None)
    if not done.cancelled():
        done.exception()


def framed_topics(delivery: DeliverySettings, models: ModelSettings) -> dict[str, type[msgspec.Struct]]:
    """The topics a worker writes in the registry's wire format, and the event each carries."""
    topics: dict[str, type[msgspec.Struct]] = {delivery.answer_topic: Answer, delivery.dead_letter_topic: DeadLetter}
    if models.shadow_topic:
        topics[models.shadow_topic] = Answer
    return topics
