"""Kafka connection settings -> every aiokafka client d3stream makes, made here.

Every command that talks to Kafka (``serve``, ``replay``, ``produce``, ``consume``, ``compare``) builds its
consumers, producers and admin clients through :func:`client_options`, so a cluster reachable by one is
reachable by all with the same settings: bootstrap servers, security protocol, SASL (PLAIN, SCRAM,
OAUTHBEARER with a pluggable token source, AWS MSK IAM built in), TLS with a CA file and an optional client
certificate (mutual TLS, hostname checking on by default), and ``kafka_options``: a pass-through of other
client parameters (``request_timeout_ms=30000``), like kcat's ``-X key=value``, checked against the
parameters aiokafka's constructors take.

This module is the only one that constructs aiokafka clients (:func:`kafka_consumer`, :func:`kafka_producer`,
:func:`kafka_admin` with the connection settings; :func:`raw_client` with keyword arguments as given, for a
benchmark's plain aiokafka baseline or the embedded broker's probe). Elsewhere the classes are types only,
imported from here under ``TYPE_CHECKING``. ``make lint`` holds the rest of d3stream to it: the import-linter
contract "Only d3stream.kafka.connection makes Kafka clients" forbids importing the modules that define or
re-export the client classes (``aiokafka.consumer``, ``aiokafka.producer``, ``aiokafka.admin``,
``aiokafka.client``), and ruff's banned-api rule (TID251) the classes' names by any path.

A connection that fails is diagnosed once more by :func:`explain_failure`: aiokafka reports only "Unable
to bootstrap" when every broker refused, so one direct connection to the first bootstrap server finds the
real cause (an untrusted broker certificate, a client certificate the broker refused, a SASL password)
and the message names the setting to change. :func:`reach` is the cheap check a command makes first (one
metadata request), so a wrong address or password is said before a model loads for seconds, and the
topics it lists let a command say that a topic it reads does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import importlib
import inspect
import json
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

if TYPE_CHECKING:
    from aiokafka.abc import AbstractTokenProvider
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.consumer import AIOKafkaConsumer
    from aiokafka.producer import AIOKafkaProducer

    from d3stream.settings import ConnectionSettings

Client = Literal["consumer", "producer", "admin"]
T = TypeVar("T")

# The value of ``sasl_oauth_token_provider`` that selects AWS MSK IAM (aws-msk-iam-sasl-signer-python).
AWS_MSK_IAM = "aws-msk-iam"

# Client parameters that ``kafka_options`` may not set: each is a setting of its own, or d3stream sets it
# for its delivery guarantees, or it is not a value a text option can carry.
RESERVED: dict[str, str] = {
    "bootstrap_servers": "use the setting bootstrap_servers",
    "security_protocol": "use the setting security_protocol",
    "sasl_mechanism": "use the setting sasl_mechanism",
    "sasl_plain_username": "use the setting sasl_username",
    "sasl_plain_password": "use the setting sasl_password",
    "sasl_oauth_token_provider": "use the setting sasl_oauth_token_provider",
    "ssl_context": "use the settings ssl_cafile, ssl_certfile, ssl_keyfile, ssl_key_password, ssl_check_hostname",
    "client_id": "use the setting client_id",
    "group_id": "use the setting group_id",
    "group_instance_id": "use the setting group_instance_id",
    "session_timeout_ms": "use the setting session_timeout_ms",
    "rebalance_timeout_ms": "use the setting rebalance_timeout_ms",
    "heartbeat_interval_ms": "use the setting heartbeat_interval_ms",
    "auto_offset_reset": "use the setting auto_offset_reset",
    "max_request_size": "use the setting max_request_size",
    "compression_type": "use the setting compression",
    "transactional_id": "use the setting transactional_id_prefix",
    "acks": "d3stream's delivery guarantees need acks=all",
    "enable_idempotence": "d3stream's delivery guarantees need it on",
    "enable_auto_commit": "d3stream commits offsets itself (setting delivery)",
    "isolation_level": "d3stream reads committed records only",
    "loop": "not a client option",
    "topics": "not a client option",
    "key_serializer": "not settable from text",
    "value_serializer": "not settable from text",
    "key_deserializer": "not settable from text",
    "value_deserializer": "not settable from text",
    "partitioner": "not settable from text",
    "partition_assignment_strategy": "not settable from text",
}


@functools.cache
def accepted_parameters() -> dict[Client, dict[str, object]]:
    """The keyword parameters (name -> default) of aiokafka's consumer, producer and admin constructors."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.consumer import AIOKafkaConsumer
    from aiokafka.producer import AIOKafkaProducer

    classes: dict[Client, type] = {"consumer": AIOKafkaConsumer, "producer": AIOKafkaProducer,
                                  "admin": AIOKafkaAdminClient}
    return {
        client: {name: p.default for name, p in inspect.signature(cls).parameters.items()
                 if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        for client, cls in classes.items()
    }


def _parse_value(key: str, text: str, default: object) -> object:
    """``30000`` -> 30000, ``true`` -> True, ``none`` -> None, anything else stays text; checked against the
    type of the parameter's default."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    value: object
    try:
        value = json.loads(lowered if lowered in ("true", "false") else text)
    except json.JSONDecodeError:
        value = text
    expected = type(default) if isinstance(default, bool | int | float | str) else None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is not None and not (type(value) is expected or (expected is str and isinstance(value, str))):
        raise ValueError(f"kafka_options: {key}={text!r} must be {expected.__name__} (aiokafka's default is "
                         f"{default!r})")
    return value


def parse_kafka_options(options: list[str]) -> dict[Client, dict[str, object]]:
    """``kafka_options`` (``key=value`` texts) -> the options of each kind of client that takes them.

    ValueError names the offending entry: not ``key=value``, a parameter no aiokafka client takes (with the
    closest names), one d3stream sets itself (with the setting to use), or a value of the wrong type."""
    accepted = accepted_parameters()
    known = sorted(set().union(*accepted.values()) - set(RESERVED))
    chosen: dict[Client, dict[str, object]] = {"consumer": {}, "producer": {}, "admin": {}}
    for entry in options:
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"kafka_options: {entry!r} is not key=value (e.g. request_timeout_ms=30000)")
        if key in RESERVED:
            raise ValueError(f"kafka_options: {key} cannot be passed through: {RESERVED[key]}")
        takers = [client for client, params in accepted.items() if key in params]
        if not takers:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"kafka_options: unknown aiokafka client option {key!r}{hint}; known: {', '.join(known)}")
        for client in takers:
            chosen[client][key] = _parse_value(key, text, accepted[client][key])
    return chosen


# ------------------------------------------------------------------------------------------ TLS


def ssl_context(connection: ConnectionSettings) -> ssl.SSLContext:
    """The TLS context of the SSL and SASL_SSL protocols: the brokers' CA (default: the system's), the client
    certificate for mutual TLS, hostname checking as ``ssl_check_hostname`` says. ValueError names the file
    setting that cannot be read."""
    try:
        context = ssl.create_default_context(cafile=connection.ssl_cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"ssl_cafile {connection.ssl_cafile}: cannot be read as PEM CA certificates: {exc}") from exc
    context.check_hostname = connection.ssl_check_hostname
    if connection.ssl_certfile:
        # Without a password an encrypted key must fail, not make OpenSSL prompt on the terminal.
        password: str | Callable[[], str] = (connection.ssl_key_password.reveal() if connection.ssl_key_password else (lambda: ""))
        try:
            context.load_cert_chain(connection.ssl_certfile, connection.ssl_keyfile, password=password)
        except ssl.SSLError as exc:
            raise ValueError(
                f"ssl_certfile {connection.ssl_certfile} / ssl_keyfile {connection.ssl_keyfile or '(in the certfile)'}: "
                f"the client certificate and key do not load ({exc}): check ssl_key_password if the key is "
                "encrypted, and that the key belongs to the certificate"
            ) from exc
        except OSError as exc:
            raise ValueError(f"ssl_certfile / ssl_keyfile: cannot read {exc.filename or ''}: {exc}") from exc
    return context


# ------------------------------------------------------------------------------------------ OAUTHBEARER


def _token_provider_class() -> type[AbstractTokenProvider]:
    from aiokafka.abc import AbstractTokenProvider

    class CallableTokenProvider(AbstractTokenProvider):
        """An aiokafka token provider over a function that returns a token (str, or an awaitable of one);
        a synchronous function runs on a thread, since fetching a token may be network I/O."""

        # ``source`` returns a token, a (token, expiry) tuple or an awaitable of either: checked in ``token``.
        def __init__(self, source: Callable[[], object], name: str) -> None:
            self.source = source
            self.name = name

        async def token(self) -> str:
            if inspect.iscoroutinefunction(self.source):
                value = await self.source()
            else:
                value = await asyncio.to_thread(self.source)
                if inspect.isawaitable(value):
                    value = await value
            if isinstance(value, tuple):  # (token, expiry in ms), as aws-msk-iam-sasl-signer returns
                value = value[0]
            if not isinstance(value, str) or not value:
                raise ValueError(f"sasl_oauth_token_provider {self.name} returned {type(value).__name__}, not a "
                                 "token string")
            return value

    return CallableTokenProvider


def aws_msk_iam_token() -> tuple[str, int]:
    """An AWS MSK IAM token (a SigV4-signed ``kafka-cluster:Connect`` request) for the region in
    ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), with credentials from the standard AWS chain."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        raise ValueError("sasl_oauth_token_provider aws-msk-iam needs the cluster's region in AWS_REGION")
    from aws_msk_iam_sasl_signer import MSKAuthTokenProvider

    return MSKAuthTokenProvider.generate_auth_token(region)


