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
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar

import msgspec
import numpy as np

from d3stream.dev import tasks
from d3stream.jobs.evaluate import FiguresJson, run_worker
from d3stream.settings import Settings, cache_root

if TYPE_CHECKING:
    from d3stream.dev.infra import KafkaBroker, ObjectStore, SchemaRegistry
    from d3stream.runtime import D3
    from d3stream.service import Service

_T = TypeVar("_T")

DEMO_BUCKET = "d3stream-demo"
# Held-out tickets and pictures published next to the showcase, for the labelled re-evaluation.
HELDOUT_TICKETS = 24
HELDOUT_PICTURES = 8


class Steps:
    """The demo's progress as plain lines, on a terminal or not (a CI log, ``| tee``): one when a step starts,
    one when it ends with its time, through ``say`` (None: silent). The times are kept for the summary."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.say = say
        self.seconds: dict[str, float] = {}

    def line(self, text: str) -> None:
        if self.say is not None:
            self.say(f"demo: {text}")

    @contextlib.contextmanager
    def step(self, name: str, doing: str) -> Iterator[list[str]]:
        """Say that ``name`` starts (``doing``), then that it is done, in how long, with the notes the block
        appended to the list it is given."""
        self.line(f"{name}: {doing}")
        started = time.perf_counter()
        notes: list[str] = []
        yield notes
        self.seconds[name] = round(time.perf_counter() - started, 1)
        self.line(f"{name}: done in {self.seconds[name]:.1f} s" + (f" ({'; '.join(notes)})" if notes else ""))


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


def trained_checkpoint_path() -> Path:
    """Where ``trained_checkpoint`` keeps the trained checkpoint (one folder per ``train.TRAIN_BUILD``)."""
    from d3stream.dev.train import DEFAULT_STEPS, TRAIN_BUILD

    return cache_root() / "checkpoints" / f"demo-trained-b{TRAIN_BUILD}-qwen3_5-tiny-seed0-steps{DEFAULT_STEPS}"


def trained_checkpoint(progress: bool = False) -> Path:
    """The same checkpoint trained on the demo task (about a minute on the first run), cached likewise."""
    from d3stream.dev.build_checkpoint import build_checkpoint

    path = trained_checkpoint_path()
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
    """``run_demo``'s summary: also the time of each step (``Steps``) and of the whole run."""

    step_seconds: dict[str, float]
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
    say: Callable[[str], None] | None = None,
) -> DemoSummary:
    """Run the embedded deployment once; returns the summary (and the answers under ``answers``).

    ``trained`` and ``baseline`` default to the cached demo checkpoints (built on first use); ``stack``, a
    running ``(KafkaBroker, ObjectStore)``, to a fresh ``infra.embedded_stack`` for the run, with its Schema
    Registry (``registry`` gives one beside a given ``stack``): every third request is then published framed as
    Avro through it, as a producer of a Confluent estate would, beside the plain JSON ones. ``say`` gets a
    line when each step starts and ends (``Steps``); ``progress`` draws the answers' bar (a terminal's).
    """
    from contextlib import ExitStack

    from tqdm.contrib.logging import logging_redirect_tqdm

    from d3stream.dev.infra import embedded_stack

    started = time.perf_counter()
    steps = Steps(say)
    with ExitStack() as scope:
        if progress:
            # While the bar is drawn, log lines go through tqdm.write: printed above the bar, which is
            # redrawn below them, instead of a line torn in two by the next refresh.
            scope.enter_context(logging_redirect_tqdm())
        # The checkpoints are built (on the first run) and loaded on a thread of their own while the servers'
        # JVMs start: neither waits for the other.
        loading = _Loading(steps, trained, baseline)
        if stack is None:
            with steps.step("servers", "starting Kafka, the S3 store and the Schema Registry (local JVMs)") as notes:
                with _short_lived_jvms():
                    started_stack = scope.enter_context(_stopping(embedded_stack(progress=progress), steps))
                stack, registry = (started_stack.broker, started_stack.store), started_stack.registry
                notes.append(f"Kafka at {started_stack.broker.bootstrap_servers}")
        broker, store = stack
        models = loading.result()
        summary = await _serve_and_reevaluate(broker, store, registry, models, steps, progress, timeout_s)
    return {**summary, "step_seconds": steps.seconds, "seconds": round(time.perf_counter() - started, 2)}


