"""Credentials for a secured broker, made by the tests: the certificates of mutual TLS (trustme), the SCRAM user,
and an unsecured OAUTHBEARER token (``tests.support.kafka_pki:unsecured_token`` as a ``module:callable`` token
source). The connection's unit tests and the secured broker's integration tests share them."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest

trustme = pytest.importorskip("trustme")

SCRAM_USER, SCRAM_PASSWORD = "d3worker", "scram-secret-2718"
KEY_PASSWORD = "client-key-password"


def _b64url(document: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(document).encode()).decode().rstrip("=")


def unsecured_token() -> str:
    """An unsigned JWS (alg none) for principal d3worker, valid for an hour: what Kafka's unsecured
    OAUTHBEARER validator accepts. The OAUTHBEARER tests name it as tests.support.kafka_pki:unsecured_token."""
    now = int(time.time())
    return f"{_b64url({'alg': 'none'})}.{_b64url({'sub': SCRAM_USER, 'iat': now, 'exp': now + 3600})}."


def _pkcs8(pem: bytes, password: str | None = None) -> bytes:
    """A key as PKCS#8 PEM (what Kafka's PEM keystore reads), encrypted with ``password`` if given."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pem, password=None)
    encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                  else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """PEM files: the broker's CA and key store, the clients' CA, a client certificate with an encrypted key,
    and a certificate and CA of a rogue authority the broker does not trust."""
    folder = tmp_path_factory.mktemp("pki")
    rsa = trustme.KeyType.RSA
    server_ca, client_ca, rogue_ca = (trustme.CA(key_type=rsa) for _ in range(3))
    broker = server_ca.issue_cert("127.0.0.1", "localhost", key_type=rsa)
    client = client_ca.issue_cert("d3worker.clients.test", key_type=rsa)
    rogue = rogue_ca.issue_cert("d3worker.clients.test", key_type=rsa)
    files = {name: folder / f"{name}.pem" for name in (
        "broker", "server_ca", "client_ca", "rogue_ca", "client_cert", "client_key", "rogue_cert", "rogue_key")}
    chain = b"".join(blob.bytes() for blob in broker.cert_chain_pems)
    files["broker"].write_bytes(_pkcs8(broker.private_key_pem.bytes()) + chain)
    server_ca.cert_pem.write_to_path(str(files["server_ca"]))
    client_ca.cert_pem.write_to_path(str(files["client_ca"]))
    rogue_ca.cert_pem.write_to_path(str(files["rogue_ca"]))
    files["client_cert"].write_bytes(b"".join(blob.bytes() for blob in client.cert_chain_pems))
    files["client_key"].write_bytes(_pkcs8(client.private_key_pem.bytes(), KEY_PASSWORD))
    files["rogue_cert"].write_bytes(b"".join(blob.bytes() for blob in rogue.cert_chain_pems))
    files["rogue_key"].write_bytes(_pkcs8(rogue.private_key_pem.bytes()))
    return files