def token_provider(spec: str) -> AbstractTokenProvider:
    """The aiokafka token provider a ``sasl_oauth_token_provider`` setting names: ``aws-msk-iam``, or
    ``module:callable`` -- an ``AbstractTokenProvider`` subclass (instantiated without arguments), an
    instance of one, or a function of no arguments that returns a token."""
    from aiokafka.abc import AbstractTokenProvider

    if spec == AWS_MSK_IAM:
        try:
            importlib.import_module("aws_msk_iam_sasl_signer")
        except ImportError as exc:
            raise ValueError("sasl_oauth_token_provider aws-msk-iam needs the package aws-msk-iam-sasl-signer-python "
                             "(pip install 'd3stream[msk-iam]')") from exc
        return _token_provider_class()(aws_msk_iam_token, AWS_MSK_IAM)
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"sasl_oauth_token_provider {spec!r}: expected module:callable or {AWS_MSK_IAM}")
    try:
        target: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"sasl_oauth_token_provider {spec!r} cannot be imported: {exc}") from exc
    if isinstance(target, AbstractTokenProvider):
        return target
    if isinstance(target, type) and issubclass(target, AbstractTokenProvider):
        return target()
    if callable(target):
        return _token_provider_class()(target, spec)
    raise ValueError(f"sasl_oauth_token_provider {spec!r} is a {type(target).__name__}, not a callable")


