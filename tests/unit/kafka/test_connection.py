"""Kafka connection settings without a broker (d3stream/kafka/connection.py): Kafka options reach the clients that
take them and unknown keys are refused, every client is made from the settings by the factories there,
settings that cannot work are refused by name, a client key that does not load names ``ssl_key_password``,
and the token sources (``module:callable``, AWS MSK IAM). On a secured
broker: tests/integration/test_security.py."""

from __future__ import annotations

import base64
import json

import pytest

from d3stream.kafka.connection import (
    accepted_parameters,
    check_connection,
    client_options,
    kafka_admin,
    kafka_consumer,
    kafka_producer,
    parse_kafka_options,
    raw_client,
    security_options,
    token_provider,
)
from d3stream.settings import load_settings
from tests.support.kafka_pki import KEY_PASSWORD, SCRAM_USER
from tests.support.stream_helpers import run

# ------------------------------------------------------------------------------------------ without a broker


def test_kafka_options_reach_the_clients_that_take_them_and_unknown_keys_are_refused(monkeypatch):
    from d3stream.cli import build_parser

    args = build_parser().parse_args(["consume", "t", "-X", "request_timeout_ms=30000",
                                      "--kafka-options", "max_poll_records=5,linger_ms=7"])
    settings = load_settings(args, environ={})
    assert client_options(settings.connection, "consumer")["max_poll_records"] == 5
    assert "max_poll_records" not in client_options(settings.connection, "producer")
    assert client_options(settings.connection, "producer")["linger_ms"] == 7
    assert all(client_options(settings.connection, kind)["request_timeout_ms"] == 30000 for kind in ("consumer", "admin"))
    # a pass-through value wins over a client's own tuning value
    assert client_options(settings.connection, "producer", linger_ms=2)["linger_ms"] == 7
    assert load_settings({}, environ={"D3STREAM_KAFKA_OPTIONS": "metadata_max_age_ms=1000"}).connection.kafka_options == [
        "metadata_max_age_ms=1000"]

    with pytest.raises(ValueError, match=r"unknown aiokafka client option 'request_timeout'.*request_timeout_ms"):
        parse_kafka_options(["request_timeout=3"])
    with pytest.raises(ValueError, match="isolation_level cannot be passed through"):
        parse_kafka_options(["isolation_level=read_uncommitted"])
    with pytest.raises(ValueError, match="sasl_password"):
        parse_kafka_options(["sasl_plain_password=x"])
    with pytest.raises(ValueError, match="must be int"):
        parse_kafka_options(["request_timeout_ms=soon"])
    with pytest.raises(ValueError, match="kafka_options"):  # refused as the command starts: exit 2 before work
        check_connection(load_settings({"kafka_options": ["no_such_option=1"]}, environ={}).connection)


def test_the_client_factories_make_each_client_with_the_connection_settings_or_as_given(monkeypatch):
    import aiokafka.admin
    import aiokafka.consumer
    import aiokafka.producer

    accepted_parameters()  # read off the real classes before they are replaced here (it is cached)
    made: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
    for module, name in [(aiokafka.consumer, "AIOKafkaConsumer"), (aiokafka.producer, "AIOKafkaProducer"),
                         (aiokafka.admin, "AIOKafkaAdminClient")]:
        monkeypatch.setattr(module, name, lambda *args, name=name, **kwargs: made.append((name, args, kwargs)))
    connection = load_settings({"bootstrap_servers": "broker:9093", "kafka_options": ["request_timeout_ms=30000"]},
                               environ={}).connection

    kafka_consumer(connection, "requests", group_id="g")
    kafka_producer(connection, linger_ms=2)
    kafka_admin(connection, client_id="c")
    raw_client("consumer", "answers", bootstrap_servers="elsewhere:9092", group_id=None)
    raw_client("producer", bootstrap_servers="elsewhere:9092", acks=1)
    assert made == [
        ("AIOKafkaConsumer", ("requests",), client_options(connection, "consumer", group_id="g")),
        ("AIOKafkaProducer", (), client_options(connection, "producer", linger_ms=2)),
        ("AIOKafkaAdminClient", (), client_options(connection, "admin", client_id="c")),
        ("AIOKafkaConsumer", ("answers",), {"bootstrap_servers": "elsewhere:9092", "group_id": None}),
        ("AIOKafkaProducer", (), {"bootstrap_servers": "elsewhere:9092", "acks": 1}),
    ]
    assert made[0][2]["bootstrap_servers"] == "broker:9093" and made[0][2]["request_timeout_ms"] == 30000
    with pytest.raises(TypeError, match="takes no topics"):
        raw_client("producer", "requests")  # type: ignore[call-overload]


