"""The request record's stage (d3stream/core/record.py): the steps the pipeline takes are allowed, any other
raises, and what counts as answered is what the pipeline's fault handling and the shadow read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from d3stream_client.contract import Source

from d3stream.core.record import NEXT, IllegalTransition, RequestRecord, Stage


def _record() -> RequestRecord:
    read = SimpleNamespace(topic="requests", partition=0, offset=7, timestamp=0, key=None, value=b"", headers=None)
    return RequestRecord(read, Source(topic="requests", partition=0, offset=7, timestamp=0), 0.0)


@pytest.mark.parametrize("path", [
    # a text-only request answered and delivered; one with media, shadowed; refusals at each stage before an answer
    [Stage.DECODED, Stage.ROUTED, Stage.PREPARED, Stage.SCORED, Stage.ANSWERED, Stage.DELIVERED],
    [Stage.DECODED, Stage.ROUTED, Stage.MEDIA, Stage.PREPARED, Stage.SCORED, Stage.ANSWERED, Stage.SHADOWED,
     Stage.DELIVERED],
    [Stage.REFUSED, Stage.DELIVERED],
    [Stage.DECODED, Stage.ROUTED, Stage.MEDIA, Stage.REFUSED, Stage.DELIVERED],
    [Stage.DECODED, Stage.ROUTED, Stage.PREPARED, Stage.SCORED, Stage.REFUSED, Stage.DELIVERED],
])
def test_the_pipelines_steps_are_allowed(path: list[Stage]) -> None:
    record = _record()
    assert record.stage is Stage.READ and not record.stage.finished
    for stage in path:
        record.advance(stage)
        assert record.stage is stage
    assert record.stage.finished


@pytest.mark.parametrize(("path", "illegal"), [
    ([Stage.REFUSED], Stage.REFUSED),  # answered twice
    ([Stage.DECODED, Stage.ROUTED, Stage.PREPARED, Stage.SCORED, Stage.ANSWERED], Stage.REFUSED),
    ([Stage.REFUSED], Stage.SHADOWED),  # a shadow answer after an error answer
    ([Stage.DECODED], Stage.PREPARED),  # prepared before it is routed
    ([], Stage.DELIVERED),  # delivered without an answer
    ([Stage.REFUSED, Stage.DELIVERED], Stage.DELIVERED),  # delivered twice
])
def test_any_other_step_raises_and_leaves_the_stage(path: list[Stage], illegal: Stage) -> None:
    record = _record()
    for stage in path:
        record.advance(stage)
    before = record.stage
    with pytest.raises(IllegalTransition, match=f"requests/0/7 is {before.name}: it cannot move to {illegal.name}"):
        record.advance(illegal)
    assert record.stage is before


def test_every_stage_before_an_answer_may_be_refused_and_none_after() -> None:
    for stage in Stage:
        assert (Stage.REFUSED in NEXT[stage]) == (not stage.finished), stage
