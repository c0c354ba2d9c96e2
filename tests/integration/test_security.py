"""Secured Kafka for every command: mutual TLS, SASL/SCRAM-SHA-512 and SASL/OAUTHBEARER on a real broker.

One broker per module with four listeners: PLAINTEXT (the fixture's own admin path), SSL with client
authentication required (certificates made with trustme in tests/support/kafka_pki.py: a CA for the broker, one for clients, and a
rogue one), and SASL_SSL with SCRAM-SHA-512 (a user created by ``kafka-storage format --add-scram``) and
OAUTHBEARER (Kafka's unsecured-JWS validator; the token comes from ``tests.support.kafka_pki.unsecured_token`` through the
``module:callable`` token source). ``serve``, ``produce``, ``consume``, ``replay`` (with ``--compare-with
kafka:``) and ``compare`` connect through them, with the settings given as a TOML file, ``D3STREAM_*``
variables and flags; a wrong certificate, CA, password or token fails with a message naming the setting.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from d3stream.cli import main
from d3stream.kafka.connection import (
    client_options,
)
from d3stream.service import Service
from d3stream.settings import load_settings
from tests.support.kafka_pki import KEY_PASSWORD, SCRAM_PASSWORD, SCRAM_USER
from tests.support.stream_helpers import Q_NOUL, Reader, assigned_and_ready, free_port, run

# ------------------------------------------------------------------------------------------ the broker

# Its module-scoped broker starts once on one pytest worker (xdist_group, make test's --dist loadgroup), not
# once on each worker that runs one of its tests: in a CI run three such JVMs started at once beside the others.
pytestmark = pytest.mark.xdist_group("secured-broker")


@pytest.fixture(scope="module")
def secured_broker(kafka_broker, pki):
    """A broker with PLAINTEXT (admin), SSL (client certificates required) and SASL_SSL (SCRAM-SHA-512,
    OAUTHBEARER) listeners. (It asks for ``kafka_broker`` only to share its skip-or-fail rule.)"""
    from d3stream.dev.infra import KafkaBroker

    plain, ssl_port, sasl_port, controller = (free_port() for _ in range(4))
    unsecured = "org.apache.kafka.common.security.oauthbearer.internals.unsecured"
    extra = {
        "listeners": f"PLAINTEXT://127.0.0.1:{plain},SSL://127.0.0.1:{ssl_port},SASL_SSL://127.0.0.1:{sasl_port},"
        f"CONTROLLER://127.0.0.1:{controller}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{plain},SSL://127.0.0.1:{ssl_port},"
        f"SASL_SSL://127.0.0.1:{sasl_port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL",
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(pki["broker"]),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(pki["client_ca"]),
        "listener.name.ssl.ssl.client.auth": "required",  # mutual TLS, as Strimzi's tls listener
        "listener.name.sasl_ssl.ssl.client.auth": "none",
        "sasl.enabled.mechanisms": "SCRAM-SHA-512,OAUTHBEARER",
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "listener.name.sasl_ssl.oauthbearer.sasl.jaas.config":
            "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;",
        "listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class":
            f"{unsecured}.OAuthBearerUnsecuredValidatorCallbackHandler",
    }
    scram = f"--add-scram=SCRAM-SHA-512=[name={SCRAM_USER},password={SCRAM_PASSWORD}]"
    with KafkaBroker(extra_properties=extra, port=plain, controller_port=controller,
                     format_arguments=[scram]) as broker:
        broker.ssl_bootstrap = f"127.0.0.1:{ssl_port}"
        broker.sasl_bootstrap = f"127.0.0.1:{sasl_port}"
        yield broker


def _mtls(broker, pki, **changes: Any) -> dict[str, Any]:
    return {"bootstrap_servers": broker.ssl_bootstrap, "security_protocol": "SSL",
            "ssl_cafile": str(pki["server_ca"]), "ssl_certfile": str(pki["client_cert"]),
            "ssl_keyfile": str(pki["client_key"]), "ssl_key_password": KEY_PASSWORD, **changes}


def _scram(broker, pki, **changes: Any) -> dict[str, Any]:
    return {"bootstrap_servers": broker.sasl_bootstrap, "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": SCRAM_USER, "sasl_password": SCRAM_PASSWORD,
            "ssl_cafile": str(pki["server_ca"]), **changes}


def _oauth(broker, pki, **changes: Any) -> dict[str, Any]:
    return {"bootstrap_servers": broker.sasl_bootstrap, "security_protocol": "SASL_SSL",
            "sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": "tests.support.kafka_pki:unsecured_token",
            "ssl_cafile": str(pki["server_ca"]), **changes}


def _flags(connection: dict[str, Any]) -> list[str]:
    return [part for name, value in connection.items() for part in ("--" + name.replace("_", "-"), str(value))]


def _toml(path: Path, connection: dict[str, Any]) -> Path:
    lines = [f"{name} = {json.dumps(value)}" for name, value in connection.items()]
    path.write_text("\n".join([*lines, 'kafka_options = ["request_timeout_ms=30000"]']) + "\n")
    return path


def _env(monkeypatch, connection: dict[str, Any]) -> None:
    for name, value in connection.items():
        monkeypatch.setenv(f"D3STREAM_{name.upper()}", str(value))


def _topics(broker, prefix: str) -> dict[str, str]:
    topics = {name: f"{prefix}-{name}-{uuid.uuid4().hex[:8]}" for name in ("req", "ans", "dlq", "prov")}
    for name in ("req", "ans"):
        broker.create_topic(topics[name], 2)
    return topics


def _service_settings(connection: dict[str, Any], topics: dict[str, str]) -> Any:
    return load_settings({**connection, "request_topics": topics["req"], "answer_topic": topics["ans"],
                          "dead_letter_topic": topics["dlq"], "provenance_topic": topics["prov"],
                          "group_id": f"grp-{uuid.uuid4().hex[:8]}", "commit_interval_ms": 100,
                          "linger_ms": 10, "metrics_port": ""}, environ={})


async def _serve_until_answered(connection: dict[str, Any], topics: dict[str, str], ids: set[str], model: Any) -> None:
    """``serve``'s Service with the given connection settings, until every id is answered."""
    settings = _service_settings(connection, topics)
    service = Service(settings, model)
    options = client_options(settings.connection, "consumer")
    async with Reader(options.pop("bootstrap_servers"), topics["ans"], 2, security=options) as reader:
        task = asyncio.create_task(service.run())
        try:
            await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
            await reader.wait_ids(ids, 90, task)
        finally:
            service.stop()
            await asyncio.wait_for(task, 60)


