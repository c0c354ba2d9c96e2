"""``d3stream bench stream N``: d3stream against the loop a user would write instead, on a mixed stream.

The question an operator asks before running d3stream: how many more requests per second does it answer
than the obvious loop? Both read the same N requests from one topic of the embedded broker and fetch
their images from the embedded object store, with the same loaded model and the same torch threads:

* **loop**: aiokafka ``getmany``; per record, parse the JSON, ``get_object`` each image with boto3, call
  ``system_one`` (one request at a time, ``batch_size`` questions per pass, as the reference runtime does),
  send the answer; after each fetched batch wait for the acknowledgements and commit (at least once);
* **d3stream**: ``Service`` with default settings (``exactly_once``), told only where the broker and the
  store are.

The stream is ``bench_workloads.make_stream``: small text requests with one in ten
carrying a JPEG image of 224x224 to 1280x720 from a pool of ten objects (``--images K``: 1 to K of
them). The same requests without their images give the text-only pair beside it. The four runs take turns for ``rounds`` rounds after one unmeasured
warm-up of each, and each keeps its best: on a 2-core machine single runs vary by a fifth. The clock starts
at the first fetched record (loop) or when the group is joined (d3stream) and stops when every answer is
acknowledged and its offset committed.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

from d3stream.benchmarks.bench_workloads import Request, make_stream
from d3stream.runtime import D3
from d3stream.settings import Settings

if TYPE_CHECKING:
    from botocore.client import BaseClient
    from PIL.Image import Image

    from d3stream.dev.infra import KafkaBroker, ObjectStore

BUCKET = "bench-stream"
PARTITIONS = 4
Run = Literal["loop_text", "d3stream_text", "loop_mixed", "d3stream_mixed"]
RUNS: tuple[Run, ...] = ("loop_text", "d3stream_text", "loop_mixed", "d3stream_mixed")


def stream_records(requests: Sequence[Request], uris: dict[int, str], *,
                   with_images: bool) -> list[tuple[bytes, bytes]]:
    """The requests as (key, value) records; ``uris`` maps a pool image (by ``id``) to its object's URI."""
    records = []
    for number, request in enumerate(requests):
        request_id = f"r{number:06d}"
        event: dict[str, object] = {"id": request_id, "state": request.state, "questions": request.questions}
        if with_images and request.images:
            event["images"] = [uris[id(image)] for image in request.images]
        records.append((request_id.encode(), json.dumps(event).encode()))
    return records


