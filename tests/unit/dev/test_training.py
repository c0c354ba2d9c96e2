"""The trained demo checkpoint (``make-checkpoint --train demo``): its answers follow the requests.

On the held-out draw of the synthetic task (``d3stream.dev.tasks.heldout``: a seed never trained on) the trained
checkpoint must beat the random-weight checkpoint it was trained from by a wide margin in accuracy, and in
Brier score too, measured as ``d3stream compare --labels`` measures it (``compare.compare`` with the label
records). It is an ordinary checkpoint: its manifest verifies in full and says what was trained; training is
deterministic for a seed (the same files, byte for byte). Agreement with the reference runtime is in
``tests/unit/runtime/test_model.py`` (``test_matches_reference_trained_demo``).
"""

from __future__ import annotations

import json
import shutil

import pytest

from d3stream.core import agreement
from d3stream.dev import tasks
from d3stream.dev.build_checkpoint import build_checkpoint
from d3stream.dev.train import DEFAULT_STEPS, train_demo
from d3stream.jobs import compare
from d3stream.runtime.package import package_files, sha256_file, verify_package

# The trained checkpoint's held-out accuracy must exceed the random one's by at least this much (measured:
# 0.29 random against 0.97 trained, on the task's own held-out draw).
ACCURACY_MARGIN = 0.5
# And each question of the task must be answered better than chance by a clear distance (measured: team 1.0,
# refund 0.98, urgency 0.95, red_square 0.9).
PER_QUESTION_ACCURACY = {"team": 0.85, "refund": 0.85, "urgency": 0.8, "red_square": 0.75}

# The trained demo model loads once per pytest worker that runs a test of it: `make test` keeps the modules that
# judge it on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("demo-trained")


@pytest.fixture(scope="module")
def heldout_report(demo_trained_model, demo_random_model, tmp_path_factory) -> compare.Report:
    examples = tasks.heldout()
    _, labels_file = tasks.write_task(tmp_path_factory.mktemp("heldout"), examples)
    labels = compare.load_labels(labels_file)
    return compare.compare(
        tasks.answer_records(demo_random_model, examples), tasks.answer_records(demo_trained_model, examples), labels
    )


def test_trained_beats_random_on_heldout_labels(heldout_report):
    labels = heldout_report.labels
    assert labels is not None and labels.n == 60 * 3 + 20 and labels.invalid == 0 and labels.unmatched == 0
    random_side, trained = labels.a, labels.b
    assert trained.accuracy >= random_side.accuracy + ACCURACY_MARGIN, (random_side, trained)
    assert trained.brier < random_side.brier / 2
    assert trained.ece < random_side.ece


def test_every_question_of_the_task_is_learned(heldout_report):
    correct: dict[str, list[bool]] = {}
    expected = {(r["id"], r["question"]): r["answer"] for r in tasks.label_records(tasks.heldout())}
    for question in heldout_report.joined:
        key = agreement.label_key(question.b, expected[(question.request_id, question.question_id)])
        correct.setdefault(question.question_id, []).append(question.b.decision == key)
    accuracy = {name: sum(values) / len(values) for name, values in correct.items()}
    assert accuracy.keys() == PER_QUESTION_ACCURACY.keys()
    for name, floor in PER_QUESTION_ACCURACY.items():
        assert accuracy[name] >= floor, accuracy


def test_refund_probability_follows_the_request(heldout_report):
    """The held-out tickets that ask for their money back get a high refund probability, the others a low
    one (on average; the random checkpoint gives both about the same)."""
    expected = {(r["id"], r["question"]): r["answer"] for r in tasks.label_records(tasks.heldout())}
    by_label: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for question in heldout_report.joined:
        if question.question_id == "refund":
            label = expected[(question.request_id, "refund")]
            by_label[label].append((question.a.probabilities["true"], question.b.probabilities["true"]))
    asked = [trained for _, trained in by_label[True]]
    not_asked = [trained for _, trained in by_label[False]]
    assert len(asked) >= 15 and len(not_asked) >= 15
    assert sum(asked) / len(asked) > 0.65 > 0.35 > sum(not_asked) / len(not_asked)
    random_gap = abs(sum(a for a, _ in by_label[True]) / len(asked) - sum(a for a, _ in by_label[False]) / len(not_asked))
    assert random_gap < 0.1


