"""Requests written in a Schema Registry's wire format, answers and dead letters read in it: the client's side
of a site whose topics carry registered schemas. Needs ``pip install 'd3stream-client[registry]'``.

Confluent's wire format is a zero byte, the 4-byte big-endian id of the writer's schema, then the payload:
Avro binary, or the JSON text for a JSON Schema. A worker with ``schema_registry_url`` reads such requests
beside plain JSON ones, and with ``answer_format`` avro or json_schema writes its answers and dead letters
that way. :class:`RegistryFormat` is what ``Publisher``, ``D3Client`` and the answer readers take
(``registry=``) to do the same from the other side:

* **Out: requests.** A request is checked first, exactly as without a registry (``validate_request``: the
  worker's refusals, raised before anything is sent), then its JSON document is written in the chosen
  ``request_format``. The schema is the contract's (``avro.avro_schema(Request)``, or
  ``schemas.registry_json_schema(Request)``), under the subject the naming strategy gives for the topic;
  registered on first use with ``schema_auto_register=True``, otherwise looked up, and a schema the registry
  does not have (or refuses) is a :class:`RegistryError` naming the subject, before anything is sent.
* **In: answers and dead letters.** A framed value is decoded with its writer schema, fetched by id once and
  kept; which event an Avro record is comes from the writer schema's record name (``d3stream.v2.Answer``), so
  one reader serves answer and dead-letter topics alike. A value without the magic byte is plain JSON and
  passes as it is, so a topic that carries both (a worker switched to Avro mid-stream) reads whole. A framed
  value nobody can read (an id the registry does not know, a payload its schema cannot read, a Protobuf
  schema) is an :class:`UnreadableRecord`; a registry that does not answer is whatever the registry client
  raised, so a reader can wait for it rather than skip the record.

Why the registry client plus fastavro rather than confluent-kafka's ``AvroSerializer`` / ``JSONSerializer``:
the request is written from the very bytes the checks passed (the JSON serializer would encode the document
again, and validate it again against the schema with another library); a missing subject can be reported by
name; the asyncio registry client never blocks the caller's event loop (the serializers' is blocking); and it
is the worker's own codec (``d3stream/kafka/registry.py`` imports its framing, subject names and client
configuration from here), so the two sides cannot frame differently.

Importing ``d3stream_client`` never imports this module: ``Publisher`` and the readers import nothing of the
registry unless given a ``RegistryFormat``, so a client without the extra stays as light as it was.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

import msgspec

try:
    import fastavro
    from confluent_kafka.schema_registry import AsyncSchemaRegistryClient, Schema
    from confluent_kafka.schema_registry.error import SchemaRegistryError
except ImportError as missing:  # the clear reason, not a bare "No module named confluent_kafka"
    raise ImportError(f"the Schema Registry format needs confluent-kafka and fastavro ({missing}): "
                      "pip install 'd3stream-client[registry]'", name=missing.name) from missing

from d3stream_client import avro, avro_binary, writer_schemas
from d3stream_client.contract import Request, spoken_list
from d3stream_client.schemas import SCHEMAS, registry_json_schema

T = TypeVar("T")
MAGIC = 0
FRAME = struct.Struct(">bI")  # the magic byte and the big-endian schema id before every framed payload

# The registry's schemaType names (Avro is the default and may be absent).
AVRO, JSON_SCHEMA, PROTOBUF = "AVRO", "JSON", "PROTOBUF"

RequestFormat = Literal["avro", "json_schema"]
SubjectNameStrategy = Literal["topic", "record", "topic_record"]

# The content-type header of a framed record (requests here, answers and dead letters at the worker).
CONTENT_TYPES: dict[str, bytes] = {"avro": b"application/vnd.d3stream+avro",
                                   "json_schema": b"application/vnd.d3stream+json"}

# Avro record name -> the event it is, for the records of any topic of the contract.
_EVENTS_BY_NAME: dict[str, type[msgspec.Struct]] = {event.__name__: event for event in SCHEMAS.values()}


def is_framed(value: bytes | None) -> bool:
    """Whether a record value is in the registry's wire format (a JSON document starts with ``{`` or space): the
    magic byte and a schema id, then a payload that may be empty (then its schema's reader refuses it)."""
    return value is not None and len(value) >= FRAME.size and value[0] == MAGIC


def frame(schema_id: int, payload: bytes) -> bytes:
    return FRAME.pack(MAGIC, schema_id) + payload


def parse_avro_schema(text: str) -> object:
    """fastavro's parsed form of an Avro schema's JSON text; ValueError saying why it is not valid."""
    try:
        return fastavro.parse_schema(json.loads(text))
    except Exception as exc:  # noqa: BLE001 - fastavro raises KeyError and others for schemas it cannot parse
        raise ValueError(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)) from exc


