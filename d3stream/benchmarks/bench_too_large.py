"""``d3stream bench too-large N``: one request of N questions whose answer is too large for the answer topic,
timed from its record to its ``answer_too_large`` error answer, and where that time goes.

Why (issue 42, item 7): such a request was once reported at 118 s against 23.7 s before, and answers had just
started to be sized as written (``core.outgoing.RecordWriter``: JSON, or Avro through the registry), so the
answer's sizing was the suspect. This keeps the figure, split so that the model's share and the sizing's share
are read apart, on whatever machine runs it:

* **request**: over the request pipeline alone (``RequestPipeline.answer`` of a ``Service`` that is never
  started: no broker), default the tiny demo checkpoint with ``torch_threads=1``. One request of N ``noul``
  questions, compression off and the answer topic at the broker's default ``max.message.bytes`` (1,048,588):
  12,000 answers are about 1.4 MB as written, so the answer is replaced. Seconds from the record handed over
  to its answer, and the request's own stages: prepare, waiting for the model thread, the forward passes
  (the model), and after its last pass (its answers built from the probabilities, then sized and replaced);
* **sizing**: ``AnswerBuilder.fitted`` alone on an answer of N questions with full-precision probabilities
  (a trained model's, which compress far less than the tiny checkpoint's), written as JSON and as Avro: what
  writing the answer, checking it against the limit and making its replacement cost. Best of ``SIZING_ROUNDS``.

The load average is reported with the figures: with two torch threads on a two-core machine, any other busy
process makes the passes several times slower (OpenMP threads wait for each other; docs/MEASUREMENTS.md), and
that, not the sizing, is what moved the request's figure (``--threads 2`` shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from d3stream_client.contract import HEADERS, Answer, Provenance, Source

from d3stream.benchmarks.bench_sched import BenchRecord
from d3stream.core.record import RequestRecord
from d3stream.kafka.limits import BROKER_DEFAULT_MAX_MESSAGE_BYTES
from d3stream.runtime import D3
from d3stream.settings import Settings

if TYPE_CHECKING:
    from d3stream.core.seams import DecisionModel
    from d3stream.service import Service

QUESTION = {"type": "noul", "instructions": "Is anything unusual visible?"}
TOPIC = "answers"
# Sizing takes milliseconds: the best of a few rounds filters a burst of other work on a shared machine.
SIZING_ROUNDS = 5


class RequestFigures(TypedDict):
    """The one request through the pipeline: its answer's code and where its seconds went."""

    code: str | None  # answer_too_large, or None if the answer fitted after all (too few questions)
    seconds: float  # the record handed to the pipeline -> its answer event
    prepare_s: float
    queued_s: float  # waiting for the model thread between its passes
    forward_s: float  # its forward passes: the model
    after_pass_s: float  # after its last pass: answers built, sized and replaced
    passes: int


class SizingFigures(TypedDict):
    """``AnswerBuilder.fitted`` on an answer of full-precision probabilities, in one format."""

    answer_bytes: int  # the answer as written
    code: str | None
    seconds: float  # best of SIZING_ROUNDS


class TooLargeReport(TypedDict):
    questions: int
    torch_threads: int | None
    limit: int  # the answer topic's max.message.bytes (compression off)
    load_before: float  # one-minute load average before and after the request
    load_after: float
    request: RequestFigures
    sizing: dict[str, SizingFigures]  # "json", "avro"


def too_large_request(questions: int) -> BenchRecord:
    """A request of ``questions`` noul questions on one short state, as the pipeline reads it."""
    body = {"id": "too-large", "state": {"text": "ticket: the parcel arrived late and the box was open"},
            "questions": {f"q{n}": QUESTION for n in range(questions)}}
    return BenchRecord(topic="bench", partition=0, offset=0, key=b"too-large", value=json.dumps(body).encode(),
                       headers=HEADERS, timestamp=int(time.time() * 1000))


def _settings(questions: int, threads: int | None) -> Settings:
    """The defaults, with the request limits raised to take the request and compression off (so its answer's
    size as written is what the topic's limit is checked against)."""
    record_bytes = len(too_large_request(questions).value)
    return Settings.from_flat(metrics_port=None, answer_topic=TOPIC, dead_letter_topic="dead-letters",
                              torch_threads=threads, compression="none", max_request_questions=questions,
                              max_request_options=2 * questions, max_request_bytes=2 * record_bytes,
                              max_request_tokens=None, log_level="warning")


def _request(service: Service, record: BenchRecord) -> RequestFigures:
    """The request through the pipeline: its answer's code and where its time went."""
    answered: list[RequestRecord] = []

    async def go() -> float:
        try:
            async for group in service.pipeline.answer([record]):
                answered.extend(group)
            return time.perf_counter()
        finally:
            await service.default.passes.close()

    started = time.perf_counter()
    done = asyncio.run(go())
    [served] = answered
    assert served.answer is not None  # the pipeline hands on answered requests only
    timings = served.timings
    passes_done = served.submitted_at + (timings.queued + timings.forward) / 1000 if timings.forward else done
    error = served.answer.error
    return {"code": error.code if error is not None else None, "seconds": round(done - started, 2),
            "prepare_s": round(timings.prepare / 1000, 2), "queued_s": round(timings.queued / 1000, 2),
            "forward_s": round(timings.forward / 1000, 2), "after_pass_s": round(done - passes_done, 3),
            "passes": served.batch.passes}


