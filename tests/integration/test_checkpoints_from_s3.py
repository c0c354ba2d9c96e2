"""Checkpoints from object storage (``--model s3://bucket/prefix/``) and model-source pointers, against a
real S3 endpoint (S3Proxy) and a real tiny checkpoint: what is downloaded, verified, refused and reused."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from d3stream.cli import main
from d3stream.models.checkpoints import (
    POINTER,
    CheckpointError,
    ObjectStoreAccess,
    fetch_checkpoint,
    resolve_source,
)
from d3stream.runtime.package import MANIFEST, package_files, read_manifest, write_manifest
from tests.support.model_fixtures import copy_checkpoint

# Commands run in process set up logging on the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_restored")

PREFIX = "models/tiny"
REQUEST = {
    "state": {"text": "My card was charged twice. Please give me my money back."},
    "questions": {
        "team": {"type": "choice", "criteria": {"billing": "payments", "tech": "bugs", "sales": None}},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    },
}


def upload(client: Any, bucket: str, prefix: str, root: Path) -> None:
    """Every file of a checkpoint directory, manifest included, under ``bucket/prefix/``."""
    for name in [*package_files(root), MANIFEST]:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(root / name).read_bytes())


def counting(client: Any) -> Counter[str]:
    """Count the S3 operations a real client sends (``GetObject``: 3), and every request it sends."""
    calls: Counter[str] = Counter()
    client.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]))
    client.meta.events.register("before-send.s3", lambda **_: calls.update(["sent"]))
    return calls


def cached_copies(cache: Path) -> list[Path]:
    """The complete copies in a model cache (a folder holding a manifest, not a staging folder)."""
    return [path.parent for path in cache.rglob(MANIFEST) if not path.parent.name.startswith(".")]


@pytest.fixture
def store_client(object_store: Any) -> Any:
    return object_store.client()


@pytest.fixture
def uploaded(store_client: Any, s3_bucket: str, qwen35_text_checkpoint: Path) -> str:
    upload(store_client, s3_bucket, PREFIX, qwen35_text_checkpoint)
    return f"s3://{s3_bucket}/{PREFIX}/"


@pytest.fixture
def access(s3_bucket: str, object_store: Any, tmp_path: Path) -> ObjectStoreAccess:
    return ObjectStoreAccess(allowlist=(f"{s3_bucket}/models",), cache_dir=tmp_path / "cache",
                             endpoint_url=object_store.endpoint_url)


@pytest.fixture
def s3_environment(monkeypatch: pytest.MonkeyPatch, object_store: Any, s3_bucket: str, tmp_path: Path) -> Path:
    """The settings a command reads for an s3:// model: credentials (AWS chain), endpoint, allowlist, cache."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", object_store.secret_key)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "D3STREAM_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("D3STREAM_S3_ENDPOINT_URL", object_store.endpoint_url)
    monkeypatch.setenv("D3STREAM_S3_REGION", object_store.region)
    monkeypatch.setenv("D3STREAM_MODEL_ALLOWLIST", f"{s3_bucket}/models")
    monkeypatch.setenv("D3STREAM_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def decide(model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST), encoding="utf-8")
    capsys.readouterr()
    assert main(["decide", "--model", model, "--request", str(request), "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_decide_from_s3_answers_as_the_local_checkpoint(
    uploaded: str, s3_environment: Path, qwen35_text_checkpoint: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from_store = decide(f"tiny={uploaded}", tmp_path, capsys)
    local = decide(str(qwen35_text_checkpoint), tmp_path, capsys)
    for question in REQUEST["questions"]:
        assert from_store["answers"][question]["probabilities"] == local["answers"][question]["probabilities"]
    (copy,) = cached_copies(s3_environment)
    assert {path.name for path in copy.iterdir()} == {path.name for path in qwen35_text_checkpoint.iterdir()
                                                       if not path.name.startswith(".")}


def test_second_fetch_reuses_the_cache_until_the_manifest_changes(
    uploaded: str, access: ObjectStoreAccess, store_client: Any, s3_bucket: str,
    qwen35_text_checkpoint: Path, tmp_path: Path,
) -> None:
    calls = counting(store_client)
    first = fetch_checkpoint(uploaded, access, client=store_client)
    listed = len(read_manifest(qwen35_text_checkpoint)["files_sha256"])
    assert calls["GetObject"] == listed + 1  # the manifest, then every file it lists
    calls.clear()
    assert fetch_checkpoint(uploaded, access, client=store_client) == first
    assert calls["GetObject"] == 1, "a second start reads only the manifest"

    # A new checkpoint under the same prefix (one file changed, its manifest rewritten): downloaded again.
    changed = copy_checkpoint(qwen35_text_checkpoint, tmp_path / "changed")
    config = changed / "decision_config.json"
    config.write_text(config.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    manifest = read_manifest(changed)
    write_manifest(changed, model_name=manifest["model_name"], repo_id=manifest["repo_id"],
                   identity={k: v for k, v in manifest["identity"].items() if k != "model_sha256"})
    upload(store_client, s3_bucket, PREFIX, changed)
    calls.clear()
    second = fetch_checkpoint(uploaded, access, client=store_client)
    assert second != first and calls["GetObject"] == listed + 1
    assert (second / "decision_config.json").read_bytes() == config.read_bytes()


def _flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda client, bucket, key, data: client.put_object(Bucket=bucket, Key=key, Body=_flip_a_byte(data)),
         "SHA-256 differs"),
        (lambda client, bucket, key, data: client.put_object(Bucket=bucket, Key=key, Body=data[: len(data) // 2]),
         "partial or altered"),
        (lambda client, bucket, key, data: client.delete_object(Bucket=bucket, Key=key), "missing"),
    ],
    ids=["flipped-byte", "truncated", "missing"],
)
def test_a_damaged_file_refuses_the_checkpoint_naming_it(
    uploaded: str, access: ObjectStoreAccess, store_client: Any, s3_bucket: str, qwen35_text_checkpoint: Path,
    damage: Any, message: str,
) -> None:
    data = (qwen35_text_checkpoint / "model.safetensors").read_bytes()
    damage(store_client, s3_bucket, f"{PREFIX}/model.safetensors", data)
    with pytest.raises(CheckpointError, match=message) as refused:
        fetch_checkpoint(uploaded, access, client=store_client)
    assert f"{uploaded}model.safetensors" in str(refused.value)
    assert not cached_copies(access.cache_dir), "nothing refused may stay in the cache"
    assert not [p for p in access.cache_dir.rglob("*") if p.name.startswith(".")], "staging folders are removed"
    # Repaired, the same prefix downloads and verifies.
    store_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/model.safetensors", Body=data)
    assert (fetch_checkpoint(uploaded, access, client=store_client) / "model.safetensors").read_bytes() == data


def test_serve_refuses_a_tampered_checkpoint_before_kafka(
    uploaded: str, s3_environment: Path, store_client: Any, s3_bucket: str, qwen35_text_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tokenizer = (qwen35_text_checkpoint / "tokenizer_config.json").read_bytes()
    store_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/tokenizer_config.json", Body=_flip_a_byte(tokenizer))
    # No broker at this address: the refusal must come first.
    status = main(["serve", "--model", uploaded, "--bootstrap-servers", "127.0.0.1:9", "--metrics-port", ""])
    assert status == 2
    error = capsys.readouterr().err
    assert "tokenizer_config.json: SHA-256 differs" in error and "refused" in error


def test_an_s3_source_resolves_to_a_checkpoint_that_fetches(
    uploaded: str, access: ObjectStoreAccess, store_client: Any, s3_bucket: str,
) -> None:
    store_client.put_object(Bucket=s3_bucket, Key=f"models/{POINTER}",
                            Body=json.dumps({"schema": "d3-model-pointer/1", "current": "tiny"}).encode())
    pointer = resolve_source(f"s3://{s3_bucket}/models/", access, client=store_client)
    assert pointer.current == f"s3://{s3_bucket}/models/tiny" and pointer.canary is None
    assert (fetch_checkpoint(pointer.current, access, client=store_client) / MANIFEST).is_file()
    with pytest.raises(CheckpointError, match="model_allowlist"):
        resolve_source(f"s3://{s3_bucket}/elsewhere/", access, client=store_client)