# The demo's servers live for half a minute: the JIT's first tier alone (C1) starts them on half the CPU, which on
# two cores is half the wait (measured: 8.9 s instead of 19.6 s beside the checkpoints' loading). The test suite
# starts its servers so too (tests/conftest.py); `d3stream stack`, whose servers stay, does not.
DEMO_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"


@contextlib.contextmanager
def _short_lived_jvms() -> Iterator[None]:
    """``DEMO_JVM_OPTIONS`` for the servers started inside, unless the environment names JVM options already."""
    from d3stream.dev.infra import JVM_OPTIONS_ENV

    if JVM_OPTIONS_ENV in os.environ:
        yield
        return
    os.environ[JVM_OPTIONS_ENV] = DEMO_JVM_OPTIONS
    try:
        yield
    finally:
        os.environ.pop(JVM_OPTIONS_ENV, None)


@contextlib.contextmanager
def _stopping(servers: contextlib.AbstractContextManager[_T], steps: Steps) -> Iterator[_T]:
    """``servers`` entered, and on the way out a line before and after they stop (it takes seconds)."""
    with servers as running:
        try:
            yield running
        finally:
            steps.line("servers: stopping")
            stopping = time.perf_counter()
    steps.seconds["stopping"] = round(time.perf_counter() - stopping, 1)
    steps.line(f"servers: stopped in {steps.seconds['stopping']:.1f} s")


class _Loading:
    """The served (trained) and the baseline (random) checkpoint, built on the first run and loaded, on a
    thread of its own: a step that runs beside the servers' start, its lines said from both threads."""

    def __init__(self, steps: Steps, trained: Path | None, baseline: Path | None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from d3stream.dev.train import TRAIN_BUILD

        first = trained is None and not (trained_checkpoint_path() / "MODEL_MANIFEST.json").is_file()
        steps.line("checkpoints: " + (
            f"building and training the demo checkpoint, beside the servers (the first run of training build "
            f"{TRAIN_BUILD}: about a minute; cached for the next runs)" if first
            else "loading the trained and the random checkpoint, beside the servers"))
        self.steps = steps
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="d3stream-demo-checkpoints")
        self.future = self.pool.submit(self._load, trained, baseline)

    def _load(self, trained: Path | None, baseline: Path | None) -> tuple[D3, D3]:
        from d3stream.runtime import D3

        baseline_path = baseline or demo_checkpoint(progress=False)
        trained_path = trained or trained_checkpoint(progress=False)
        models = D3.from_pretrained(trained_path), D3.from_pretrained(baseline_path)
        self.seconds = round(time.perf_counter() - self.started, 1)
        return models

    def result(self) -> tuple[D3, D3]:
        """Wait for both checkpoints; the step's end line (its own time, not the wait's)."""
        try:
            models = self.future.result()
        finally:
            self.pool.shutdown(wait=False)
        self.steps.seconds["checkpoints"] = self.seconds
        self.steps.line(f"checkpoints: done in {self.seconds:.1f} s ({models[0].model_name} served, "
                        f"{models[1].model_name} to compare with)")
        return models


async def _in_step(steps: Steps, name: str, doing: str, work: Awaitable[_T], note: Callable[[_T], str]) -> _T:
    """``work`` awaited as the step ``name`` (a task of its own runs it beside another step)."""
    with steps.step(name, doing) as notes:
        result = await work
        notes.append(note(result))
    return result


