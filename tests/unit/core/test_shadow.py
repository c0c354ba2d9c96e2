"""Shadow evaluation without a broker (d3stream/core/shadow.py, d3stream/models/shadow.py): a share of 0.5 picks
the same requests by their id alone, and a shadow is a checkpoint of its own or a served name."""

from __future__ import annotations

import pytest

from d3stream.core.shadow import chosen
from d3stream.models.shadow import parse_shadow, shadow_hosted
from d3stream.settings import load_settings

pytestmark = pytest.mark.timeout(300)


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


def test_a_shadow_failing_after_some_answers_were_delivered_still_answers_every_other_request():
    """The shadow's passes fail after one request's shadow answer went out and was delivered: every other request
    still comes out once, with a shadow error answer, and the delivered one is not touched again (its offset
    would otherwise never be committed: the failure path stopped at the delivered record)."""
    import asyncio
    import json
    import time

    from d3stream_client.contract import HEADERS, decode_answer

    from d3stream.benchmarks.bench_sched import BenchRecord
    from d3stream.benchmarks.bench_service import NullModel
    from d3stream.core.record import Stage
    from d3stream.service import Service

    settings = load_settings({"bootstrap_servers": "127.0.0.1:1", "request_topics": "requests",
                              "answer_topic": "answers", "metrics_port": "", "shadow": "candidate=given",
                              "shadow_share": "1.0"}, environ={})
    shadow_model = NullModel()
    shadow_model.model_name = "candidate"
    question = {"type": "noul", "instructions": "Is it urgent?"}
    inputs = [BenchRecord("requests", 0, offset, f"r{offset}".encode(),
                          json.dumps({"id": f"r{offset}", "state": "a ticket", "questions": {"q": question}}).encode(),
                          HEADERS, int(time.time() * 1000)) for offset in range(6)]

    async def run() -> dict[str, list[bytes]]:
        service = Service(settings, NullModel(), shadow=shadow_model)
        shadow = service.pipeline.shadow
        assert shadow is not None
        delivered = asyncio.Event()

        async def first_then_broken(items):  # the shadow's passes: one request answered, then a fault
            first = items[0]
            first.probabilities = {row: [0.5, 0.5] for row in first.prepared.rows}
            first.advance(Stage.SCORED)
            yield [first]
            await delivered.wait()
            raise RuntimeError("the shadow's passes broke")

        shadow.hosted.passes.run = first_then_broken
        published: dict[str, list[bytes]] = {}
        async for answered in service.pipeline.answer(inputs):
            for record in answered:
                assert record.answer is not None
                assert record.answer.id not in published, "a request came out twice"
                published[record.answer.id] = [outgoing.value for outgoing in record.records]
                record.advance(Stage.DELIVERED)  # as FetchHandler._deliver does, before the shadow goes on
                record.drop_delivered()
            delivered.set()
        return published

    published = asyncio.run(run())
    assert sorted(published) == [f"r{offset}" for offset in range(6)]
    shadow_answers = {rid: decode_answer(values[-1]) for rid, values in published.items()}
    errors = [rid for rid, answer in shadow_answers.items() if answer.error is not None]
    assert len(errors) == 5 and all(shadow_answers[rid].error.code == "internal_error" for rid in errors)
