"""Rolling out models without a broker (d3stream/models/rollout.py): canary settings, a checkpoint of another
format version or one that verifies but answers no probability is refused, and serve refuses a source whose
current checkpoint is tampered, or does not fit beside the other models, before it connects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from d3stream.cli import main as cli_main
from d3stream.models.checkpoints import POINTER, checkpoint_memory_bytes
from d3stream.models.rollout import (
    RefusedCheckpoint,
    load_checkpoint,
    parse_canary,
    share_point,
    warm_up,
)
from d3stream.runtime.package import read_manifest, write_manifest
from d3stream.service import Service
from d3stream.settings import Settings
from tests.support.model_fixtures import copy_checkpoint

# serve sets up logging in process, on the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_restored")


def write_pointer(put: Any, current: str, canary: tuple[str, float] | None = None) -> None:
    """A pointer document handed to ``put`` (bytes): one atomic write of CURRENT.json."""
    document: dict[str, Any] = {"schema": "d3-model-pointer/1", "current": current}
    if canary is not None:
        document["canary"] = {"checkpoint": canary[0], "share": canary[1]}
    put(json.dumps(document).encode())


def local_pointer(root: Path) -> Any:
    def put(data: bytes) -> None:
        staging = root / ".CURRENT.json.tmp"
        staging.write_bytes(data)
        staging.replace(root / POINTER)  # readers see the old pointer or the new one, never a mix

    return put


def test_canary_settings_and_a_checkpoint_of_another_format_version(
    tmp_path: Path, qwen35_text_checkpoint: Path, qwen35_text_model: Any,
) -> None:
    assert parse_canary("d3-v5=0.05") == ("d3-v5", 0.05)
    for bad in ("d3-v5", "d3-v5=1.5", "d3-v5=-0.1", "d3-v5=half", "a/b=0.1"):
        with pytest.raises(ValueError, match="canary must be NAME=SHARE"):
            parse_canary(bad)
    with pytest.raises(ValueError, match="canary names 'nope', which is not served"):
        Service(Settings.from_flat(canary="nope=0.1", metrics_port=None), [qwen35_text_model])
    # The split is a property of the id alone: the same on every worker, about uniform.
    points = [share_point(f"r-{n}") for n in range(2000)]
    assert points == [share_point(f"r-{n}") for n in range(2000)]
    assert abs(sum(p < 0.25 for p in points) / len(points) - 0.25) < 0.03

    newer = copy_checkpoint(qwen35_text_checkpoint, tmp_path / "source" / "v9")
    config = newer / "decision_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "format_version": 99}))
    manifest = read_manifest(newer)
    write_manifest(newer, model_name=manifest["model_name"], repo_id=manifest["repo_id"],
                   identity={k: v for k, v in manifest["identity"].items() if k != "model_sha256"})
    with pytest.raises(RefusedCheckpoint, match="format_version 99") as refused:
        load_checkpoint(str(newer), Settings().models, Settings().storage)
    assert refused.value.outcome == "refused_verification"

    # The old model stays loaded while the new one loads: both must fit (model_memory_bytes), else refused.
    needs = checkpoint_memory_bytes(qwen35_text_checkpoint)
    fits_one = Settings.from_flat(model_memory_bytes=needs)
    with pytest.raises(RefusedCheckpoint, match="the models do not fit") as refused:
        load_checkpoint(str(qwen35_text_checkpoint), fits_one.models, fits_one.storage,
                        [qwen35_text_checkpoint])
    assert refused.value.outcome == "refused_memory" and "model_memory_bytes" in str(refused.value)


def test_serve_refuses_a_source_whose_current_checkpoint_is_tampered(
    tmp_path: Path, qwen35_text_checkpoint: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "source"
    damaged = copy_checkpoint(qwen35_text_checkpoint, source / "v1") / "tokenizer_config.json"
    data = damaged.read_bytes()
    damaged.write_bytes(data[:10] + bytes([data[10] ^ 0x01]) + data[11:])
    write_pointer(local_pointer(source), "v1")
    # No broker at this address: the refusal must come first.
    status = cli_main(["serve", "--model-source", str(source), "--bootstrap-servers", "127.0.0.1:9",
                       "--metrics-port", ""])
    error = capsys.readouterr().err
    assert status == 2
    assert f"model_source {source}" in error and "tokenizer_config.json: SHA-256 differs" in error, error


def test_serve_refuses_a_source_checkpoint_that_does_not_fit_beside_the_other_models(
    tmp_path: Path, qwen35_text_checkpoint: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "source"
    copy_checkpoint(qwen35_text_checkpoint, source / "v1")
    write_pointer(local_pointer(source), "v1")
    one = checkpoint_memory_bytes(qwen35_text_checkpoint)  # room for one checkpoint, not for two
    status = cli_main(["serve", "--model-source", str(source), "--model", f"pinned={qwen35_text_checkpoint}",
                       "--model-memory-bytes", str(one + one // 2), "--bootstrap-servers", "127.0.0.1:9",
                       "--metrics-port", ""])
    error = capsys.readouterr().err
    assert status == 2
    assert f"model_source {source}" in error and "the models do not fit" in error, error


@pytest.mark.slow
def test_a_checkpoint_that_verifies_but_answers_no_probability_is_refused_at_warm_up(
    tmp_path: Path, qwen35_text_checkpoint: Path,
) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    broken = copy_checkpoint(qwen35_text_checkpoint, tmp_path / "source" / "nan")
    readout = broken / "readout.safetensors"
    weight = load_file(str(readout))["weight"]
    readout.unlink()  # it may be a link to the fixture's file
    save_file({"weight": torch.full_like(weight, float("nan"))}, str(readout))
    manifest = read_manifest(broken)
    write_manifest(broken, model_name=manifest["model_name"], repo_id=manifest["repo_id"],
                   identity={k: v for k, v in manifest["identity"].items() if k != "model_sha256"})
    # A manifest that matches: it verifies.
    model = load_checkpoint(str(broken), Settings().models, Settings().storage)
    with pytest.raises(RefusedCheckpoint, match="warm-up") as refused:
        warm_up(model, str(broken))
    assert refused.value.outcome == "refused_warmup"