def test_answers_follow_the_requests(demo_trained_model):
    """Some of what the demo prints (the showcase tickets and pictures): the urgent ticket is scored urgent
    and the one that can wait low, the picture with a red square is said to have one, the other not. (Every
    showcase answer is held right in test_heldout_wordings.py.)"""
    answers = tasks.answer_records(demo_trained_model, tasks.showcase())
    charged_twice, crash = answers["ticket-1"]["answers"], answers["ticket-2"]["answers"]
    assert crash["urgency"]["score"] < 0.5 < 1.5 < charged_twice["urgency"]["score"]
    assert answers["picture-red"]["answers"]["red_square"]["noul"] > 0.5
    assert answers["picture-no-red"]["answers"]["red_square"]["noul"] < 0.5


def test_trained_checkpoint_is_an_ordinary_checkpoint(demo_trained_checkpoint, demo_random_checkpoint):
    manifest = verify_package(demo_trained_checkpoint, "full")
    assert manifest["model_name"] == "d3-demo-qwen3_5-tiny-seed0"
    trained = manifest["identity"]["trained"]
    assert trained["task"] == "demo" and trained["steps"] == DEFAULT_STEPS
    assert trained["trained"] == ["language_model.embed_tokens", "language_model.layers.3", "language_model.norm",
                                  "readout"]
    assert 500 < trained["embedded_tokens"] < 2000  # the words of the tickets, not the frame's nor the vocabulary
    # Only the weights changed: the tokenizer, processor and prompt contract are the builder's.
    for name in package_files(demo_random_checkpoint):
        same = sha256_file(demo_trained_checkpoint / name) == sha256_file(demo_random_checkpoint / name)
        assert same == (name not in ("model.safetensors", "readout.safetensors")), name


@pytest.mark.slow
def test_training_is_deterministic_for_a_seed(demo_random_checkpoint, tmp_path):
    """Two trainings of the same checkpoint with the same seed write the same bytes (a small task, few steps)."""
    digests = []
    for name in ("one", "two"):
        root = shutil.copytree(demo_random_checkpoint, tmp_path / name)
        train_demo(root, steps=10, seed=3, tickets=12, pictures=4)
        digests.append({f: sha256_file(root / f) for f in ("model.safetensors", "readout.safetensors")})
    assert digests[0] == digests[1]
    assert digests[0]["readout.safetensors"] != sha256_file(demo_random_checkpoint / "readout.safetensors")


def test_training_refuses_what_it_cannot_fit(tmp_path):
    with pytest.raises(ValueError, match="--size tiny"):
        build_checkpoint(tmp_path / "big", size="0.8b", train="demo")
    with pytest.raises(ValueError, match="train must be one of"):
        build_checkpoint(tmp_path / "other", train="imagenet")
    with pytest.raises(ValueError, match="--train-steps"):
        build_checkpoint(tmp_path / "negative", train="demo", train_steps=-1)
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_demo_task_files_feed_compare_labels(demo_trained_checkpoint, demo_random_checkpoint, tmp_path, capsys):
    """``d3stream demo-task`` writes the held-out requests, labels and each checkpoint's answers; ``d3stream
    compare --labels`` over them names the trained checkpoint the more accurate."""
    from d3stream.cli import main

    out = tmp_path / "heldout"
    args = ["demo-task", str(out), "--tickets", "6", "--pictures", "2"]
    assert main([*args, "--answer-with", str(demo_trained_checkpoint), "--answer-with", str(demo_random_checkpoint)]) == 0
    requests = compare.read_jsonl(out / "requests.jsonl")
    assert [r["id"] for r in requests] == [e.id for e in tasks.draw(tasks.HELDOUT_SEED, 6, 2, prefix="heldout")]
    assert len(compare.read_jsonl(out / "labels.jsonl")) == 6 * 3 + 2
    capsys.readouterr()
    trained, random_ = out / "answers-d3-demo-qwen3_5-tiny-seed0.jsonl", out / "answers-d3-random-qwen3_5-tiny-seed0.jsonl"
    assert main(["compare", str(random_), str(trained), "--labels", str(out / "labels.jsonl"), "--json",
                 "--out", str(tmp_path / "report")]) == 0
    headline = json.loads(capsys.readouterr().out)
    assert headline["labelled"] == 20
    assert headline["accuracy_b"] > headline["accuracy_a"]
