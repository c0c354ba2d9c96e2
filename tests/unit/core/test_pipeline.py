"""The request pipeline on its own: records in, one answer event per record out, no broker and no JVM.

The error table (every request-level error code a producer's input can cause without an object store),
failure isolation inside one fetch, and what serving a fetch as a batch buys: the fetch's text requests share
one trip to the prepare thread and ride the same passes. The end-to-end tests (tests/integration/test_service.py and
others) run the same codes through the real broker and object store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from d3stream_client.contract import ERROR_CODES, decode_answer
from d3stream_client.validation import EventError, validate_request

from d3stream.core import pipeline
from d3stream.core.record import RequestRecord
from d3stream.service import Service
from d3stream.settings import Settings
from tests.support.media_makers import data_url, make_png, make_png_header_only
from tests.support.stream_helpers import Q_CHOICE, Q_NOUL, Q_SCORE, close_to

pytestmark = pytest.mark.timeout(300)


def records(*values: tuple[bytes | None, bytes | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(topic="requests", partition=0, offset=offset, timestamp=1_700_000_000_000, key=key,
                            value=value, headers=()) for offset, (key, value) in enumerate(values)]


def request(rid: str, **fields: Any) -> tuple[bytes, bytes]:
    body = {"id": rid, "state": {"ticket": rid}, "questions": {"q": Q_NOUL}, **fields}
    return rid.encode(), json.dumps(body).encode()


class Recorder:
    """What the pipeline hands to delivery, group by group."""

    def __init__(self) -> None:
        self.calls: list[list[RequestRecord]] = []

    async def __call__(self, served: list[RequestRecord]) -> None:
        self.calls.append(served)

    @property
    def answers(self) -> dict[str, Any]:
        return {s.answer.id: decode_answer(s.records[-1].value) for call in self.calls for s in call}


def serve(service: Service, batch: list[SimpleNamespace], recorder: Recorder | None = None) -> Recorder:
    recorder = recorder or Recorder()

    async def go() -> None:
        try:
            async for answered in service.pipeline.answer(batch):
                await recorder(answered)
        finally:
            await service.default.passes.close()

    asyncio.run(go())
    service.pipeline.close()
    service.fetcher.close()
    return recorder


@pytest.fixture
def pipeline_service(qwen35_model):
    """A ``Service`` that is never started: its pipeline, on the shared vision checkpoint."""
    limits = qwen35_model.max_length, qwen35_model.max_request_tokens
    settings = Settings.from_flat(metrics_port=None, media_allowlist=["s3://allowed/"], answer_topic="answers",
                        dead_letter_topic="dead-letters", s3_max_attempts=1, linger_ms=20, max_request_tokens=5000)
    yield lambda **changes: Service(settings.replaced(**changes), qwen35_model)
    qwen35_model.max_length, qwen35_model.max_request_tokens = limits


def test_the_error_table_without_a_broker(pipeline_service):
    """Each code a record can earn before any object store is asked, in one fetch, each under its own id."""
    service = pipeline_service()
    bomb = data_url(make_png_header_only(6000, 6000), "image/png")
    batch = records(
        (b"e-undecodable", b"{not json"),
        (b"e-tombstone", None),
        (b"e-schema", json.dumps({"id": "e-schema", "questions": ["q"]}).encode()),
        request("e-model", model="another-model"),
        request("e-http", images=["https://example.com/a.png"]),
        request("e-bucket", images=["s3://elsewhere/a.png"]),
        request("e-too-many", images=[data_url(make_png(8, 8), "image/png")] * 40),
        request("e-unreadable", images=[data_url(make_png(64, 64)[:120], "image/png")]),
        request("e-bomb", images=[bomb]),
        request("e-long", state="word " * 6000),
        request("ok-text"),
        request("ok-image", images=[data_url(make_png(48, 48, seed=3), "image/png")]),
    )
    recorder = serve(service, batch)
    codes = {rid: (answer.error.code if answer.error else None) for rid, answer in recorder.answers.items()}
    assert codes == {
        "e-undecodable": "undecodable_event",
        "e-tombstone": "undecodable_event",
        "e-schema": "invalid_request",
        "e-model": "model_not_served",
        "e-http": "media_not_allowed",
        "e-bucket": "media_not_allowed",
        "e-too-many": "invalid_request",
        "e-unreadable": "media_unreadable",
        "e-bomb": "media_unreadable",
        "e-long": "invalid_request",
        "ok-text": None,
        "ok-image": None,
    }
    assert set(codes.values()) - {None} <= set(ERROR_CODES)
    # Every record was answered exactly once; only the two undecodable ones were also dead-lettered.
    served = [s for call in recorder.calls for s in call]
    assert sorted(s.source.offset for s in served) == list(range(len(batch)))
    dead = {s.answer.id for s in served if any(r.kind == "dead_letter" for r in s.records)}
    assert dead == {"e-undecodable", "e-tombstone"}
    assert "max_media_references" in recorder.answers["e-too-many"].error.message
    assert "max_request_tokens" in recorder.answers["e-long"].error.message


def test_what_the_client_refuses_the_worker_answers_with_the_same_code_and_message(pipeline_service):
    """A request with no questions, or a NaN or an infinity anywhere in it, is refused by the client's checks before
    it is sent; one that is sent anyway (``json.dumps`` writes NaN and Infinity) gets from the worker the very
    ``invalid_request`` and message the client raised, and no dead letter: it is JSON, just not a valid request."""
    service = pipeline_service()
    documents = {
        "e-no-questions": {"id": "e-no-questions", "state": "s", "questions": {}},
        "e-nan": {"id": "e-nan", "state": {"x": float("nan")}, "questions": {"q": Q_NOUL}},
        "e-inf": {"id": "e-inf", "state": "s", "questions": {"q": Q_NOUL}, "metadata": {"scores": [1.5, float("-inf")]}},
    }
    values = {rid: json.dumps(document).encode() for rid, document in documents.items()}
    # A number too large for a double: valid JSON text, read as infinity.
    values["e-huge"] = json.dumps({"id": "e-huge", "state": {"x": 1}, "questions": {"q": Q_NOUL}}).encode().replace(
        b'"x": 1', b'"x": 1e400')
    recorder = serve(service, records(*((rid.encode(), value) for rid, value in values.items())))
    answers = recorder.answers
    assert set(answers) == set(values)
    for rid, value in values.items():
        with pytest.raises(EventError) as client:  # what the client says before sending
            validate_request(documents.get(rid, value))
        error = answers[rid].error
        assert (error.code, error.message) == (client.value.code, str(client.value))
        assert error.code == "invalid_request"
    assert "no questions" in answers["e-no-questions"].error.message
    assert "NaN at state.x" in answers["e-nan"].error.message
    assert "-Infinity at metadata.scores[1]" in answers["e-inf"].error.message
    assert "1e400 at state.x" in answers["e-huge"].error.message
    served = [s for call in recorder.calls for s in call]
    assert not [s.answer.id for s in served if any(r.kind == "dead_letter" for r in s.records)]


def test_an_answer_too_large_for_its_topic_is_replaced_under_the_same_id(pipeline_service):
    service = pipeline_service()
    service.limits.topics = {"answers": 2_000}  # as read from a broker whose answer topic takes 2 kB
    options = {f"option {n}": f"the option numbered {n}, described at some length" for n in range(120)}
    recorder = serve(service, records(request("big", questions={"q": {"type": "choice", "criteria": options}}),
                                      request("small")))
    big, small = recorder.answers["big"], recorder.answers["small"]
    assert big.error.code == "answer_too_large" and "max.message.bytes" in big.error.message
    assert small.error is None and small.answers["q"]["type"] == "noul"


def test_an_answer_is_sized_in_the_format_it_is_written_in(pipeline_service):
    """With answers written in Avro through a registry, the answer topic's limit is checked against the Avro
    record: an answer whose JSON would not fit, but whose Avro does, is published, in Avro."""
    from d3stream_client.contract import Answer
    from d3stream_client.registry import FRAME, AvroCodec

    from d3stream.kafka.registry import OutgoingFormat

    options = {f"option {n}": f"the option numbered {n}, described at some length" for n in range(60)}
    big = request("big", questions={"q": {"type": "choice", "criteria": options}})

    def published(limit: int | None, avro: bool) -> tuple[bytes, list[tuple[str, bytes]], int]:
        """The answer's record value and headers, and its size as the broker counts it."""
        service = pipeline_service(compression="none")
        if limit is not None:
            service.limits.topics = {"answers": limit}
        if avro:
            service.record_writer.framing = OutgoingFormat("avro", {"answers": (42, Answer)})
        [[served]] = serve(service, records(big)).calls
        outgoing = served.records[-1]
        return outgoing.value, outgoing.headers, service.limits.fit(
            "answers", outgoing.key, outgoing.value, outgoing.headers).on_wire

    as_json, _, json_size = published(None, avro=False)
    as_avro, headers, avro_size = published(None, avro=True)
    assert as_avro[0] == 0 and FRAME.unpack_from(as_avro)[1] == 42 and avro_size < json_size - 300
    between = (avro_size + json_size) // 2
    refused, _, _ = published(between, avro=False)
    assert decode_answer(refused).error.code == "answer_too_large"
    fitted, headers, _ = published(between, avro=True)
    answer = decode_answer(AvroCodec(OutgoingFormat("avro", {"t": (1, Answer)}).writers["t"], Answer).read(
        fitted, FRAME.size))
    assert answer.error is None and answer.answers["q"]["type"] == "choice"
    assert dict(headers)["content-type"] == b"application/vnd.d3stream+avro"