def _full_precision_answer(service: Service, questions: int) -> Answer:
    """An answer of ``questions`` noul answers with random full-precision probabilities, provenance and all."""
    rng = random.Random(0)
    answers: dict[str, object] = {}
    for n in range(questions):
        p = rng.random()
        answers[f"q{n}"] = {"type": "noul", "noul": p, "probabilities": {"false": 1 - p, "true": p}}
    builder = service.default.answers
    return Answer(id="too-large", answer_id="a" * 32, source=Source(topic="bench", partition=0, offset=0),
                  model=builder.model_record.name, answers=answers, usage={"input_tokens": 20 * questions},
                  provenance=Provenance(model=builder.model_record, worker=builder.worker))


def _sizing(service: Service, answer: Answer, record: RequestRecord) -> SizingFigures:
    """``fitted`` on ``answer`` with the service's writer as it is framed now: best of SIZING_ROUNDS."""
    builder = service.default.answers
    value, _ = builder.write(TOPIC, answer, record.headers)
    best = float("inf")
    code = None
    for _ in range(SIZING_ROUNDS):
        started = time.perf_counter()
        fitted, _ = builder.fitted(record, answer)
        best = min(best, time.perf_counter() - started)
        code = fitted.error.code if fitted.error is not None else None
    return {"answer_bytes": len(value), "code": code, "seconds": round(best, 4)}


def _sizings(service: Service, questions: int) -> dict[str, SizingFigures]:
    """The sizing figure as JSON and as Avro (the registry's format, written as a worker writes it)."""
    from d3stream.kafka.registry import OutgoingFormat

    answer = _full_precision_answer(service, questions)
    read = too_large_request(1)
    record = RequestRecord(input=read, source=Source(topic=read.topic, partition=0, offset=0),
                           received=time.perf_counter())
    figures = {"json": _sizing(service, answer, record)}
    service.record_writer.framing = OutgoingFormat("avro", {TOPIC: (1, Answer)})  # schema id: any
    try:
        figures["avro"] = _sizing(service, answer, record)
    finally:
        service.record_writer.framing = None
    return figures


def too_large_bench(model: DecisionModel | str | os.PathLike[str], questions: int = 12_000, *,
                    threads: int | None = 1, limit: int = BROKER_DEFAULT_MAX_MESSAGE_BYTES) -> TooLargeReport:
    """Both figures for one request of ``questions`` questions on ``model`` (a loaded model or a checkpoint)."""
    from d3stream.service import Service

    if isinstance(model, (str, os.PathLike)):
        model = D3.from_pretrained(Path(model), device="cpu")
    service = Service(_settings(questions, threads), model)
    service.limits.topics = {TOPIC: limit}  # as read from a broker at start
    try:
        load_before = os.getloadavg()[0]
        request = _request(service, too_large_request(questions))
        load_after = os.getloadavg()[0]
        sizing = _sizings(service, questions)
    finally:
        service.pipeline.close()
        service.fetcher.close()
    return {"questions": questions, "torch_threads": threads, "limit": limit, "load_before": round(load_before, 2),
            "load_after": round(load_after, 2), "request": request, "sizing": sizing}


def too_large_markdown(report: TooLargeReport) -> str:
    request, sizing = report["request"], report["sizing"]
    code = request["code"] or "answered (it fitted)"
    lines = [
        f"One request of {report['questions']:,} noul questions, answer topic limit {report['limit']:,} bytes, "
        f"compression off, pipeline alone (no broker), torch_threads={report['torch_threads']}, load average "
        f"{report['load_before']:g} before and {report['load_after']:g} after: {code} in {request['seconds']:,.2f} s.",
        "",
        "| prepare s | waiting s | forward s (the model) | after its last pass s | passes |",
        "|---:|---:|---:|---:|---:|",
        f"| {request['prepare_s']:,.2f} | {request['queued_s']:,.2f} | {request['forward_s']:,.2f} | "
        f"{request['after_pass_s']:,.3f} | {request['passes']:,} |",
        "",
        "Sizing alone (AnswerBuilder.fitted, an answer of full-precision probabilities, best of "
        f"{SIZING_ROUNDS}):",
        "",
        "| format | answer bytes | outcome | ms |",
        "|---|---:|---|---:|",
        *(f"| {name} | {row['answer_bytes']:,} | {row['code'] or 'fits'} | {1000 * row['seconds']:,.1f} |"
          for name, row in sizing.items()),
    ]
    return "\n".join(lines) + "\n"