def test_connection_settings_that_cannot_work_are_refused_by_name():
    for environ, setting in [
        ({"D3STREAM_SECURITY_PROTOCOL": "SASL_SSL", "D3STREAM_SASL_MECHANISM": "OAUTHBEARER"},
         "sasl_oauth_token_provider"),
        ({"D3STREAM_SECURITY_PROTOCOL": "SASL_SSL", "D3STREAM_SASL_MECHANISM": "SCRAM-SHA-512"}, "sasl_password"),
        ({"D3STREAM_SASL_MECHANISM": "PLAIN"}, "security_protocol"),
        ({"D3STREAM_SSL_CERTFILE": "/c.pem"}, "security_protocol SSL"),
        ({"D3STREAM_SECURITY_PROTOCOL": "SSL", "D3STREAM_SSL_KEYFILE": "/k.pem"}, "ssl_certfile"),
    ]:
        with pytest.raises(ValueError, match=setting):
            check_connection(load_settings({}, environ=environ).connection)


def test_a_client_key_that_does_not_load_names_ssl_key_password(pki):
    base = {"security_protocol": "SSL", "ssl_cafile": str(pki["server_ca"]), "ssl_certfile": str(pki["client_cert"]),
            "ssl_keyfile": str(pki["client_key"])}
    assert security_options(load_settings({**base, "ssl_key_password": KEY_PASSWORD}, environ={}).connection)["ssl_context"]
    for password in (None, "wrong"):
        settings = load_settings({**base, "ssl_key_password": password}, environ={})
        with pytest.raises(ValueError, match="ssl_key_password"):
            security_options(settings.connection)
    hostname_off = load_settings({**base, "ssl_key_password": KEY_PASSWORD, "ssl_check_hostname": False}, environ={})
    assert security_options(hostname_off.connection)["ssl_context"].check_hostname is False
    assert security_options(load_settings(base | {"ssl_key_password": KEY_PASSWORD}, environ={}).connection)[
        "ssl_context"].check_hostname is True


def test_token_sources_module_callable_and_aws_msk_iam(monkeypatch):
    from urllib.parse import parse_qs, urlparse

    provider = token_provider("tests.support.kafka_pki:unsecured_token")
    token = run(provider.token())
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["sub"] == SCRAM_USER

    with pytest.raises(ValueError, match="sasl_oauth_token_provider"):
        token_provider("tests.unit.kafka.test_connection:no_such_function")
    with pytest.raises(ValueError, match="module:callable"):
        token_provider("just-a-name")

    # AWS MSK IAM: aws-msk-iam-sasl-signer-python signs a kafka-cluster:Connect request with the AWS chain's
    # credentials, locally (no AWS call); the token is that presigned URL, base64url-encoded.
    pytest.importorskip("aws_msk_iam_sasl_signer")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    msk = token_provider("aws-msk-iam")
    with pytest.raises(ValueError, match="AWS_REGION"):
        run(msk.token())
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    url = base64.urlsafe_b64decode(run(msk.token()) + "==").decode()
    query = parse_qs(urlparse(url).query)
    assert urlparse(url).hostname == "kafka.eu-west-1.amazonaws.com"
    assert query["Action"] == ["kafka-cluster:Connect"]
    assert "AKIDEXAMPLE/" in query["X-Amz-Credential"][0] and "/eu-west-1/kafka-cluster/" in query["X-Amz-Credential"][0]
    options = security_options(load_settings({}, environ={
        "D3STREAM_SECURITY_PROTOCOL": "SASL_SSL", "D3STREAM_SASL_MECHANISM": "OAUTHBEARER",
        "D3STREAM_SASL_OAUTH_TOKEN_PROVIDER": "aws-msk-iam"}).connection)
    assert options["sasl_mechanism"] == "OAUTHBEARER" and run(options["sasl_oauth_token_provider"].token())