def test_a_fault_of_one_request_is_its_own_error_not_its_neighbours(pipeline_service, qwen35_model):
    """A model whose prepare raises (not a ValueError: a fault, not bad input) for one request only."""
    service = pipeline_service()
    original = qwen35_model.prepare

    def prepare(state: Any, questions: Any, **kwargs: Any) -> Any:
        if state == {"ticket": "faulty"}:
            raise RuntimeError("simulated fault in the tokenizer")
        return original(state, questions, **kwargs)

    service.pipeline.router.default.model = SimpleNamespace(**{  # service.default.model follows the router's default
        name: getattr(qwen35_model, name) for name in (
            "model_name", "device", "attention_mode", "image_unavailable", "video_unavailable",
            "request_may_exceed_tokens", "check_request_tokens", "forward", "provenance")
    }, prepare=prepare)
    recorder = serve(service, records(request("before"), request("faulty"), request("after")))
    answers = recorder.answers
    assert answers["faulty"].error.code == "internal_error"
    assert "simulated fault" in answers["faulty"].error.message
    assert answers["before"].error is None and answers["after"].error is None


def test_an_answer_that_cannot_be_encoded_is_answered_with_its_error_not_dropped(pipeline_service, monkeypatch):
    """A fault while the answer record is built, after the request counts as answered: it still leaves with an
    internal_error answer under its id (an unanswered request would hold its partition's commit point)."""
    service = pipeline_service()
    builder = service.pipeline.router.default.answers
    original = builder.fitted

    def fitted(record: Any, answer: Any) -> Any:
        if answer.id == "faulty" and answer.error is None:
            raise RuntimeError("simulated fault in the encoder")
        return original(record, answer)

    monkeypatch.setattr(builder, "fitted", fitted)
    recorder = serve(service, records(request("before"), request("faulty"), request("after")))
    answers = recorder.answers
    assert answers["faulty"].error.code == "internal_error"
    assert "simulated fault in the encoder" in answers["faulty"].error.message
    assert answers["before"].error is None and answers["after"].error is None
    assert len([s for call in recorder.calls for s in call]) == 3  # each request delivered once


