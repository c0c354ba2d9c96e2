"""Several checkpoints in one worker (``--model NAME=PATH`` repeated), against a real broker and two tiny real
checkpoints: requests routed by ``model`` get exactly what each model alone answers, every answer names its
model and carries that model's provenance digest, the provenance topic holds one record per model, an
unknown name is refused naming the served ones, passes of the two models never overlap, and models that do
not fit the memory bound are refused at start, before any is loaded.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from d3stream_client.contract import decode_answer

from d3stream.cli import main as cli_main
from d3stream.models.checkpoints import checkpoint_memory_bytes
from d3stream.service import answer_identity, provenance_digest
from d3stream.settings import load_settings
from tests.stream_helpers import close_to, read_all, record, run, serve

Q_NOUL = {"type": "noul", "instructions": "Is the customer asking for a refund?"}
Q_CHOICE = {"type": "choice", "instructions": "Which team?",
            "criteria": {"billing": "billing and payments", "tech": "technical support", "sales": "sales"}}


class OverlapWatch:
    """The real model, whose forward passes note how many passes (of any watched model) run at once."""

    def __init__(self, model: Any, shared: dict[str, int], lock: threading.Lock):
        self._model, self._shared, self._lock = model, shared, lock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, rows: Any) -> Any:
        with self._lock:
            self._shared["now"] += 1
            self._shared["most"] = max(self._shared["most"], self._shared["now"])
        try:
            time.sleep(0.01)  # long enough for a pass of the other model to start beside it, were it allowed
            return self._model.forward(rows)
        finally:
            with self._lock:
                self._shared["now"] -= 1


def test_two_models_in_one_worker_answer_as_each_alone(stack, qwen35_text_model, demo_random_model):
    first, second = qwen35_text_model, demo_random_model
    assert first.model_name != second.model_name
    shared = {"now": 0, "most": 0}
    lock = threading.Lock()
    watched = [OverlapWatch(first, shared, lock), OverlapWatch(second, shared, lock)]
    requests: list[dict[str, Any]] = []
    for n in range(8):
        state = {"ticket": n, "text": "I was charged twice, please refund me " + "now " * (n % 3)}
        # Single questions ride full-prompt passes (the watched forward); two share a prefix.
        questions = {"refund": Q_NOUL} if n % 2 else {"refund": Q_NOUL, "team": Q_CHOICE}
        route = [None, first.model_name, second.model_name, second.model_name][n % 4]
        requests.append({"id": f"r{n}", "state": state, "questions": questions,
                         **({"model": route} if route else {})})
    requests.append({"id": "unknown", "state": "s", "questions": {"refund": Q_NOUL}, "model": "no-such-model"})

    service, reader = run(serve(stack, stack.settings(linger_ms=20), watched, [record(r) for r in requests],
                                {r["id"] for r in requests}))
    answers = {a["id"]: a for a in reader.answers()}
    assert len(reader.answers()) == len(requests) == len(answers)
    digests = {hosted.name: hosted.provenance_sha256 for hosted in service.hosted}
    assert len(set(digests.values())) == 2
    by_name = {first.model_name: first, second.model_name: second}
    for request in requests[:-1]:
        answer = answers[request["id"]]
        name = request.get("model", first.model_name)  # absent: the default (first) model
        assert "error" not in answer, answer
        assert not [key for key, slot in answer["answers"].items() if "error" in slot], answer["answers"]
        alone = by_name[name].system_one(state=request["state"], questions=request["questions"])
        close_to(answer["answers"], alone["answers"], request["id"])
        assert answer["model"] == name
        assert answer["provenance"]["model"]["name"] == name
        assert answer["provenance"]["model"]["provenance_sha256"] == digests[name]
        # Deterministic per model: the same record answered by the other model would get another id.
        assert answer["answer_id"] == answer_identity(decode_answer(json.dumps(answer).encode()), digests[name])

    refused = answers["unknown"]["error"]
    assert refused["code"] == "model_not_served"
    assert repr(first.model_name) in refused["message"] and repr(second.model_name) in refused["message"]
    assert "no-such-model" in refused["message"]

    # One record per loaded model on the provenance topic, keyed by its digest.
    records = run(read_all(stack.broker.bootstrap_servers, stack.provenance, 1))
    stored = {r.key.decode(): json.loads(r.value) for r in records}
    assert set(stored) == set(digests.values())
    assert {provenance_digest(value) for value in stored.values()} == set(stored)

    # One device, one model thread: the two models' passes took turns.
    assert shared["most"] == 1
    assert all(hosted.passes.rows.passes_run > 0 for hosted in service.hosted)


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
