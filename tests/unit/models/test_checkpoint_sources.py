"""Model specs and model-source pointers without a store (d3stream/models/checkpoints.py, rollout.py): the model
allowlist checked by every command that takes a model before any network call, the forms of ``--model``, and a
local source resolving to its current checkpoint and canary. The same from object storage:
tests/integration/test_checkpoints_from_s3.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from d3stream.cli import main
from d3stream.models.checkpoints import (
    POINTER,
    Canary,
    CheckpointError,
    ModelSpec,
    ObjectStoreAccess,
    fetch_checkpoint,
    parse_model_spec,
    parse_model_specs,
    resolve_source,
)

# Commands run in process set up logging on the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_restored")
REQUEST = {
    "state": {"text": "My card was charged twice. Please give me my money back."},
    "questions": {
        "team": {"type": "choice", "criteria": {"billing": "payments", "tech": "bugs", "sales": None}},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    },
}


def counting(client: Any) -> Counter[str]:
    """Count the S3 operations a real client sends (``GetObject``: 3), and every request it sends."""
    calls: Counter[str] = Counter()
    client.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]))
    client.meta.events.register("before-send.s3", lambda **_: calls.update(["sent"]))
    return calls


@pytest.fixture
def access(s3_bucket: str, object_store: Any, tmp_path: Path) -> ObjectStoreAccess:
    return ObjectStoreAccess(allowlist=(f"{s3_bucket}/models",), cache_dir=tmp_path / "cache",
                             endpoint_url=object_store.endpoint_url)


def decide(model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST), encoding="utf-8")
    capsys.readouterr()
    assert main(["decide", "--model", model, "--request", str(request), "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("command", [
    ["serve"],
    ["replay", "--from-topic", "d3.requests", "--replay-id", "r1", "--out", "replayed.jsonl"],
    ["decide", "--request", "request.json"],
    ["demo-task", "heldout", "--tickets", "1", "--pictures", "0", "--answer-with"],
])
def test_every_command_taking_a_model_checks_the_model_allowlist(
    command: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("D3STREAM_CONFIG", raising=False)
    monkeypatch.setenv("D3STREAM_MODEL_ALLOWLIST", "allowed/models")
    monkeypatch.setenv("D3STREAM_S3_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: no call may be made
    (tmp_path / "request.json").write_text(json.dumps(REQUEST), encoding="utf-8")
    model = "s3://elsewhere/models/tiny/"
    argv = [*command, model] if command[-1] == "--answer-with" else [*command, "--model", model]
    if command[0] in ("serve", "replay"):
        argv += ["--metrics-port", "", "--bootstrap-servers", "127.0.0.1:9"]
    try:
        status: Any = main(argv)
        message = capsys.readouterr().err
    except SystemExit as exc:  # decide and demo-task exit with the reason
        status, message = 2, str(exc)
    assert status == 2 and "model_allowlist" in message and "s3://elsewhere/models/tiny/" in message


@pytest.mark.parametrize("uri", ["s3://other-bucket/models/tiny/", "s3://allowed/models-evil/tiny/",
                                 "s3://allowed/tiny/", "s3://allowed/models/tiny?versionId=3"])
def test_a_checkpoint_outside_the_allowlist_is_refused_before_any_network_call(uri: str, tmp_path: Path) -> None:
    import boto3

    # A real client aimed at a port nothing listens on: any request it sent would be counted (and fail).
    client = boto3.client("s3", endpoint_url="http://127.0.0.1:9", aws_access_key_id="x", aws_secret_access_key="y",
                          region_name="us-east-1")
    calls = counting(client)
    access = ObjectStoreAccess(allowlist=("allowed/models",), cache_dir=tmp_path)
    with pytest.raises(CheckpointError, match="model_allowlist|versionId"):
        fetch_checkpoint(uri, access, client=client)
    assert not calls and not list(tmp_path.iterdir())


def test_model_specs() -> None:
    assert parse_model_spec("/models/d3") == ModelSpec(None, "/models/d3")
    assert parse_model_spec("v4=s3://bucket/models/v4/") == ModelSpec("v4", "s3://bucket/models/v4/")
    assert parse_model_spec("./a=b") == ModelSpec(None, "./a=b")
    assert parse_model_spec("s3://bucket/a=b/") == ModelSpec(None, "s3://bucket/a=b/")
    assert parse_model_spec("s3://bucket/models/v4/").in_object_store
    with pytest.raises(CheckpointError, match="NAME="):
        parse_model_spec("v4=")
    with pytest.raises(CheckpointError, match="v4 more than once"):
        parse_model_specs(["v4=/a", "v4=/b", "/c"])


def _write_pointer(root: Path, document: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / POINTER).write_text(json.dumps(document), encoding="utf-8")


def test_a_local_source_resolves_to_its_current_checkpoint_and_canary(tmp_path: Path) -> None:
    source = tmp_path / "source"
    _write_pointer(source, {"schema": "d3-model-pointer/1", "current": "d3-v4",
                            "canary": {"checkpoint": "d3-v5", "share": 0.05}})
    pointer = resolve_source(str(source))
    assert pointer.current == f"{source}/d3-v4"
    assert pointer.canary == Canary(f"{source}/d3-v5", 0.05)
    for broken, reason in [
        ({"schema": "d3-model-pointer/1", "current": "../elsewhere"}, "one path segment"),
        ({"schema": "d3-model-pointer/1", "current": "a/b"}, "one path segment"),
        ({"schema": "d3-model-pointer/1", "current": "v4", "canary": {"checkpoint": "v5", "share": 1.5}}, "0 to 1"),
        ({"schema": "d3-model-pointer/1", "current": "v4", "canary": {"checkpoint": "v4", "share": 0.1}},
         "is the current"),
        ({"current": "v4"}, "schema"),
        ({"schema": "d3-model-pointer/1", "current": "v4", "shadow": "v5"}, "unknown fields shadow"),
    ]:
        _write_pointer(source, broken)
        with pytest.raises(CheckpointError, match=reason):
            resolve_source(str(source))
    with pytest.raises(CheckpointError, match=f"{POINTER} is missing"):
        resolve_source(str(tmp_path / "empty"))
