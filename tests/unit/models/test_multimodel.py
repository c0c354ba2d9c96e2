"""Several checkpoints in one worker, without a broker: repeated ``--model`` flags are several models and a TOML
string is one, models that do not fit the memory bound are refused at start naming each, and a replay runs
one model. Serving them: tests/integration/test_multimodel.py."""

from __future__ import annotations

from d3stream.cli import main as cli_main
from d3stream.models.checkpoints import checkpoint_memory_bytes
from d3stream.settings import load_settings


def test_several_model_flags_are_several_models_and_a_toml_string_is_one(tmp_path):
    settings = load_settings({"model": ["a=/ckpt/one", "b=/ckpt/two,/ckpt/three"]})
    assert settings.models.checkpoints == ["a=/ckpt/one", "b=/ckpt/two", "/ckpt/three"]
    (tmp_path / "d3stream.toml").write_text('model = "/ckpt/one"\n')
    assert load_settings({}, environ={}, config_file=tmp_path / "d3stream.toml").models.checkpoints == ["/ckpt/one"]


def test_models_that_do_not_fit_are_refused_at_start_naming_each(qwen35_text_checkpoint, demo_random_checkpoint,
                                                                  qwen35_text_model, capsys):
    needs = checkpoint_memory_bytes(qwen35_text_checkpoint)
    # The estimate is the loaded weights: parameters x the dtype they are loaded in (a few small tensors
    # transformers keeps in FP32 or adds at load make up the difference).
    loaded = sum(p.numel() * p.element_size() for p in qwen35_text_model.backbone.parameters())
    loaded += qwen35_text_model.readout.numel() * qwen35_text_model.readout.element_size()
    assert abs(needs - loaded) <= 0.05 * loaded, (needs, loaded)
    status = cli_main(["serve", "--model", f"text={qwen35_text_checkpoint}", "--model", f"demo={demo_random_checkpoint}",
                       "--model-memory-bytes", str(needs), "--metrics-port", "none",
                       "--bootstrap-servers", "127.0.0.1:1"])
    message = capsys.readouterr().err
    assert status == 2
    assert "the models do not fit" in message and "model_memory_bytes" in message
    assert "text " in message and "demo " in message, message


def test_replay_runs_one_model(capsys):
    status = cli_main(["replay", "--from-topic", "t", "--replay-id", "r", "--out", "x.jsonl", "--model", "a=/x", "--model", "b=/y"])
    assert status == 2
    assert "a replay runs one" in capsys.readouterr().err
