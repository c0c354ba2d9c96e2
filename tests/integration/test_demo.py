"""``d3stream demo`` end to end on the session's broker and object store, with the test checkpoints.

What a new user sees: a line when each step starts and ends, every published request answered (the malformed
record too, as an error and a dead letter), every one replayed through the second checkpoint, and the labelled
re-evaluation naming the trained checkpoint as the better one by a wide accuracy margin.
"""

from __future__ import annotations

import asyncio

from d3stream.dev.demo import HELDOUT_PICTURES, HELDOUT_TICKETS, run_demo
from d3stream.dev.tasks import showcase

# The showcase, the held-out draw, then video, mixed, invalid-question and malformed records.
PUBLISHED = len(showcase()) + HELDOUT_TICKETS + HELDOUT_PICTURES + 4


def test_demo_answers_every_request_and_the_trained_checkpoint_wins(
    kafka_broker, object_store, schema_registry, demo_trained_checkpoint, demo_random_checkpoint, monkeypatch
):
    # The demo puts the store's keys into the AWS environment, as a deployment would: undone afterwards.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", object_store.secret_key)
    lines: list[str] = []
    summary = asyncio.run(run_demo(progress=False, timeout_s=180, trained=demo_trained_checkpoint,
                                   baseline=demo_random_checkpoint, stack=(kafka_broker, object_store),
                                   registry=schema_registry, say=lines.append))
    # Each step says when it starts and when it ends (the servers were given: no step of theirs).
    for step in ("checkpoints", "publishing", "answers", "replay", "evaluation"):
        said = [line for line in lines if line.startswith(f"demo: {step}: ")]
        assert len(said) == 2 and said[1].startswith(f"demo: {step}: done in "), lines
    assert set(summary["step_seconds"]) == {"checkpoints", "publishing", "answers", "replay", "evaluation"}
    assert summary["published"] == summary["answered"] == summary["replayed"] == PUBLISHED
    assert summary["framed"] == (PUBLISHED - 1) // 3  # every third request through the registry as Avro
    assert summary["errors"] == 1 and summary["dead_letters"] == 1  # the malformed record
    by_id = {answer["id"]: answer for answer in summary["answers"]}
    assert by_id["demo-bad-question"]["answers"]["bad"]["error"] == "invalid_question"
    assert "error" not in by_id["picture-red"]  # fetched from the object store
    figures = summary["reevaluation"]
    assert figures["checkpoints"] == ["d3-demo-qwen3_5-tiny-seed0", "d3-random-qwen3_5-tiny-seed0"]
    assert figures["labelled"] == 3 * (len(showcase()) - 2 + HELDOUT_TICKETS) + 2 + HELDOUT_PICTURES
    assert figures["better"] == "d3-demo-qwen3_5-tiny-seed0"
    assert figures["accuracy"][0] >= figures["accuracy"][1] + 0.5
    assert figures["brier"][0] < figures["brier"][1]
    # d3stream evaluate ran beside the worker: every labelled answer evaluated once, labels before and after.
    live = summary["live_evaluation"]
    assert live["evaluations"] == live["expected"] == len(summary["labelled_ids"])
    assert summary["live_equals_offline"], (live, figures)
