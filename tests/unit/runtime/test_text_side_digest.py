"""Which files decide whether two checkpoints may share a tokenizer and processor (runtime/loading.py)."""

from __future__ import annotations

from pathlib import Path

from d3stream.runtime.loading import text_side_digest


def _checkpoint(root: Path) -> Path:
    root.mkdir()
    (root / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (root / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "MODEL_MANIFEST.json").write_text('{"version": 1}')
    (root / "d3_format.py").write_text("FORMAT_ID = 'd3-format/1'\n")
    (root / "additional_chat_templates").mkdir()
    (root / "additional_chat_templates" / "tool.jinja").write_text("{{ messages }}")
    return root


def test_weights_and_d3streams_own_files_do_not_count_and_the_tokenizers_files_do(tmp_path):
    root = _checkpoint(tmp_path / "checkpoint")
    first = text_side_digest(root)
    (root / "model.safetensors").write_bytes(b"other weights")
    (root / "MODEL_MANIFEST.json").write_text('{"version": 2}')
    (root / "d3_format.py").write_text("FORMAT_ID = 'd3-format/1'  # edited\n")
    assert text_side_digest(root) == first  # the next version of the same checkpoint shares
    (root / "additional_chat_templates" / "tool.jinja").write_text("{{ other }}")
    second = text_side_digest(root)
    assert second != first
    (root / "tokenizer_config.json").write_text('{"model_max_length": 8192}')
    assert text_side_digest(root) not in (first, second)