# ------------------------------------------------------------------------------------------ the options


def check_connection(connection: ConnectionSettings) -> None:
    """Refuse connection settings that cannot work together, naming them (ValueError)."""
    protocol = connection.security_protocol
    if protocol.startswith("SASL"):
        mechanism = connection.sasl_mechanism
        if not mechanism:
            raise ValueError(f"security_protocol {protocol} needs sasl_mechanism (PLAIN, SCRAM-SHA-256, "
                             "SCRAM-SHA-512 or OAUTHBEARER)")
        if mechanism == "OAUTHBEARER" and not connection.sasl_oauth_token_provider:
            raise ValueError(f"sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider ({AWS_MSK_IAM} or "
                             "module:callable)")
        if mechanism != "OAUTHBEARER" and (connection.sasl_username is None or connection.sasl_password is None):
            raise ValueError(f"sasl_mechanism {mechanism} needs sasl_username and sasl_password")
    elif connection.sasl_mechanism:
        raise ValueError(f"sasl_mechanism {connection.sasl_mechanism} needs security_protocol SASL_SSL or "
                         f"SASL_PLAINTEXT (now {protocol})")
    tls_files = [name for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(connection, name)]
    if tls_files and not protocol.endswith("SSL"):
        raise ValueError(f"{', '.join(tls_files)} need security_protocol SSL or SASL_SSL (now {protocol})")
    if connection.ssl_keyfile and not connection.ssl_certfile:
        raise ValueError("ssl_keyfile needs ssl_certfile (the client certificate the key belongs to)")
    parse_kafka_options(connection.kafka_options)


def security_options(connection: ConnectionSettings) -> dict[str, object]:
    """The aiokafka keyword arguments of the security settings (protocol, SASL, TLS)."""
    check_connection(connection)
    options: dict[str, object] = {"security_protocol": connection.security_protocol}
    if connection.security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = connection.sasl_mechanism
        if connection.sasl_mechanism == "OAUTHBEARER":
            options["sasl_oauth_token_provider"] = token_provider(connection.sasl_oauth_token_provider or "")
        else:
            options.update(sasl_plain_username=connection.sasl_username, sasl_plain_password=connection.sasl_password.reveal() if connection.sasl_password else None)
    if connection.security_protocol.endswith("SSL"):
        options["ssl_context"] = ssl_context(connection)
    return options