async def _serve_and_reevaluate(
    broker: KafkaBroker, store: ObjectStore, registry: SchemaRegistry | None, models: tuple[D3, D3], steps: Steps,
    progress: bool, timeout_s: float
) -> Served:
    """Publish the sample requests, serve them with the trained model, replay them with the baseline and
    compare both with the labels."""
    from d3stream_client.publisher import produce

    from d3stream.jobs.compare import records_to_answers
    from d3stream.ops.logs import kernel_notice

    model, baseline = models
    notice = kernel_notice(model.kernel_record(), str(model.device))
    if notice and progress:
        steps.line(notice)  # once (transformers' own warnings are at debug)
    examples = labelled_examples()
    settings = _demo_settings(broker, store, registry)
    labels = [(e.id.encode(), json.dumps({"id": e.id, "labels": e.labels, "source": "demo"}).encode())
              for e in examples]
    with steps.step("publishing", "sample media to the S3 store, requests and labels to Kafka") as notes:
        records = _sample_records(store, examples)
        records, framed = await _framed(records, settings) if registry is not None else (records, 0)
        for topic in ("demo.requests", "demo.answers", "demo.labels"):
            await broker.acreate_topic(topic, settings.delivery.topic_partitions, exist_ok=True)
        # Half of the labels are known before the requests are even answered: they wait for their answers.
        await produce(broker.bootstrap_servers, "demo.labels", labels[::2])
        await produce(broker.bootstrap_servers, "demo.requests", records)
        notes.append(f"{len(records)} requests, {framed} of them as Avro; {len(labels[::2])} labels")
    # The service reads credentials from the standard AWS chain, as it would in production.
    os.environ["AWS_ACCESS_KEY_ID"] = store.access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = store.secret_key
    stop_evaluating = asyncio.Event()
    evaluating = asyncio.ensure_future(run_worker(settings, stop_evaluating))
    # The replay reads the request topic as published (a fixed range, a consumer group of its own): it runs
    # beside the live worker rather than after it.
    replaying = asyncio.ensure_future(_in_step(
        steps, "replay", f"the request topic through {baseline.model_name}, into a file, beside the live worker",
        _replayed(settings, baseline), lambda replayed: f"{len(replayed)} answers"))
    serving: asyncio.Task[None] | None = None
    try:
        with steps.step("answers", f"serving with {model.model_name}, d3stream evaluate beside it") as notes:
            service, serving, answers = await _serve(settings, model, broker, len(records), progress, timeout_s)
            errors = sum(1 for answer in answers if answer.get("error"))
            notes.append(f"{len(answers)} answers, {errors} of them errors")
        # The other half arrives after the answers, as a closed ticket's truth does.
        await produce(broker.bootstrap_servers, "demo.labels", labels[1::2])
        replayed = await replaying
        with steps.step("evaluation", "the live evaluation's figures, and both checkpoints against the labels") as notes:
            live = await _live_figures(settings, answers, {e.id for e in examples}, timeout_s)
            offline = reevaluation(records_to_answers(answers), replayed, examples,
                                   (model.model_name, baseline.model_name))
            notes.append(f"accuracy {offline['accuracy'][0]:.3f} against {offline['accuracy'][1]:.3f}")
        await serving  # it finished its in-flight work, committed and closed meanwhile
        dead_letters = service.counts["dead_letters"]
    finally:
        replaying.cancel()
        if serving is not None and not serving.done():
            service.stop()
            await asyncio.gather(serving, return_exceptions=True)
        stop_evaluating.set()
        await evaluating
    published = {key.decode() for key, _ in records}
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
                 timeout_s: float) -> tuple[Service, asyncio.Task[None], list[dict[str, object]]]:
    """Serve until every request is answered: the service, its task (asked to stop: it finishes, commits and
    closes while the demo goes on; await it) and the answers read back from the answer topic."""
    from d3stream_client.subscriber import consume_answers
    from tqdm import tqdm

    from d3stream.service import Service

    service = Service(settings, model)
    serving = asyncio.create_task(service.run())
    bar = tqdm(total=expected, desc="answers", unit="req", disable=not progress, file=sys.stderr)
    try:
        answers = await consume_answers(broker.bootstrap_servers, "demo.answers", expected=expected,
                                        timeout_s=timeout_s, on_record=lambda _: bar.update())
    except BaseException:
        service.stop()
        await asyncio.gather(serving, return_exceptions=True)
        raise
    finally:
        bar.close()
    service.stop()
    return service, serving, answers


async def _replayed(settings: Settings, baseline: D3) -> dict[str, dict[str, object]]:
    """The demo's requests replayed through ``baseline`` into a file: its answers by request id."""
    from d3stream.jobs.compare import read_jsonl, records_to_answers
    from d3stream.jobs.replay import ReplayRange, run_replay

    with tempfile.TemporaryDirectory() as folder:
        replay_file = Path(folder) / "replayed.jsonl"
        await run_replay(settings, baseline, ReplayRange(topic="demo.requests"), replay_id="random",
                         out_file=replay_file)
        return records_to_answers(read_jsonl(replay_file)) if replay_file.exists() else {}
