"""Shadow evaluation (``--shadow``, d3stream/core/shadow.py) on a real broker with two tiny real checkpoints: the
shadow's answers go to the shadow topic only and equal what the shadow model alone answers, the live
comparison metrics move, ``d3stream compare`` reads the live and the shadow topics, and a served model as
shadow answers the other's traffic, not its own.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

from d3stream.cli import main as cli_main
from d3stream.core.shadow import chosen
from d3stream.service import provenance_digest
from tests.support.stream_helpers import (
    Q_CHOICE,
    Q_NOUL,
    Q_SCORE,
    close_to,
    read_all,
    record,
    run,
    serve,
)

pytestmark = pytest.mark.timeout(300)

def _requests(count: int, prefix: str) -> list[dict[str, Any]]:
    requests = []
    for n in range(count):
        state = {"ticket": n, "text": "I was charged twice, please refund me " + "now " * (n % 3)}
        questions = {"refund": Q_NOUL} if n % 2 else {"refund": Q_NOUL, "team": Q_CHOICE, "urgency": Q_SCORE}
        requests.append({"id": f"{prefix}-{n:02d}", "state": state, "questions": questions})
    return requests


def test_shadow_answers_go_to_their_own_topic_and_equal_the_shadow_model_alone(
        stack, qwen35_text_model, demo_random_model, demo_random_checkpoint, tmp_path, capsys):
    live, shadow = qwen35_text_model, demo_random_model
    shadow_topic = f"{stack.answers}.shadow"
    requests = _requests(12, "sh")
    requests.append({"id": "sh-refused", "state": "s", "questions": {"refund": Q_NOUL}, "model": "no-such-model"})
    settings = stack.settings(shadow=f"{shadow.model_name}={demo_random_checkpoint}", shadow_share=0.5)

    service, reader = run(serve(stack, settings, [live], [record(r) for r in requests],
                                {r["id"] for r in requests}, shadow=shadow))
    shadowed = run(read_all(stack.broker.bootstrap_servers, shadow_topic, 4))

    # The live topic: one answer per request, every one from the live model.
    assert sorted(reader.counts().values()) == [1] * len(requests)
    assert {a["model"] for a in reader.answers()} == {live.model_name}
    # The shadow topic: exactly the requests the share picks (never a refused one), each once, from the shadow.
    expected = {r["id"] for r in requests[:-1] if chosen(r["id"], 0.5)}
    assert 0 < len(expected) < len(requests) - 1
    answers = [json.loads(r.value) for r in shadowed]
    assert collections.Counter(a["id"] for a in answers) == collections.Counter(expected)
    by_id = {r["id"]: r for r in requests}
    shadow_digest = next(h.provenance_sha256 for h in [service.shadow] if h is not None)
    for answer in answers:
        request = by_id[answer["id"]]
        assert answer["model"] == shadow.model_name
        assert answer["provenance"]["model"]["provenance_sha256"] == shadow_digest
        alone = shadow.system_one(state=request["state"], questions=request["questions"])
        close_to(answer["answers"], alone["answers"], answer["id"])
    # The shadow's own provenance record, beside the live model's.
    provenance = {r.key.decode(): json.loads(r.value) for r in run(read_all(stack.broker.bootstrap_servers,
                                                                              stack.provenance, 1))}
    assert shadow_digest in provenance and provenance_digest(provenance[shadow_digest]) == shadow_digest

    # The live comparison metrics moved, per model pair and question type, as compare counts them.
    def sample(name: str, **labels: str) -> float:
        value = service.metrics.registry.get_sample_value(
            name, {"live": live.model_name, "shadow": shadow.model_name, **labels})
        return value or 0.0

    assert sample("d3stream_shadow_requests_total", outcome="answered") == len(expected)
    compared = {kind: sample("d3stream_shadow_questions_total", type=kind, outcome="compared")
                for kind in ("noul", "choice", "score")}
    questions = collections.Counter(kind for rid in expected for kind in
                                    (q["type"] for q in by_id[rid]["questions"].values()))
    assert compared == {kind: questions[kind] for kind in compared}

    # d3stream compare reads the two topics as two answer sets; its figures are the metrics'.
    out = tmp_path / "report"
    status = cli_main(["compare", f"kafka:{stack.answers}", f"kafka:{shadow_topic}", "--json", "--out", str(out),
                       "--bootstrap-servers", stack.broker.bootstrap_servers])
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0 and (out / "report.md").exists()
    kinds = ("noul", "choice", "score")
    assert headline["only_b"] == 0 and headline["only_a"] == len(requests) - len(expected)
    assert headline["joined"] == sum(compared.values())
    agreements = sum(sample("d3stream_shadow_agreements_total", type=kind) for kind in kinds)
    abs_dp = sum(sample("d3stream_shadow_abs_dp_total", type=kind) for kind in kinds)
    options = sum(sample("d3stream_shadow_dp_options_total", type=kind) for kind in kinds)
    largest = max(sample("d3stream_shadow_max_abs_dp", type=kind) for kind in kinds)
    assert headline["agreement"] == pytest.approx(agreements / headline["joined"])
    assert headline["mean_abs_dp"] == pytest.approx(abs_dp / options, abs=1e-6)
    assert headline["max_abs_dp"] == pytest.approx(largest, abs=1e-6)
    assert largest > 0  # two different checkpoints: the comparison measured something


def test_a_served_model_as_shadow_answers_the_others_traffic_not_its_own(stack, qwen35_text_model, demo_random_model):
    live, other = qwen35_text_model, demo_random_model
    requests = _requests(6, "served")
    for request in requests[4:]:
        request["model"] = other.model_name  # routed to the shadow model itself: answered live, not shadowed
    settings = stack.settings(shadow=other.model_name)
    run(serve(stack, settings, [live, other], [record(r) for r in requests], {r["id"] for r in requests}))
    answers = [json.loads(r.value) for r in run(read_all(stack.broker.bootstrap_servers, f"{stack.answers}.shadow", 4))]
    assert sorted(a["id"] for a in answers) == [r["id"] for r in requests[:4]]
    by_id = {r["id"]: r for r in requests}
    for answer in answers:
        assert answer["model"] == other.model_name
        request = by_id[answer["id"]]
        close_to(answer["answers"], other.system_one(state=request["state"], questions=request["questions"])["answers"],
                 answer["id"])