class AvroCodec:
    """One event's Avro binary with one parsed writer schema. Code compiled for the pair writes and reads it
    (``avro_binary``: a fraction of the cost); what that code does not take, ``avro.to_avro`` / ``from_avro`` and
    fastavro write, read or refuse, so the bytes, documents and messages are fastavro's either way."""

    def __init__(self, parsed: dict[str, object], event: type[msgspec.Struct]) -> None:
        self.parsed = parsed
        self.event = event

    @functools.cached_property
    def _document_writer(self) -> avro_binary.Writer | None:
        return _compiled(avro_binary.compile_writer, self.parsed, self.event)

    @functools.cached_property
    def _struct_writer(self) -> avro_binary.Writer | None:
        return _compiled(functools.partial(avro_binary.compile_writer, from_struct=True), self.parsed, self.event)

    @functools.cached_property
    def _reader(self) -> avro_binary.Reader | None:
        return _compiled(avro_binary.compile_reader, self.parsed, self.event)

    @functools.cached_property
    def _lean_reader(self) -> avro_binary.Reader | None:
        return _compiled(functools.partial(avro_binary.compile_reader, lean=True), self.parsed, self.event)

    def write(self, document: Mapping[str, object] | msgspec.Struct) -> bytes:
        """The Avro binary of an event: its JSON document (parsed), or its Struct."""
        if isinstance(document, msgspec.Struct):
            writer = self._struct_writer
            if writer is not None:
                try:
                    return writer(document)
                except Exception:  # noqa: BLE001, S110 - written as a document below, or refused there
                    pass
            document = msgspec.to_builtins(document)
            assert isinstance(document, dict)  # an event's Struct is an object
        writer = self._document_writer
        if writer is not None:
            try:
                return writer(document)
            except Exception:  # noqa: BLE001, S110 - the general path below writes it or says why it cannot
                pass
        datum = avro.to_avro(document, self.event, fastavro_unions=True)
        out = io.BytesIO()
        fastavro.schemaless_writer(out, self.parsed, datum)
        return out.getvalue()

    def read(self, value: bytes, start: int = 0, *, lean: bool = False) -> bytes:
        """The event's JSON document from the Avro payload in ``value`` from ``start`` (past a frame); with
        ``lean``, its fields at their default left out (``avro.from_avro``). ``avro_binary.PayloadError`` (a
        ValueError) saying what was expected at which byte when the payload does not match the schema.

        Only the compiled code reads: it believes no length or count beyond the bytes left, and it is what an
        admitted writer schema (``writer_schemas.admit``) is compiled into. fastavro's reader is not a fallback
        here: on a recursive schema and a payload nested thousands deep it crashes the interpreter."""
        reader = self._lean_reader if lean else self._reader
        if reader is None:
            try:
                avro_binary.compile_reader(self.parsed, self.event, lean=lean)
            except avro_binary.NotCompilable as exc:
                raise avro_binary.PayloadError(f"its writer schema cannot be read: {exc}") from exc
        assert reader is not None
        try:
            return msgspec.json.encode(reader(value, start))
        except Exception as exc:  # noqa: BLE001 - the slow walk below says where and why
            raise avro_binary.explain(self.parsed, self.event, value, start) from exc