def client_options(connection: ConnectionSettings, client: Client, **own: object) -> dict[str, Any]:
    """The keyword arguments of one aiokafka client: ``own`` (what the caller needs), then the connection
    (bootstrap servers, security), then the ``kafka_options`` this kind of client takes, which win over
    ``own``'s tuning values (never over what :data:`RESERVED` protects).

    The values stay untyped: they are of every type an aiokafka constructor takes, and callers read some back
    (``bootstrap_servers``, a str, goes to clients that take it apart from the rest)."""
    return {
        **own,
        "bootstrap_servers": connection.bootstrap_servers,
        **security_options(connection),
        **parse_kafka_options(connection.kafka_options)[client],
    }


# ------------------------------------------------------------------------------------------ the clients


def kafka_consumer(connection: ConnectionSettings, *topics: str, **options: object) -> AIOKafkaConsumer:
    """A consumer (subscribed to ``topics``, if any) of ``options`` with the connection's settings
    (:func:`client_options`). Not started."""
    return raw_client("consumer", *topics, **client_options(connection, "consumer", **options))


def kafka_producer(connection: ConnectionSettings, **options: object) -> AIOKafkaProducer:
    """A producer of ``options`` with the connection's settings (:func:`client_options`). Not started."""
    return raw_client("producer", **client_options(connection, "producer", **options))


def kafka_admin(connection: ConnectionSettings, **options: object) -> AIOKafkaAdminClient:
    """An admin client of ``options`` with the connection's settings (:func:`client_options`). Not started."""
    return raw_client("admin", **client_options(connection, "admin", **options))


@overload
def raw_client(kind: Literal["consumer"], *topics: str, **options: object) -> AIOKafkaConsumer: ...


@overload
def raw_client(kind: Literal["producer"], **options: object) -> AIOKafkaProducer: ...


@overload
def raw_client(kind: Literal["admin"], **options: object) -> AIOKafkaAdminClient: ...


def raw_client(kind: Client, *topics: str,
               **options: object) -> AIOKafkaConsumer | AIOKafkaProducer | AIOKafkaAdminClient:
    """An aiokafka client of exactly these keyword arguments, nothing added: for options made already (by
    :func:`client_options`), and for a plain client of the caller's own (a benchmark's raw aiokafka
    baseline, the embedded broker's probe). ``topics``: a consumer's subscription. Not started."""
    if kind == "consumer":
        from aiokafka.consumer import AIOKafkaConsumer

        return AIOKafkaConsumer(*topics, **options)
    if topics:
        raise TypeError(f"a {kind} client takes no topics, got {topics!r}")
    if kind == "producer":
        from aiokafka.producer import AIOKafkaProducer

        return AIOKafkaProducer(**options)
    from aiokafka.admin import AIOKafkaAdminClient

    return AIOKafkaAdminClient(**options)


# ------------------------------------------------------------------------------------------ diagnosis


def _hint(connection: ConnectionSettings, cause: BaseException) -> str:
    text = f"{type(cause).__name__}: {cause}".lower()
    if isinstance(cause, ssl.SSLCertVerificationError) or "certificate verify failed" in text:
        if "hostname" in text or "ip address mismatch" in text:
            return ("the broker's certificate does not name the address connected to: use the name in its "
                    "certificate in bootstrap_servers, or turn ssl_check_hostname off")
        return "the broker's certificate is not signed by a CA in ssl_cafile: check ssl_cafile"
    if any(word in text for word in ("certificate required", "unknown ca", "bad certificate", "certificate unknown",
                                     "handshake failure", "expired")) and isinstance(cause, ssl.SSLError | OSError):
        return ("the broker refused the client certificate: check ssl_certfile and ssl_keyfile (a certificate "
                "signed by a CA the broker trusts; required by listeners with ssl.client.auth=required)")
    if "wrong version number" in text or "record layer failure" in text:
        return "the listener does not speak TLS: check security_protocol and bootstrap_servers"
    if "authentication" in text or "sasl" in text or "unsupportedsaslmechanism" in text:
        if connection.sasl_mechanism == "OAUTHBEARER":
            return "the broker refused the OAUTHBEARER token: check sasl_oauth_token_provider"
        return (f"SASL authentication ({connection.sasl_mechanism}) was refused: check sasl_username and "
                "sasl_password (and sasl_mechanism: the listener must enable it)")
    return ""