def _every_command(tmp_path: Path, connection: dict[str, Any], topics: dict[str, str], checkpoint: Path,
                   model: Any, monkeypatch, capsys) -> None:
    """produce (TOML file) -> serve -> consume (environment) -> replay with --compare-with kafka: (flags) ->
    compare (TOML file), all through ``connection``."""
    requests = [{"id": f"{topics['req']}-{n}", "state": f"secured {n}", "questions": {"noul": Q_NOUL}}
                for n in range(4)]
    ids = {r["id"] for r in requests}
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    config = _toml(tmp_path / "kafka.toml", connection)

    assert main(["produce", topics["req"], str(source), "--config", str(config)]) == 0
    assert "published 4 records" in capsys.readouterr().err

    run(_serve_until_answered(connection, topics, ids, model))
    capsys.readouterr()  # the service's log lines

    with monkeypatch.context() as env:
        _env(env, connection)
        assert main(["consume", topics["ans"], "--max", "4", "--timeout", "60"]) == 0
    consumed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert {a["id"] for a in consumed} == ids and all("answers" in a for a in consumed)

    replayed = tmp_path / "replayed.jsonl"
    assert main(["replay", "--from-topic", topics["req"], "--replay-id", uuid.uuid4().hex[:8], "--out", str(replayed),
                 "--compare-with", f"kafka:{topics['ans']}", "--model", str(checkpoint), "--deterministic",
                 "--json", "--metrics-port", "", *_flags(connection)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["replayed"] == 4 and summary["drift"]["joined"] == 4, summary

    assert main(["compare", f"kafka:{topics['ans']}", str(replayed), "--json", "--out", str(tmp_path / "report"),
                 "--config", str(config)]) == 0
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["joined"] == 4, headline


# ------------------------------------------------------------------------------------------ every command


@pytest.mark.usefixtures("logging_restored")
def test_every_command_over_mutual_tls(secured_broker, pki, qwen35_text_checkpoint, qwen35_text_model, tmp_path,
                                       monkeypatch, capsys):
    _every_command(tmp_path, _mtls(secured_broker, pki), _topics(secured_broker, "mtls"), qwen35_text_checkpoint,
                   qwen35_text_model, monkeypatch, capsys)


@pytest.mark.usefixtures("logging_restored")
def test_every_command_over_scram_sha_512(secured_broker, pki, qwen35_text_checkpoint, qwen35_text_model, tmp_path,
                                          monkeypatch, capsys):
    _every_command(tmp_path, _scram(secured_broker, pki), _topics(secured_broker, "scram"), qwen35_text_checkpoint,
                   qwen35_text_model, monkeypatch, capsys)


def test_oauthbearer_with_a_module_callable_token_source(secured_broker, pki, tmp_path, capsys):
    # (A refused token is not tested: aiokafka 0.14 does not finish OAUTHBEARER's error exchange and its
    # client hangs instead of failing.)
    topics = _topics(secured_broker, "oauth")
    source = tmp_path / "requests.jsonl"
    source.write_text(json.dumps({"id": "oauth-1", "state": "s", "questions": {"q": Q_NOUL}}) + "\n")  # a request
    assert main(["produce", topics["req"], str(source), *_flags(_oauth(secured_broker, pki))]) == 0
    assert main(["consume", topics["req"], "--max", "1", "--timeout", "30", *_flags(_oauth(secured_broker, pki))]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["id"] == "oauth-1"


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("case", "setting"),
    [
        ("no client certificate", "ssl_certfile"),
        ("a certificate of an untrusted CA", "ssl_certfile"),
        ("the wrong CA for the broker", "ssl_cafile"),
        ("a wrong SCRAM password", "sasl_password"),
    ],
)
def test_a_refused_connection_names_the_setting_to_fix(secured_broker, pki, tmp_path, capsys, case, setting):
    connection = {
        "no client certificate": _mtls(secured_broker, pki, ssl_certfile=None, ssl_keyfile=None,
                                       ssl_key_password=None),
        "a certificate of an untrusted CA": _mtls(secured_broker, pki, ssl_certfile=str(pki["rogue_cert"]),
                                                  ssl_keyfile=str(pki["rogue_key"]), ssl_key_password=None),
        "the wrong CA for the broker": _mtls(secured_broker, pki, ssl_cafile=str(pki["rogue_ca"])),
        "a wrong SCRAM password": _scram(secured_broker, pki, sasl_password="not-the-password"),
    }[case]
    connection = {k: v for k, v in connection.items() if v is not None}
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps({"id": "refused", "state": "s", "questions": {"q": Q_NOUL}}) + "\n")  # checked first
    assert main(["produce", "refused-topic", str(source), *_flags(connection)]) == 2  # refused, not hung
    error = capsys.readouterr().err
    assert setting in error, error
    assert main(["compare", "kafka:refused-topic", str(source), "--timeout", "20", *_flags(connection)]) == 2
    assert setting in capsys.readouterr().err


def test_serve_with_a_wrong_scram_password_stops_naming_sasl_password(secured_broker, pki, qwen35_text_model):
    topics = {name: f"refused-{name}" for name in ("req", "ans", "dlq", "prov")}

    service = Service(_service_settings(_scram(secured_broker, pki, sasl_password="wrong"), topics), qwen35_text_model)

    async def attempt() -> BaseException | None:
        try:
            await asyncio.wait_for(service.run(), 60)
        except Exception as exc:  # noqa: BLE001 - the refusal is what is checked
            return exc
        return None

    outcome = run(attempt())
    assert isinstance(outcome, ConnectionError), outcome
    assert "sasl_password" in str(outcome) and "SCRAM-SHA-512" in str(outcome)