def test_what_raises_out_of_answer_anyway_leaves_nothing_held_in_flight(pipeline_service, monkeypatch):
    """A stage's bug met by one request escapes ``answer`` (the service's guard answers the records again, as new
    ones): the records it did not hand on hold no questions, tokens or model counts any more, which would
    otherwise hold backpressure (or a retired model) for the worker's lifetime."""
    service = pipeline_service()
    real = pipeline.request_scheduling

    def scheduling(batching: Any, read: Any, request: Any) -> Any:
        if request.id == "faulty":
            raise RecursionError("simulated")
        return real(batching, read, request)

    monkeypatch.setattr(pipeline, "request_scheduling", scheduling)
    with pytest.raises(RecursionError):
        serve(service, records(request("before"), request("faulty"), request("after")))
    counts = service.ledger.counts
    assert (counts.requests, counts.questions, counts.tokens) == (0, 0, 0)  # "before" was routed: nothing left
    assert sum(service.ledger.routed.values()) == 0


def test_a_skipped_record_is_answered_internal_error_naming_the_fault_and_dead_lettered(pipeline_service):
    """The guard's last word on a record the worker failed on: its error answer, under its key's id, names the
    exception; its own bytes go to the dead-letter topic with the same reason."""
    service = pipeline_service()
    (read,) = records(request("skipped-one"))
    recorder = serve(service, [pipeline.skipped(read, RecursionError("maximum recursion depth exceeded"))])
    (served,) = [each for call in recorder.calls for each in call]
    assert served.answer is not None and served.answer.error is not None
    assert served.answer.id == "skipped-one" and served.answer.error.code == "internal_error"
    message = served.answer.error.message
    assert "RecursionError: maximum recursion depth exceeded" in message and "skipped" in message
    assert [each.kind for each in served.records] == ["dead_letter", "answer"]
    letter = json.loads(served.records[0].value)
    assert letter["reason"] == message and base64.b64decode(letter["value_base64"]) == read.value


