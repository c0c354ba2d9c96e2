"""Shadow evaluation (``--shadow``, d3stream/core/shadow.py) on a real broker with two tiny real checkpoints: the
shadow's answers go to the shadow topic only and equal what the shadow model alone answers, a share of 0.5
picks the same requests every time, the live comparison metrics move, ``d3stream compare`` reads the live and
the shadow topics, and a worker SIGKILLed mid-stream loses and repeats nothing on either topic.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.benchmarks.chaos import WorkerProcess, count_topic, worker_env
from d3stream.cli import main as cli_main
from d3stream.core.shadow import chosen
from d3stream.models.shadow import parse_shadow, shadow_hosted
from d3stream.service import provenance_digest
from d3stream.settings import load_settings
from tests.stream_helpers import Q_CHOICE, Q_NOUL, Q_SCORE, Reader, close_to, read_all, record, run, serve

pytestmark = pytest.mark.timeout(300)

def _requests(count: int, prefix: str) -> list[dict[str, Any]]:
    requests = []
    for n in range(count):
        state = {"ticket": n, "text": "I was charged twice, please refund me " + "now " * (n % 3)}
        questions = {"refund": Q_NOUL} if n % 2 else {"refund": Q_NOUL, "team": Q_CHOICE, "urgency": Q_SCORE}
        requests.append({"id": f"{prefix}-{n:02d}", "state": state, "questions": questions})
    return requests


def test_a_share_of_0_5_picks_the_same_requests_by_id_alone():
    ids = [f"request-{n}" for n in range(2000)]
    picked = {rid for rid in ids if chosen(rid, 0.5)}
    assert picked == {rid for rid in reversed(ids) if chosen(rid, 0.5)}  # a function of the id, not of order
    assert 900 < len(picked) < 1100
    assert {rid for rid in ids if chosen(rid, 0.1)} <= picked  # a smaller share is a subset: raising it adds
    assert all(chosen(rid, 1.0) for rid in ids) and not any(chosen(rid, 0.0) for rid in ids)


def test_shadow_values_are_a_checkpoint_of_its_own_or_a_served_name(tmp_path):
    assert parse_shadow("cand=/ckpt/v5").location == "/ckpt/v5"
    assert parse_shadow("live").location is None
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_shadow("/ckpt/v5")
    with pytest.raises(ValueError, match="shadow_share"):
        load_settings({"shadow": "live", "shadow_share": "1.5"}, environ={})

    class Served:
        name = "live"

    with pytest.raises(ValueError, match="not a served model .*'live'"):
        shadow_hosted(load_settings({"shadow": "other"}, environ={}).models, [Served()], None)


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


def test_a_worker_killed_mid_stream_loses_and_repeats_nothing_on_either_topic(
        stack, qwen35_text_checkpoint, demo_random_checkpoint, tmp_path, capsys):
    bootstrap = stack.broker.bootstrap_servers
    shadow_topic = f"{stack.answers}.shadow"
    requests = _requests(36, "kill")
    rng = random.Random(5)
    env = worker_env({
        "bootstrap_servers": bootstrap, "request_topics": [stack.requests], "answer_topic": stack.answers,
        "dead_letter_topic": stack.dead_letters, "provenance_topic": stack.provenance, "group_id": stack.group,
        "group_instance_id": f"{stack.group}-0", "session_timeout_ms": 6000,
        "model": f"live={qwen35_text_checkpoint}", "shadow": f"candidate={demo_random_checkpoint}",
        # Commits every 3 s: the kill lands with answers (and their shadows) computed but not committed.
        "commit_interval_ms": 3000, "linger_ms": 10, "metrics_port": "", "log_format": "json",
    })
    env.pop("D3STREAM_CONFIG", None)
    worker = WorkerProcess(env, tmp_path / "worker.log")
    first, second, third = requests[:12], requests[12:24], requests[24:]

    def serving() -> int:
        return worker.log_path.read_text(errors="replace").count('"event": "serving"') if worker.log_path.exists() else 0

    async def scenario() -> tuple[int, int]:
        async with Reader(bootstrap, stack.answers) as reader:
            worker.start()
            try:
                await reader.wait(lambda: serving() >= 1 or worker.process.poll() is not None, 120, what="serving")
                await produce(bootstrap, stack.requests, [record(r) for r in first])
                await reader.wait(lambda: len(reader.counts()) > 0, 60, what="a first commit")
                await produce(bootstrap, stack.requests, [record(r) for r in second])
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                worker.kill()
                at_kill = len(reader.counts())
                worker.start()
                await produce(bootstrap, stack.requests, [record(r) for r in third])
                await reader.wait_ids({r["id"] for r in requests}, 120)
            finally:
                rc = worker.terminate(60)
            assert rc == 0, worker.log_path.read_text()[-3000:]
            return at_kill, 24

    at_kill, published = run(scenario())
    assert at_kill < published, "the kill landed after every answer was committed: it proved nothing"
    ids = collections.Counter(r["id"] for r in requests)
    for topic, model in ((stack.answers, "live"), (shadow_topic, "candidate")):
        answers = run(count_topic(bootstrap, topic))
        assert collections.Counter(a["id"] for a in answers) == ids, topic  # none lost, none twice
        assert {a["model"] for a in answers} == {model}, topic
        assert all("answers" in a for a in answers), topic
    with capsys.disabled():
        print(f"\n[shadow kill] {at_kill} of {published} requests committed when the worker was killed")


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