async def explain_failure(connection: ConnectionSettings, exc: BaseException, timeout_s: float = 10.0) -> str:
    """Why connecting failed, naming the setting to change: from ``exc``'s chain, else from one direct
    connection to the first bootstrap server (aiokafka keeps the cause of "Unable to bootstrap" to its log)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for cause in chain:
        if hint := _hint(connection, cause):
            return hint
    from aiokafka.conn import create_conn

    host, _, port = connection.bootstrap_servers.split(",")[0].strip().rpartition(":")
    if not port.isdigit():
        return f"bootstrap_servers must be host:port[,host:port], got {connection.bootstrap_servers!r}"
    try:
        conn = await asyncio.wait_for(create_conn(host.strip("[]"), int(port), request_timeout_ms=int(timeout_s * 1000),
                                                  **security_options(connection)), timeout_s)
    except Exception as probe:  # noqa: BLE001 - every failure is a diagnosis
        for cause in [probe, *([probe.__cause__] if probe.__cause__ else [])]:
            if hint := _hint(connection, cause):
                return hint
        if isinstance(probe, ConnectionRefusedError | TimeoutError | OSError) and not isinstance(probe, ssl.SSLError):
            return f"nothing answers at {connection.bootstrap_servers}: check bootstrap_servers"
        return f"check bootstrap_servers and security_protocol ({type(probe).__name__}: {probe})"
    # With TLS 1.3 a refused client certificate shows only on the first request after the handshake.
    try:
        from aiokafka.protocol.metadata import MetadataRequest

        await asyncio.wait_for(conn.send(MetadataRequest[0]([])), timeout_s)
    except Exception as probe:  # noqa: BLE001
        if hint := _hint(connection, probe.__cause__ or probe):
            return hint
        if connection.security_protocol == "SSL" and connection.ssl_certfile is None:
            return ("the broker closed the connection after the TLS handshake: if its listener requires client "
                    "certificates (ssl.client.auth=required), set ssl_certfile and ssl_keyfile")
        if connection.security_protocol == "SSL":
            return ("the broker closed the connection after the TLS handshake: it may not trust the client "
                    "certificate: check ssl_certfile and ssl_keyfile")
        return f"check bootstrap_servers and security_protocol ({type(probe).__name__}: {probe})"
    finally:
        conn.close()
    return "check bootstrap_servers, security_protocol and the topic's access rights"


def connection_error(connection: ConnectionSettings, exc: BaseException, hint: str) -> ConnectionError:
    """The error a command reports when Kafka cannot be reached, naming where and what to change."""
    return ConnectionError(
        f"cannot connect to Kafka at {connection.bootstrap_servers} (security_protocol={connection.security_protocol}"
        f"{', sasl_mechanism=' + connection.sasl_mechanism if connection.sasl_mechanism else ''}): {hint}. "
        f"Cause: {type(exc).__name__}: {exc}"
    )


async def connecting(connection: ConnectionSettings, step: Awaitable[T]) -> T:
    """Await a step that connects to Kafka; a refusal becomes a ConnectionError that names the connection."""
    from aiokafka.errors import KafkaError

    try:
        return await step
    except KafkaError as exc:
        hint = await explain_failure(connection, exc)
        raise connection_error(connection, exc, hint) from exc


# How long ``reach`` waits for the cluster's metadata: a refused connection fails at once, an address that
# drops packets would otherwise hold a command for aiokafka's 40 s request timeout.
REACH_TIMEOUT_S = 15.0


async def reach(connection: ConnectionSettings, timeout_s: float = REACH_TIMEOUT_S) -> set[str]:
    """The names of the cluster's topics, from one short-lived admin client: proof that Kafka answers at
    ``bootstrap_servers`` with these security settings, made before a command spends time on anything else.
    A refusal is a ConnectionError naming the setting to change (as :func:`connecting` makes it); aiokafka's
    own log lines about the refusal are held back (the error says more), unless logging is at ``debug``."""
    from aiokafka.errors import KafkaError

    admin = kafka_admin(connection, request_timeout_ms=int(timeout_s * 1000))
    with _quiet_aiokafka():
        try:
            try:
                await asyncio.wait_for(admin.start(), timeout_s)
                return set(await asyncio.wait_for(admin.list_topics(), timeout_s))
            finally:
                await admin.close()
        except TimeoutError as exc:
            raise connection_error(connection, exc, f"nothing answered within {timeout_s:g} s: check "
                                   "bootstrap_servers (and that no firewall drops the packets)") from exc
        except KafkaError as exc:
            hint = await explain_failure(connection, exc)
            raise connection_error(connection, exc, hint) from exc


@contextlib.contextmanager
def _quiet_aiokafka() -> Iterator[None]:
    """aiokafka's logger at CRITICAL for a while, unless debug records are wanted: its "Unable connect to ..."
    error would come before the one line that says what to change."""
    logger = logging.getLogger("aiokafka")
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)