def test_a_fetch_is_prepared_in_one_trip_and_its_questions_share_passes(pipeline_service, qwen35_model):
    """Twelve text requests of one fetch: answered as the model alone answers each, from far fewer passes
    than requests (their rows were submitted together)."""
    service = pipeline_service(prefix_reuse="off", max_batch_rows=64)
    wanted = {}
    batch_values = []
    for n in range(12):
        questions = {"a": Q_NOUL, "b": Q_CHOICE, "c": Q_SCORE}
        state = {"ticket": n, "text": "the parcel arrived " + ("late " * (n % 4))}
        batch_values.append((f"r{n}".encode(), json.dumps({"id": f"r{n}", "state": state,
                                                          "questions": questions}).encode()))
        wanted[f"r{n}"] = qwen35_model.system_one(state=state, questions=questions)["answers"]
    trips = []
    original_run = service.pipeline.prepare_thread.run

    def counted(job: Any, **options: Any) -> Any:
        trips.append(job)
        return original_run(job, **options)

    service.pipeline.prepare_thread.run = counted
    recorder = serve(service, records(*batch_values))
    assert len(trips) == 1, f"{len(trips)} trips to the prepare thread for one fetch of text requests"
    for rid, answer in recorder.answers.items():
        close_to(answer.answers, wanted[rid], rid)
    assert service.default.passes.rows.passes_run <= 3, service.default.passes.rows.passes_run
    assert max(answer.provenance.batch.rows for answer in recorder.answers.values()) > 3


def test_every_delivery_setting_value_is_a_registered_mode():
    """The ``delivery`` setting's values and the registry of (sink, commit policy) pairs stay in step."""
    from typing import get_args

    from d3stream.kafka.commits import DELIVERY_MODES
    from d3stream.settings import DeliveryName

    kafka_modes = {name for name, mode in DELIVERY_MODES.items() if mode.kafka_sink}
    assert set(get_args(DeliveryName)) == kafka_modes
    assert DELIVERY_MODES["exactly_once"].transactional and not DELIVERY_MODES["at_least_once"].transactional


# ------------------------------------------------------------------------ deadlines, cost, lanes