def _jpeg(image: Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def upload_pool(store: ObjectStore, requests: Sequence[Request]) -> dict[int, str]:
    """Put every distinct image of the requests into the store as a JPEG; its URI by image ``id``."""
    client = store.client()
    store.create_bucket(BUCKET)
    uris: dict[int, str] = {}
    for request in requests:
        for image in request.images:
            if id(image) not in uris:
                key = f"pool/{len(uris)}-{image.width}x{image.height}.jpg"
                client.put_object(Bucket=BUCKET, Key=key, Body=_jpeg(image))
                uris[id(image)] = f"s3://{BUCKET}/{key}"
    return uris


# ---------------------------------------------------------------------------------------------- the loop


def loop_answer(model: D3, s3: BaseClient) -> Callable[[bytes], bytes]:
    """What the loop publishes for a record: ``system_one``'s answer to it, its images read with boto3. The
    stream is well formed, so a request it cannot answer raises and stops the run (a failing loop is not
    measured)."""

    def answer(value: bytes) -> bytes:
        request = json.loads(value)
        images: list[bytes] = []
        for uri in request.get("images", []):
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            images.append(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        response = model.system_one(state=request["state"], questions=request["questions"], images=images or None)
        return json.dumps({"id": request["id"], **response}).encode()

    return answer


# ---------------------------------------------------------------------------------------------- the runs


def _settings(broker: KafkaBroker, store: ObjectStore, topics: dict[str, str], group: str,
              threads: int | None) -> Settings:
    return Settings.from_flat(
        bootstrap_servers=broker.bootstrap_servers, request_topics=[topics["source"]], answer_topic=topics["answers"],
        dead_letter_topic=topics["dlq"], provenance_topic=topics["prov"], group_id=group, client_id=group,
        metrics_port=None, create_topics=False, log_level="warning", torch_threads=threads,
        s3_endpoint_url=store.endpoint_url, s3_region=store.region, media_allowlist=[BUCKET],
    )


def _one_run(name: str, model: D3, stack: tuple[KafkaBroker, ObjectStore], topics: dict[str, str], group: str,
             count: int, threads: int | None) -> float:
    from d3stream.benchmarks.bench_service import consume_answer_loop, serve_until_answered

    broker, store = stack
    if name.startswith("loop"):
        return asyncio.run(consume_answer_loop(broker.bootstrap_servers, topics["source"], topics["loop-out"], group,
                                               count, answer=loop_answer(model, store.client()), max_records=64))
    seconds, service = asyncio.run(serve_until_answered(_settings(broker, store, topics, group, threads), model, count))
    if service.counts["errors"]:
        raise RuntimeError(f"{name}: {service.counts['errors']} requests were answered with an error")
    return seconds


class RunFigures(TypedDict):
    """One run's best round."""

    seconds: float
    requests_per_s: float


class StreamReport(TypedDict):
    """``d3stream bench stream``: the stream, each run's best round and every round's rate, d3stream over the
    loop."""

    requests: int
    with_images: int
    images: int
    questions: int
    partitions: int
    rounds: int
    torch_threads: int
    checkpoint: str
    by_round: dict[str, list[float]]
    loop_text: RunFigures
    d3stream_text: RunFigures
    loop_mixed: RunFigures
    d3stream_mixed: RunFigures
    text_ratio: float
    mixed_ratio: float


def stream_bench(checkpoint: Path, count: int = 300, *, rounds: int = 3, seed: int = 0, threads: int | None = None,
                 images_per_request: int = 1, stack: tuple[KafkaBroker, ObjectStore] | None = None,
                 progress: Callable[[str], None] | None = None) -> StreamReport:
    """The four runs side by side on one broker and store (default: a fresh embedded pair)."""
    if stack is None:
        from d3stream.dev.infra import local_stack

        with local_stack(partitions=PARTITIONS) as fresh:
            return stream_bench(checkpoint, count, rounds=rounds, seed=seed, threads=threads,
                                images_per_request=images_per_request, stack=fresh, progress=progress)
    import torch
    from d3stream_client.publisher import produce

    broker, store = stack
    os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = store.access_key, store.secret_key
    if threads is not None:
        torch.set_num_threads(threads)
    model = D3.from_pretrained(checkpoint, device="cpu")
    requests = make_stream(count, seed, model.tokenizer, images_per_request)
    uris = upload_pool(store, requests)
    prefix = f"stream-{time.time_ns()}"
    kinds = {"text": stream_records(requests, uris, with_images=False),
             "mixed": stream_records(requests, uris, with_images=True)}
    topics: dict[str, dict[str, str]] = {}
    for kind, records in kinds.items():
        topics[kind] = {name: f"{prefix}.{kind}.{name}" for name in ("source", "loop-out", "answers", "dlq", "prov")}
        for topic in topics[kind].values():
            broker.create_topic(topic, PARTITIONS, exist_ok=True)
        asyncio.run(produce(broker.bootstrap_servers, topics[kind]["source"], records))
    with_images = sum(1 for request in requests if request.images)
    torch_threads = torch.get_num_threads()
    by_round: dict[str, list[float]] = {}
    best: dict[Run, RunFigures] = {}  # each run's best round
    for round_number in range(-1, rounds):  # round -1 warms both paths up, unmeasured
        for name in RUNS:
            if progress is not None:
                progress(f"{name} ({'warm-up' if round_number < 0 else f'{round_number + 1}/{rounds}'})")
            group = f"{prefix}-{name}-{round_number + 1}"
            seconds = _one_run(name, model, stack, topics[name.split("_")[1]], group, count, threads)
            if round_number < 0:
                continue
            rate = round(count / seconds, 2)
            by_round.setdefault(name, []).append(rate)
            if name not in best or rate > best[name]["requests_per_s"]:
                best[name] = {"seconds": round(seconds, 2), "requests_per_s": rate}
    return {
        "requests": count, "with_images": with_images, "images": sum(len(r.images) for r in requests),
        "questions": sum(len(r.questions) for r in requests), "partitions": PARTITIONS, "rounds": rounds,
        "torch_threads": torch_threads, "checkpoint": str(checkpoint), "by_round": by_round,
        "loop_text": best["loop_text"], "d3stream_text": best["d3stream_text"],
        "loop_mixed": best["loop_mixed"], "d3stream_mixed": best["d3stream_mixed"],
        "text_ratio": round(best["d3stream_text"]["requests_per_s"] / best["loop_text"]["requests_per_s"], 2),
        "mixed_ratio": round(best["d3stream_mixed"]["requests_per_s"] / best["loop_mixed"]["requests_per_s"], 2),
    }


def stream_markdown(report: StreamReport) -> str:
    lines = [
        f"{report['requests']:,} requests ({report['questions']:,} questions; {report['with_images']} with "
        f"{report['images']} images in the mixed stream), {report['partitions']} partitions, torch threads "
        f"{report['torch_threads']}, best of {report['rounds']} rounds after a warm-up:",
        "",
        "| stream | loop (aiokafka + system_one) | d3stream | d3stream ÷ loop |",
        "|---|---:|---:|---:|",
    ]
    for stream, loop, d3stream, ratio in (
            ("text only", report["loop_text"], report["d3stream_text"], report["text_ratio"]),
            ("mixed (images)", report["loop_mixed"], report["d3stream_mixed"], report["mixed_ratio"])):
        lines.append(f"| {stream} | {loop['requests_per_s']:,.1f} req/s | "
                     f"{d3stream['requests_per_s']:,.1f} req/s | {ratio:.2f}x |")
    return "\n".join(lines)