def _compiled(compile_: Callable[[dict[str, object], type[msgspec.Struct]], T], parsed: dict[str, object],
              event: type[msgspec.Struct]) -> T | None:
    """The compiled code, or None for a schema it does not cover (the general path serves that one)."""
    try:
        return compile_(parsed, event)
    except avro_binary.NotCompilable:
        return None


def subject_name(strategy: str, topic: str, record_name: str) -> str:
    """The subject a value schema is registered under (Confluent's three strategies)."""
    if strategy == "record":
        return record_name
    if strategy == "topic_record":
        return f"{topic}-{record_name}"
    return f"{topic}-value"


def record_name(event: type[msgspec.Struct]) -> str:
    """The full name of an event's Avro record (``d3stream.v2.Answer``), which the record strategies use."""
    return f"{avro.NAMESPACE}.{event.__name__}"


def registry_client_config(url: str, *, timeout_s: float = 10.0, basic_auth: str | None = None,
                           bearer_token: str | None = None, ssl_cafile: str | None = None,
                           ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                           max_retries: int | None = None) -> dict[str, object]:
    """confluent-kafka's registry client configuration (the names of ``schema_registry_*`` settings, less the
    prefix). ``max_retries`` None keeps the client's own retries."""
    config: dict[str, object] = {"url": url, "timeout": timeout_s}
    if max_retries is not None:
        config["max.retries"] = max_retries
    if basic_auth is not None:
        config["basic.auth.user.info"] = basic_auth
    if bearer_token is not None:
        config["bearer.auth.credentials.source"] = "STATIC_TOKEN"
        config["bearer.auth.token"] = bearer_token
        config["bearer.auth.logical.cluster"] = ""  # Confluent Cloud's cluster header; other registries ignore it
    if ssl_cafile:
        config["ssl.ca.location"] = ssl_cafile
    if ssl_certfile:
        config["ssl.certificate.location"] = ssl_certfile
    if ssl_keyfile:
        config["ssl.key.location"] = ssl_keyfile
    return config


class RegistryError(RuntimeError):
    """The registry does not have the request schema under its subject, or refused to register it."""


class UnreadableRecord(ValueError):
    """A framed record value that cannot be read: its schema id is unknown to the registry, its payload does
    not match its schema, or its schema is not one this client reads (Protobuf, a record not of the contract)."""


@dataclass(frozen=True)
class _Writer:
    """A writer schema as the registry gave it: its type and, for Avro, the codec of its event."""

    kind: str
    codec: AvroCodec | None = None