def test_a_request_past_its_deadline_on_arrival_costs_no_pass(pipeline_service):
    """``deadline`` in the past, or ``ttl_ms`` from an old record timestamp: deadline_exceeded, saying how
    late, without a forward pass; a request of schema 1 (no such fields) beside them is answered."""
    service = pipeline_service()
    recorder = serve(service, records(request("late-deadline", deadline=1_000),
                                      request("late-ttl", ttl_ms=60_000),  # the records are from 2023
                                      request("no-deadline")))
    answers = recorder.answers
    for rid in ("late-deadline", "late-ttl"):
        error = answers[rid].error
        assert error.code == "deadline_exceeded" and "deadline_exceeded" in ERROR_CODES
        assert error.late_ms > 10**9 and f"{error.late_ms:,} ms" in error.message
        assert answers[rid].provenance.cost.device_seconds == 0 and answers[rid].provenance.batch.passes == 0
    assert answers["no-deadline"].error is None
    assert service.default.passes.rows.passes_run == 1 and service.default.passes.rows.rows_run == 1


def test_a_request_expiring_while_queued_is_dropped_before_its_pass(pipeline_service):
    """Alive when admitted, expired while its row lingers for company: dropped from the pass it would have
    ridden (its neighbour rides alone) and answered deadline_exceeded."""
    import time

    service = pipeline_service(linger_ms=3_000, prefix_reuse="off")
    soon = int(time.time() * 1000) + 1_000  # admitted well before, then the row lingers 3 s
    recorder = serve(service, records(request("expiring", deadline=soon), request("patient")))
    answers = recorder.answers
    assert answers["expiring"].error.code == "deadline_exceeded"
    assert answers["expiring"].error.late_ms > 0 and "forward pass" in answers["expiring"].error.message
    assert answers["patient"].error is None and answers["patient"].provenance.batch.rows == 1
    assert service.default.passes.rows.passes_run == 1 and service.default.passes.rows.rows_expired == 1


def test_cost_shares_add_up_to_the_passes_measured_time(pipeline_service):
    """Over a stream of requests cut into several passes, each answer's share of device time (by tokens) sums
    to the passes' measured seconds; prompt and padded tokens add up too; the tenant comes from the request,
    else the tenant_header header, else the topic, and the Prometheus counters carry the same sums."""
    service = pipeline_service(prefix_reuse="off", max_batch_rows=4, tenant_header="x-team")
    batch = records(*(request(f"r{n}", state={"text": "word " * (1 + n * 3)},
                              questions={"a": Q_NOUL, "b": Q_CHOICE} if n % 2 else {"a": Q_SCORE},
                              **({"tenant": "explicit"} if n % 3 == 0 else {}))
                      for n in range(10)))
    for record in batch[1::3]:
        record.headers = [("x-team", b"from-header")]
    recorder = serve(service, batch)
    rows = service.default.passes.rows
    answers = list(recorder.answers.values())
    assert all(answer.error is None for answer in answers)
    assert rows.passes_run >= 3
    assert sum(a.provenance.cost.device_seconds for a in answers) == pytest.approx(rows.device_seconds, rel=1e-9)
    assert sum(a.provenance.cost.prompt_tokens for a in answers) == rows.real_tokens
    assert sum(a.provenance.cost.padded_tokens for a in answers) == rows.padded_tokens
    assert all(a.provenance.cost.prompt_tokens == a.usage["input_tokens"] for a in answers)
    tenants = {a.id: a.provenance.cost.tenant for a in answers}
    assert {tenants["r0"], tenants["r1"], tenants["r2"]} == {"explicit", "from-header", "requests"}
    registry = service.metrics.registry
    counted = sum(registry.get_sample_value("d3stream_device_seconds_total",
                                            {"tenant": tenant, "model": service.default.model.model_name}) or 0.0
                  for tenant in ("explicit", "from-header", "requests"))
    assert counted == pytest.approx(rows.device_seconds, rel=1e-9)


def test_a_high_priority_request_is_answered_before_a_low_flood_of_its_fetch(pipeline_service):
    """One fetch: a flood of low-priority requests and one high-priority request last; with two rows a pass
    the high one rides the first pass and is the first answer handed on."""
    service = pipeline_service(prefix_reuse="off", max_batch_rows=2)
    batch = records(*(request(f"low{n}", priority="low") for n in range(8)), request("urgent", priority="high"))
    recorder = serve(service, batch)
    first = [served.answer.id for served in recorder.calls[0]]
    assert "urgent" in first, [[s.answer.id for s in call] for call in recorder.calls]
    assert all(answer.error is None for answer in recorder.answers.values())


