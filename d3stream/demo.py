"""The embedded default: a whole d3stream deployment on one machine, end to end, in one command.

``d3stream demo`` starts a local Kafka broker and S3-compatible store (``infra.local_stack``), builds a
tiny random-weight checkpoint (cached between runs), makes sample media, publishes sample requests
(text, image, video, and one malformed record), serves them with the real service, reads the answers
back and prints them with a summary. It exits 0 only when every published request has its answer.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .runtime.checkpoint import cache_root

DEMO_BUCKET = "d3stream-demo"


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
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for number in range(frames):
            frame = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            frame[:, : (number * width) // frames] = 255  # a bar that grows: the clip changes over time
            writer.write(frame)
        writer.release()
        return Path(path).read_bytes()


def demo_checkpoint(progress: bool = False) -> Path:
    """A tiny Qwen3.5 checkpoint with vision, built once per machine and reused."""
    from .runtime.checkpoint import build_checkpoint

    path = cache_root() / "checkpoints" / "demo-qwen3_5-tiny-seed0"
    if not (path / "MODEL_MANIFEST.json").is_file():
        build_checkpoint(path, backbone="qwen3_5", size="tiny", seed=0, progress=progress)
    return path


def sample_requests(image_uri: str, video_uri: str) -> list[tuple[bytes | None, bytes]]:
    """(key, value) records: text, image, video and mixed requests, then one malformed record."""
    route = {"type": "choice", "criteria": {"left": "turn left", "right": "turn right", "stop": "stop here"}}
    requests: list[dict[str, Any]] = [
        {
            "id": "demo-text-1",
            "state": "A delivery robot reaches a junction; the left corridor is blocked by boxes.",
            "questions": {
                "route": route,
                "blocked": {"type": "noul", "instructions": "Is the left corridor blocked?"},
                "urgency": {"type": "score", "criteria": ["none", "low", "high"]},
            },
            "metadata": {"source": "demo"},
        },
        {
            "id": "demo-text-2",
            "state": {"ticket": 4312, "text": "My card was charged twice."},
            "questions": {
                "team": {"type": "choice", "criteria": {"billing": "payments", "tech": "bugs", "sales": None}},
            },
        },
        {
            "id": "demo-image-1",
            "state": "A photo from the warehouse camera.",
            "questions": {"person": {"type": "noul", "instructions": "Is a person visible?"}},
            "images": [image_uri],
        },
        {
            "id": "demo-video-1",
            "state": "A clip from the loading dock.",
            "questions": {"motion": {"type": "noul", "instructions": "Does something move?"}, "route": route},
            "videos": [video_uri],
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
    records = [(r["id"].encode(), json.dumps(r).encode()) for r in requests]
    records.append((b"demo-malformed", b"{this is not json"))
    return records


async def run_demo(*, progress: bool = True, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the embedded deployment once; returns the summary (and the answers under ``answers``)."""
    from tqdm import tqdm

    from .clients import consume_answers, produce
    from .config import Settings
    from .infra import local_stack
    from .runtime import D3
    from .service import Service

    started = time.perf_counter()
    status = tqdm(total=5, desc="demo: starting", disable=not progress, file=sys.stderr, leave=False)
    with local_stack(progress=progress) as (broker, store):
        status.set_description("demo: checkpoint")
        status.update()
        checkpoint = demo_checkpoint(progress=False)
        model = D3.from_pretrained(checkpoint)
        status.set_description("demo: media")
        status.update()
        store.create_bucket(DEMO_BUCKET)
        client = store.client()
        client.put_object(Bucket=DEMO_BUCKET, Key="samples/aisle.png", Body=sample_png())
        client.put_object(Bucket=DEMO_BUCKET, Key="samples/dock.mp4", Body=sample_mp4())
        records = sample_requests(f"s3://{DEMO_BUCKET}/samples/aisle.png", f"s3://{DEMO_BUCKET}/samples/dock.mp4")
        settings = Settings(
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
        )
        status.set_description("demo: publishing")
        status.update()
        for topic in ("demo.requests", "demo.answers"):
            broker.create_topic(topic, exist_ok=True)
        await produce(broker.bootstrap_servers, "demo.requests", records)
        # The service reads credentials from the standard AWS chain, as it would in production.
        os.environ["AWS_ACCESS_KEY_ID"] = store.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = store.secret_key
        service = Service(settings, model)
        status.set_description("demo: serving")
        status.update()
        serving = asyncio.create_task(service.run())
        bar = tqdm(total=len(records), desc="answers", unit="req", disable=not progress, file=sys.stderr)
        try:
            answers = await consume_answers(
                broker.bootstrap_servers,
                "demo.answers",
                expected=len(records),
                timeout_s=timeout_s,
                on_record=lambda _: bar.update(),
            )
        finally:
            bar.close()
            service.stop()
            await serving
        status.update()
        status.close()
    published = {key.decode() for key, _ in records}
    answered = {answer["id"] for answer in answers}
    errors = sum(1 for answer in answers if answer.get("error"))
    return {
        "published": len(records),
        "answered": len(published & answered),
        "errors": errors,
        "dead_letters": service.counts["dead_letters"],
        "seconds": round(time.perf_counter() - started, 2),
        "answers": answers,
    }