class RegistryFormat:
    """Requests framed for a Schema Registry, and answers read framed or plain (module docstring).

    ``schema_registry_url`` is the registry's Confluent-compatible API (Apicurio's ``.../apis/ccompat/v7``);
    the other ``schema_registry_*`` keywords and ``subject_name_strategy`` mean what the worker's settings of
    the same names mean. ``request_format`` is how requests are written: ``avro`` or ``json_schema``.
    ``schema_auto_register=True`` registers the request schema on first use (a demo, a test); off, it must be
    registered already (production, where producers may not change schemas).

    One ``RegistryFormat`` may serve several clients; ``aclose()`` (or ``async with``) closes its HTTP
    connections. Writer schemas and schema ids, once known, are kept for its life.
    """

    def __init__(self, schema_registry_url: str, *, request_format: RequestFormat = "avro",
                 subject_name_strategy: SubjectNameStrategy = "topic", schema_auto_register: bool = False,
                 schema_registry_basic_auth: str | None = None, schema_registry_bearer_token: str | None = None,
                 schema_registry_ssl_cafile: str | None = None, schema_registry_ssl_certfile: str | None = None,
                 schema_registry_ssl_keyfile: str | None = None, schema_registry_timeout_s: float = 10.0) -> None:
        if request_format not in get_args(RequestFormat):
            raise ValueError(f"request_format is avro or json_schema, not {request_format!r} (plain JSON needs "
                             "no registry: leave registry= out)")
        if subject_name_strategy not in get_args(SubjectNameStrategy):
            raise ValueError(f"subject_name_strategy is topic, record or topic_record, not {subject_name_strategy!r}")
        if schema_registry_basic_auth is not None and ":" not in schema_registry_basic_auth:
            raise ValueError("schema_registry_basic_auth is user:password")
        if schema_registry_ssl_keyfile and not schema_registry_ssl_certfile:
            raise ValueError("schema_registry_ssl_keyfile needs schema_registry_ssl_certfile (the certificate it signs)")
        self.url = schema_registry_url
        self.request_format: RequestFormat = request_format
        self.subject_name_strategy: SubjectNameStrategy = subject_name_strategy
        self.schema_auto_register = schema_auto_register
        self.config = registry_client_config(
            schema_registry_url, timeout_s=schema_registry_timeout_s, basic_auth=schema_registry_basic_auth,
            bearer_token=schema_registry_bearer_token, ssl_cafile=schema_registry_ssl_cafile,
            ssl_certfile=schema_registry_ssl_certfile, ssl_keyfile=schema_registry_ssl_keyfile)
        self.content_type = CONTENT_TYPES[request_format]
        if request_format == "avro":
            self.request_schema = Schema(json.dumps(avro.avro_schema(Request)), AVRO)
            parsed = fastavro.parse_schema(avro.avro_schema(Request))
            assert isinstance(parsed, dict)  # a request is a record
            self._request_codec: AvroCodec | None = AvroCodec(parsed, Request)
        else:
            self.request_schema = Schema(json.dumps(registry_json_schema(Request)), JSON_SCHEMA)
            self._request_codec = None
        self._request_ids: dict[str, int] = {}  # topic -> the request schema's id under its subject
        self._writers: dict[int, _Writer | UnreadableRecord] = {}  # what the registry said of each id
        self._client: AsyncSchemaRegistryClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:  # no credentials
        return (f"RegistryFormat({self.url!r}, request_format={self.request_format!r}, "
                f"subject_name_strategy={self.subject_name_strategy!r}, "
                f"schema_auto_register={self.schema_auto_register!r})")

    async def __aenter__(self) -> RegistryFormat:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the registry client's HTTP connections (a later call opens new ones)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def client(self) -> AsyncSchemaRegistryClient:
        """The registry client of the running event loop. Made on first use: an HTTP connection pool belongs to
        the loop that opened it, and a program may run several loops one after another (``asyncio.run``)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = AsyncSchemaRegistryClient(self.config)
            self._loop = loop
        return self._client

    def _unanswered(self, exc: Exception) -> RegistryError:
        """A registry that could not be reached, or did not answer in time, as the error that says where to look."""
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return RegistryError(f"the Schema Registry at {self.url} did not answer ({cause}): check "
                             "schema_registry_url (--schema-registry-url), that the registry runs, and its TLS "
                             "settings (schema_registry_ssl_cafile)")

    # ------------------------------------------------------------------------------ out: requests

    def subject(self, topic: str) -> str:
        """The subject the request schema of ``topic`` is registered under."""
        return subject_name(self.subject_name_strategy, topic, record_name(Request))

    async def request_schema_id(self, topic: str) -> int:
        """The id of the request schema for ``topic``: registered now (``schema_auto_register``) or looked up;
        RegistryError naming the subject when the registry refuses it or does not have it."""
        known = self._request_ids.get(topic)
        if known is not None:
            return known
        subject = self.subject(topic)
        try:
            if self.schema_auto_register:
                schema_id = await self.client.register_schema(subject, self.request_schema)
            else:
                schema_id = (await self.client.lookup_schema(subject, self.request_schema)).schema_id or 0
        except SchemaRegistryError as exc:
            action = "register" if self.schema_auto_register else "find"
            if exc.http_status_code == 404 and not self.schema_auto_register:
                hint = "; register it first, or pass schema_auto_register=True"
            elif exc.http_status_code in (409, 422) and self.schema_auto_register:
                hint = ("; the registry's compatibility check keeps the change out: make it compatible, or choose "
                        "another subject (subject_name_strategy)")
            else:
                hint = ""
            raise RegistryError(f"the Schema Registry at {self.url} could not {action} the request schema "
                                f"({self.request_format}) under subject {subject!r}: {exc.error_message} "
                                f"(HTTP {exc.http_status_code}){hint}") from exc
        except Exception as exc:  # noqa: BLE001 - a transport failure: nothing answered
            raise self._unanswered(exc) from exc
        self._request_ids[topic] = schema_id
        return schema_id

    async def encode_request(self, value: bytes, topic: str) -> bytes:
        """The record value of a request for ``topic`` in the wire format; ``value`` is the JSON document that
        passed ``validate_request``."""
        schema_id = await self.request_schema_id(topic)
        if self._request_codec is None:  # JSON Schema: the payload is the checked JSON itself
            return frame(schema_id, value)
        return frame(schema_id, self._request_codec.write(msgspec.json.decode(value)))

    # ------------------------------------------------------------------------------ in: answers, dead letters

    async def document(self, value: bytes) -> bytes:
        """The JSON document of a record value: a framed one decoded with its writer schema, any other as it
        is. UnreadableRecord when a framed one cannot be read; what the registry client raised when the
        registry did not answer (nothing is remembered of that: the next call asks again)."""
        if not is_framed(value):
            return value
        schema_id = FRAME.unpack_from(value)[1]
        writer = await self._writer(schema_id)
        if isinstance(writer, UnreadableRecord):
            raise writer
        payload = value[FRAME.size:]
        if writer.kind == JSON_SCHEMA:
            return payload
        assert writer.codec is not None  # an Avro writer (_fetch)
        try:
            return writer.codec.read(value, FRAME.size)
        except ValueError as exc:
            raise UnreadableRecord(f"the payload does not match its Avro schema (id {schema_id}): {exc}") from exc

    async def _writer(self, schema_id: int) -> _Writer | UnreadableRecord:
        known = self._writers.get(schema_id)
        if known is None:
            try:
                known = await self._fetch(schema_id)
            except UnreadableRecord as exc:  # an answer of the registry's, kept like a schema
                known = exc
            self._writers[schema_id] = known
        return known

    async def _fetch(self, schema_id: int) -> _Writer:
        try:
            schema = await self.client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise UnreadableRecord(f"the Schema Registry has no schema with id {schema_id}; the record is "
                                       f"framed for it (magic byte 0, schema id {schema_id})") from exc
            raise
        except Exception as exc:  # noqa: BLE001 - a transport failure: nothing answered
            raise self._unanswered(exc) from exc
        kind = schema.schema_type or AVRO
        if kind == JSON_SCHEMA:
            return _Writer(kind)
        if kind != AVRO:
            raise UnreadableRecord(f"the record is framed with a {kind} schema (id {schema_id}); this client "
                                   "reads JSON, Avro and JSON Schema")
        text = schema.schema_str or ""
        name = writer_schemas.record_name(text)
        event = _EVENTS_BY_NAME.get((name or "").rsplit(".", 1)[-1])
        if event is None:
            raise UnreadableRecord(f"schema id {schema_id} is not an event of the d3stream contract (an Avro record "
                                   f"named {spoken_list(sorted(_EVENTS_BY_NAME))}): {name or 'not a record'}")
        try:
            parsed = writer_schemas.admit(text, event)
        except writer_schemas.SchemaRefused as exc:
            raise UnreadableRecord(f"schema id {schema_id} is not admitted for {event.__name__} records: {exc}") from exc
        return _Writer(kind, AvroCodec(parsed, event))