class SlowToPrepareLow:
    """The real model, with each low-priority request's ``prepare`` slowed down: a flood that takes long to
    tokenize (its prompts are long, or the prepare thread is busy)."""

    def __init__(self, model: Any):
        self._model = model
        self.low_prepared = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def prepare(self, state: Any, questions: Any, **options: Any) -> Any:
        if "low" in json.dumps(state):
            time.sleep(0.01)
            self.low_prepared += 1
        return self._model.prepare(state, questions, **options)


def test_a_high_request_of_a_flooded_fetch_does_not_wait_for_the_flood_to_be_prepared(qwen35_model):
    """One fetch: a flood of 40 low requests that take long to prepare, and one high request last. Each lane of
    the fetch is prepared and submitted on its own, so the high one rides a pass alone and is handed on first,
    before the flood is prepared (submitted with the flood it would wait for all of it and share its pass)."""
    qwen35_model.system_one(state={"ticket": "warm-up"}, questions={"q": Q_NOUL})  # a first pass is slow (once)
    model = SlowToPrepareLow(qwen35_model)
    settings = Settings.from_flat(metrics_port=None, answer_topic="answers", dead_letter_topic="dead-letters",
                        linger_ms=20, prefix_reuse="off", max_batch_rows=64)
    service = Service(settings, model)
    seen_at_first_answer = []

    class First(Recorder):
        async def __call__(self, served: list[RequestRecord]) -> None:
            if not self.calls:
                seen_at_first_answer.append(model.low_prepared)
            await super().__call__(served)

    batch = records(*(request(f"low{n}", priority="low") for n in range(40)), request("urgent", priority="high"))
    recorder = serve(service, batch, First())
    assert [served.answer.id for served in recorder.calls[0]] == ["urgent"], recorder.calls[0][:3]
    assert seen_at_first_answer[0] < 40, "the high request waited for the whole flood to be prepared"
    assert len(recorder.answers) == 41 and all(answer.error is None for answer in recorder.answers.values())


def test_cost_shares_on_the_shared_prefix_path_add_up_to_its_passes(pipeline_service):
    """Multi-question requests run their shared prefix once and question tails on it: each answer's share of
    the prefix and suffix passes (by the tokens it ran in each) adds up to every pass's measured time (no
    exact-replay checks here: no request is charged for those)."""
    service = pipeline_service(prefix_reuse="on", prefix_verify_every=0)
    batch = records(*(request(f"p{n}", state={"text": "word " * (3 + 4 * n)},
                              questions={"a": Q_NOUL, "b": Q_CHOICE, "c": Q_SCORE}) for n in range(4)))
    recorder = serve(service, batch)
    answers = list(recorder.answers.values())
    assert all(a.error is None and a.provenance.batch.shared_prefix for a in answers)
    assert all(a.provenance.cost.device_seconds > 0 for a in answers)
    measured = service.metrics.registry.get_sample_value("d3stream_pass_seconds_sum")
    assert sum(a.provenance.cost.device_seconds for a in answers) == pytest.approx(measured, rel=1e-9)


def test_on_a_cpu_the_model_thread_takes_the_intraop_threads_and_the_prepare_thread_runs_torch_inline(
        pipeline_service):
    """Two OpenMP teams on a CPU worker slow every pass 2-2.5x (runtime/cpu_threads.py): the prepare thread's torch
    ops (the image processor) run inline, and the model thread keeps its count whichever thread starts first."""
    import torch

    before = torch.get_num_threads()
    service = pipeline_service(torch_threads=2)

    async def counts() -> list[int]:
        loop = asyncio.get_running_loop()
        model_first = await loop.run_in_executor(service.model_thread, torch.get_num_threads)
        prepare = await service.pipeline.prepare_thread.run(torch.get_num_threads)
        model_after = await loop.run_in_executor(service.model_thread, torch.get_num_threads)
        return [model_first, prepare, model_after]

    try:
        assert asyncio.run(counts()) == [2, 1, 2]
    finally:
        service.pipeline.close()
        service.model_thread.shutdown()
        service.fetcher.close()
        torch.set_num_threads(before)
