"""The embedded default: a whole d3stream deployment on one machine, end to end, in one command.

``d3stream demo`` starts a local Kafka broker and S3-compatible store (``infra.local_stack``), builds a
tiny checkpoint trained on the synthetic support-ticket task (``make-checkpoint --train demo``, cached
between runs) and the random-weight checkpoint it was trained from, makes sample media, publishes sample
requests (hand-written tickets and pictures, tickets and pictures drawn from the held-out set, a video,
mixed media, an invalid question and one malformed record), serves them with the real service, reads the
answers back and prints them with a summary.

Then it shows the re-evaluation story: the same request topic is replayed through the random checkpoint
(``replay.run_replay``, as ``d3stream replay`` does) and both answer sets are compared against the labels
of the labelled requests (``compare.compare``, as ``d3stream compare --labels`` does), so the summary says
which checkpoint is right, not just that they differ. Meanwhile ``d3stream evaluate`` runs beside the
worker (``evaluate.run_worker``): half of the labels are published before their requests are answered, the
other half after, and the live evaluation it publishes is printed beside the offline one; for the served
checkpoint both come from the same answers and labels and must be equal. It exits 0 only when every
published request has its answer, live and replayed, and the live figures equal the offline ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import msgspec
import numpy as np

from d3stream.dev import tasks
from d3stream.jobs.evaluate import FiguresJson, run_worker
from d3stream.settings import Settings, cache_root

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker, ObjectStore, SchemaRegistry
    from d3stream.dev.progress import Progress
    from d3stream.runtime import D3

DEMO_BUCKET = "d3stream-demo"
# Held-out tickets and pictures published next to the showcase, for the labelled re-evaluation.
HELDOUT_TICKETS = 24
HELDOUT_PICTURES = 8


def sample_png(width: int = 320, height: int = 240, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def sample_mp4(frames: int = 20, width: int = 96, height: int = 64, fps: float = 10.0, seed: int = 0) -> bytes:
    import cv2

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height))
        for number in range(frames):
            frame = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            frame[:, : (number * width) // frames] = 255  # a bar that grows: the clip changes over time
            writer.write(frame)
        writer.release()
        return Path(path).read_bytes()


def demo_checkpoint(progress: bool = False) -> Path:
    """The tiny random-weight Qwen3.5 checkpoint with vision, built once per machine and reused (the
    baseline of the demo's re-evaluation; chaos, scale-out and bench runs use it too)."""
    from d3stream.dev.build_checkpoint import build_checkpoint

    path = cache_root() / "checkpoints" / "demo-qwen3_5-tiny-seed0"
    with _building(path):
        if not (path / "MODEL_MANIFEST.json").is_file():
            build_checkpoint(path, backbone="qwen3_5", size="tiny", seed=0, progress=progress)
    return path


def trained_checkpoint(progress: bool = False) -> Path:
    """The same checkpoint trained on the demo task (about a minute on the first run), cached likewise."""
    from d3stream.dev.build_checkpoint import build_checkpoint
    from d3stream.dev.train import DEFAULT_STEPS, TRAIN_BUILD

    path = cache_root() / "checkpoints" / f"demo-trained-b{TRAIN_BUILD}-qwen3_5-tiny-seed0-steps{DEFAULT_STEPS}"
    with _building(path):
        if not (path / "MODEL_MANIFEST.json").is_file():
            build_checkpoint(path, backbone="qwen3_5", size="tiny", seed=0, progress=progress, train="demo")
    return path


@contextlib.contextmanager
def _building(path: Path) -> Iterator[None]:
    """Held while a cached checkpoint is checked and built: a second process on the machine (another demo, a
    benchmark, a parallel test worker) waits for the first to finish it instead of writing the same files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def labelled_examples() -> list[tasks.Example]:
    """The showcase tickets and pictures, then a draw from the held-out set: the requests with labels."""
    return tasks.showcase() + tasks.heldout(HELDOUT_TICKETS, HELDOUT_PICTURES)


def sample_requests(
    examples: list[tasks.Example], upload: Callable[[str, bytes], str], image_uri: str, video_uri: str
) -> list[tuple[bytes, bytes]]:
    """(key, value) records: the labelled tickets and pictures (each picture uploaded with ``upload(key,
    png) -> s3 uri``), then a video, mixed media, an invalid question and one malformed record."""
    import base64

    requests: list[dict[str, object]] = []
    for example in examples:
        request: dict[str, object] = dict(example.request)
        if "images" in example.request:
            png = base64.b64decode(example.request["images"][0].split(",", 1)[1])
            request["images"] = [upload(f"pictures/{example.id}.png", png)]
        requests.append(request)
    requests += [
        {
            "id": "demo-video-1",
            "state": "A clip from the loading dock.",
            "questions": {"motion": {"type": "noul", "instructions": "Does something move?"}},
            "videos": [video_uri],
            "metadata": {"source": "demo"},
        },
        {
            "id": "demo-mixed-1",
            "state": "Camera still and clip of the same aisle.",
            "questions": {"clear": {"type": "noul", "criteria": {"true": "aisle clear", "false": "obstructed"}}},
            "images": [image_uri],
            "videos": [video_uri],
            "permutation_average": True,
        },
        {
            "id": "demo-bad-question",
            "state": "One valid and one invalid question.",
            "questions": {"ok": {"type": "noul"}, "bad": {"type": "score", "criteria": ["only one level"]}},
        },
    ]
    records = [(str(r["id"]).encode(), json.dumps(r).encode()) for r in requests]
    records.append((b"demo-malformed", b"{this is not json"))
    return records


class Reevaluation(TypedDict):
    """Both checkpoints against the labels (trained first, then the baseline, in each list)."""

    checkpoints: list[str]
    labelled: int
    accuracy: list[float | None]
    brier: list[float | None]
    ece: list[float | None]
    log_loss: list[float | None]
    agreement: float | None
    better: str


class LiveFigures(FiguresJson):
    """What ``d3stream evaluate`` published, and how many evaluations were read of how many expected."""

    evaluations: int
    expected: int


class Served(TypedDict):
    """What the demo published, served, replayed and evaluated (``run_demo`` adds ``seconds``)."""

    published: int
    framed: int  # of the published, those framed as Avro through the Schema Registry
    answered: int
    errors: int
    dead_letters: int
    replayed: int
    reevaluation: Reevaluation
    live_evaluation: LiveFigures
    live_equals_offline: bool
    answers: list[dict[str, object]]
    labelled_ids: list[str]


class DemoSummary(Served):
    """``run_demo``'s summary."""

    seconds: float


def reevaluation(
    trained: Mapping[str, Mapping[str, object]], baseline: Mapping[str, Mapping[str, object]],
    examples: list[tasks.Example], names: tuple[str, str]
) -> Reevaluation:
    """The trained and the baseline answers against the labels: what ``d3stream compare --labels`` reports."""
    from d3stream.jobs import compare

    labels: compare.Labels = {(r["id"], r["question"]): r["answer"] for r in tasks.label_records(examples)}
    report = compare.compare(trained, baseline, labels)
    figures = report.labels
    assert figures is not None
    return {
        "checkpoints": list(names),
        "labelled": figures.n,
        "accuracy": [figures.a.accuracy, figures.b.accuracy],
        "brier": [figures.a.brier, figures.b.brier],
        "ece": [figures.a.ece, figures.b.ece],
        "log_loss": [figures.a.log_loss, figures.b.log_loss],
        "agreement": report.overall.agreement,
        "better": names[0] if (figures.a.accuracy or 0) >= (figures.b.accuracy or 0) else names[1],
    }


async def run_demo(
    *,
    progress: bool = True,
    timeout_s: float = 300.0,
    trained: Path | None = None,
    baseline: Path | None = None,
    stack: tuple[KafkaBroker, ObjectStore] | None = None,
    registry: SchemaRegistry | None = None,
) -> DemoSummary:
    """Run the embedded deployment once; returns the summary (and the answers under ``answers``).

    ``trained`` and ``baseline`` default to the cached demo checkpoints (built on first use); ``stack``, a
    running ``(KafkaBroker, ObjectStore)``, to a fresh ``infra.embedded_stack`` for the run, with its Schema
    Registry (``registry`` gives one beside a given ``stack``): every third request is then published framed as
    Avro through it, as a producer of a Confluent estate would, beside the plain JSON ones.
    """
    from contextlib import ExitStack

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from d3stream.dev.infra import embedded_stack

    started = time.perf_counter()
    with ExitStack() as scope:
        if progress:
            # While the bars are drawn, log lines go through tqdm.write: printed above the bars, which are
            # redrawn below them, instead of a line torn in two by the next refresh.
            scope.enter_context(logging_redirect_tqdm())
        status = scope.enter_context(
            tqdm(total=6, desc="demo: starting Kafka, the S3 store and the Schema Registry", disable=not progress,
                 file=sys.stderr, leave=False)
        )
        if stack is None:
            started_stack = scope.enter_context(embedded_stack(progress=progress))
            stack, registry = (started_stack.broker, started_stack.store), started_stack.registry
        broker, store = stack
        status.set_description("demo: checkpoints (the first run trains one: about a minute)")
        status.update()
        baseline_path = baseline or demo_checkpoint(progress=False)
        trained_path = trained or trained_checkpoint(progress=False)
        summary = await _serve_and_reevaluate(broker, store, registry, trained_path, baseline_path, status, progress,
                                              timeout_s)
        status.close()  # gone before the servers stop (they take a few seconds), so the answers follow at once
    return {**summary, "seconds": round(time.perf_counter() - started, 2)}


async def _serve_and_reevaluate(
    broker: KafkaBroker, store: ObjectStore, registry: SchemaRegistry | None, trained: Path, baseline_path: Path,
    status: Progress, progress: bool, timeout_s: float
) -> Served:
    """Publish the sample requests, serve them with ``trained``, replay them with ``baseline_path`` and
    compare both with the labels."""
    from d3stream_client.publisher import produce
    from tqdm import tqdm

    from d3stream.jobs.compare import records_to_answers
    from d3stream.ops.logs import kernel_notice
    from d3stream.runtime import D3

    model = D3.from_pretrained(trained)
    notice = kernel_notice(model.kernel_record(), str(model.device))
    if notice and progress:
        tqdm.write(notice, file=sys.stderr)  # once, above the bars (transformers' own warnings are at debug)
    _step(status, "demo: media")
    examples = labelled_examples()
    records = _sample_records(store, examples)
    settings = _demo_settings(broker, store, registry)
    records, framed = await _framed(records, settings) if registry is not None else (records, 0)
    _step(status, "demo: publishing")
    for topic in ("demo.requests", "demo.answers", "demo.labels"):
        broker.create_topic(topic, settings.delivery.topic_partitions, exist_ok=True)
    labels = [(e.id.encode(), json.dumps({"id": e.id, "labels": e.labels, "source": "demo"}).encode())
              for e in examples]
    # Half of the labels are known before the requests are even answered: they wait for their answers.
    await produce(broker.bootstrap_servers, "demo.labels", labels[::2])
    await produce(broker.bootstrap_servers, "demo.requests", records)
    # The service reads credentials from the standard AWS chain, as it would in production.
    os.environ["AWS_ACCESS_KEY_ID"] = store.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = store.secret_key
    _step(status, "demo: serving (and evaluating live)")
    stop_evaluating = asyncio.Event()
    evaluating = asyncio.ensure_future(run_worker(settings, stop_evaluating))
    try:
        answers, dead_letters = await _serve(settings, model, broker, len(records), progress, timeout_s)
        # The other half arrives after the answers, as a closed ticket's truth does.
        await produce(broker.bootstrap_servers, "demo.labels", labels[1::2])
        live = await _live_figures(settings, answers, {e.id for e in examples}, timeout_s)
    finally:
        stop_evaluating.set()
        await evaluating
    _step(status, "demo: replaying through the random checkpoint")
    baseline = D3.from_pretrained(baseline_path)
    replayed = await _replayed(settings, baseline)
    status.update()
    published = {key.decode() for key, _ in records}
    offline = reevaluation(records_to_answers(answers), replayed, examples, (model.model_name, baseline.model_name))
    return {
        "published": len(records),
        "framed": framed,
        "answered": len(published & {answer["id"] for answer in answers}),
        "errors": sum(1 for answer in answers if answer.get("error")),
        "dead_letters": dead_letters,
        "replayed": len(published & set(replayed)),
        "reevaluation": offline,
        "live_evaluation": live,
        "live_equals_offline": same_figures(live, offline),
        "answers": answers,
        "labelled_ids": [example.id for example in examples],
    }


FIGURES: tuple[Literal["accuracy", "brier", "ece", "log_loss"], ...] = ("accuracy", "brier", "ece", "log_loss")


def same_figures(live: FiguresJson, offline: Reevaluation) -> bool:
    """Whether the live evaluation of the served checkpoint has exactly the offline re-evaluation's figures."""
    served = offline["checkpoints"][0]
    model = next((m for m in live["models"] if m["model"] == served and m["role"] == "live"), None)
    return model is not None and [model[k] for k in FIGURES] == [offline[k][0] for k in FIGURES]


async def _live_figures(settings: Settings, answers: list[dict[str, object]], labelled: set[str],
                        timeout_s: float) -> LiveFigures:
    """What ``d3stream evaluate --report`` prints once every labelled answer is evaluated: the served model's
    figures from the evaluation topic."""
    from d3stream.jobs.compare import TopicRange, read_topic
    from d3stream.jobs.evaluate import figures, figures_json

    expected = sum(1 for answer in answers if answer["id"] in labelled and not answer.get("error"))
    deadline = time.monotonic() + timeout_s
    while True:
        records = await read_topic(settings.connection.bootstrap_servers, TopicRange(settings.evaluation.evaluation_topic), timeout_s=timeout_s)
        if len(records) >= expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    models = figures(records)
    return {**figures_json(models), "evaluations": len(records), "expected": expected}


def _step(status: Progress, description: str) -> None:
    status.set_description(description)
    status.update()


def _sample_records(store: ObjectStore, examples: list[tasks.Example]) -> list[tuple[bytes, bytes]]:
    """The demo's requests, their pictures and clip uploaded to the demo bucket of the local store."""
    store.create_bucket(DEMO_BUCKET)
    client = store.client()

    def upload(key: str, body: bytes) -> str:
        client.put_object(Bucket=DEMO_BUCKET, Key=key, Body=body)
        return f"s3://{DEMO_BUCKET}/{key}"

    return sample_requests(examples, upload, upload("samples/aisle.png", sample_png()),
                           upload("samples/dock.mp4", sample_mp4()))


async def _framed(records: list[tuple[bytes, bytes]], settings: Settings) -> tuple[list[tuple[bytes, bytes]], int]:
    """The records with every third request framed as Avro through the Schema Registry (its Request schema
    registered under the request topic's subject, as a producer's serializer does); how many were framed. The
    malformed record stays as it is: there is no request in it to frame."""
    from d3stream_client.contract import Request

    from d3stream.kafka.registry import Registry

    registry = Registry(msgspec.structs.replace(settings.registry, answer_format="avro"))
    topic = settings.delivery.request_topics[0]
    framing = await registry.writers_for({topic: Request})
    out, framed = [], 0
    for index, (key, value) in enumerate(records):
        if index % 3 == 2 and value.lstrip().startswith(b"{"):
            try:
                value, framed = framing.encode(topic, value), framed + 1
            except (ValueError, TypeError, msgspec.DecodeError):
                pass  # not a request the schema can carry (it stays JSON, and is refused as JSON)
        out.append((key, value))
    return out, framed


def _demo_settings(broker: KafkaBroker, store: ObjectStore, registry: SchemaRegistry | None = None) -> Settings:
    """The worker's settings on the local broker and store (the demo's topics, group and bucket) and, with a
    Schema Registry, its address (framed requests are read; answers stay JSON, registered at start)."""
    from d3stream.settings import Settings

    return Settings.from_flat(
        schema_registry_url=registry.url if registry is not None else None,
        schema_auto_register=True,
        bootstrap_servers=broker.bootstrap_servers,
        request_topics=["demo.requests"],
        answer_topic="demo.answers",
        dead_letter_topic="demo.dead-letters",
        provenance_topic="demo.provenance",
        group_id="d3stream-demo",
        s3_endpoint_url=store.endpoint_url,
        s3_region=store.region,
        media_allowlist=[DEMO_BUCKET],
        linger_ms=20,
        label_topic="demo.labels",
        evaluation_topic="demo.evaluations",
        label_dead_letter_topic="demo.labels.dead-letters",
        evaluate_state_topic="demo.evaluate.state",
        evaluate_group_id="d3stream-demo-evaluate",
        metrics_port=None,
    )


async def _serve(settings: Settings, model: D3, broker: KafkaBroker, expected: int, progress: bool,
                 timeout_s: float) -> tuple[list[dict[str, object]], int]:
    """Serve until every request is answered: the answers read back from the answer topic, and how many
    records were dead-lettered."""
    from d3stream_client.subscriber import consume_answers
    from tqdm import tqdm

    from d3stream.service import Service

    service = Service(settings, model)
    serving = asyncio.create_task(service.run())
    bar = tqdm(total=expected, desc="answers", unit="req", disable=not progress, file=sys.stderr)
    try:
        answers = await consume_answers(broker.bootstrap_servers, "demo.answers", expected=expected,
                                        timeout_s=timeout_s, on_record=lambda _: bar.update())
    finally:
        bar.close()
        service.stop()
        await serving
    return answers, service.counts["dead_letters"]


async def _replayed(settings: Settings, baseline: D3) -> dict[str, dict[str, object]]:
    """The demo's requests replayed through ``baseline`` into a file: its answers by request id."""
    from d3stream.jobs.compare import read_jsonl, records_to_answers
    from d3stream.jobs.replay import ReplayRange, run_replay

    with tempfile.TemporaryDirectory() as folder:
        replay_file = Path(folder) / "replayed.jsonl"
        await run_replay(settings, baseline, ReplayRange(topic="demo.requests"), replay_id="random",
                         out_file=replay_file)
        return records_to_answers(read_jsonl(replay_file)) if replay_file.exists() else {}
