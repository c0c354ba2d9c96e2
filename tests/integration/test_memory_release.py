"""What an answered request leaves behind: nothing (issue 36).

A worker keeps a request's record until its answer is delivered, and the record leads to everything the
request made: its decoded images, the processor's output (the vision inputs) and its prompts. Should anything
of it sit in a reference cycle, only Python's cyclic collector frees it, and large pixel and tensor buffers
do not prompt that collector to run: a worker serving 16-megapixel images grew by about 600 MB a request
and never gave it back (an answer's too-large replacement held its own record).

So the guard serves large-image requests on the real broker and object store with the cyclic collector off,
follows each request's record, decoded images and processor output through weak references, and requires
every one of them to be gone once the request's answer is read: reference counting alone must free them.
It asserts what is alive, never an RSS figure or a time (``d3stream bench soak-images`` measures those).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from d3stream_client.publisher import produce

from d3stream.service import Service
from tests.support.media_makers import make_png, make_smooth_png
from tests.support.stream_helpers import Q_NOUL, Reader, assigned_and_ready, record, run, stop

# One pytest worker runs the modules of 16-megapixel images (xdist_group, make test's --dist loadgroup): two of
# them side by side (gigabytes of pixels each) starved each other on the 2-core machine (a 120 s wait ran out).
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("large-media")]

REQUESTS = 3
IMAGES_PER_REQUEST = 2
SIDE = 4000  # 16-megapixel PNGs: 48 MB of RGB each once decoded, a few tens of KB encoded


class Followed:
    """Weak references to what each request made, by request id: its record, its decoded images and the
    processor's output; ``alive(rid)`` names those still alive."""

    def __init__(self) -> None:
        self.refs: dict[str, list[tuple[str, weakref.ref[Any]]]] = {}

    def follow(self, rid: str, what: str, value: Any) -> None:
        self.refs.setdefault(rid, []).append((what, weakref.ref(value)))

    def alive(self, rid: str) -> list[str]:
        return [what for what, ref in self.refs.get(rid, []) if ref() is not None]

    def referrers(self, rid: str) -> str:
        """What refers to the first thing still alive (the start of the chain to look at when this fails)."""
        for what, ref in self.refs.get(rid, []):
            value = ref()
            if value is not None:
                holders = [type(holder).__name__ for holder in gc.get_referrers(value)]
                return f"{what} is referred to by {holders}"
        return ""


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_an_answered_large_image_request_leaves_no_media_inputs_or_record_alive(stack, qwen35_model, monkeypatch,
                                                                                collector_off):
    followed = Followed()
    real_prepare = qwen35_model.prepare

    def prepare(state: Any, questions: Any, **media: Any) -> Any:
        """The model's own prepare, watched: what went in (decoded images) and what came out (vision inputs)."""
        rid = str(state)
        for image in media.get("decoded_images") or ():
            followed.follow(rid, "a decoded image", image)
        prepared = real_prepare(state, questions, **media)
        followed.follow(rid, "the prepared request", prepared)
        if prepared.media is not None:
            followed.follow(rid, "the processor's output", prepared.media)
            for name, tensor in prepared.media.inputs.items():
                followed.follow(rid, f"the vision input {name}", tensor)
        return prepared

    monkeypatch.setattr(qwen35_model, "prepare", prepare)
    service = Service(stack.settings(), qwen35_model)
    real_begin = service.pipeline._begin

    def begin(read: Any) -> Any:
        made = real_begin(read)
        followed.follow(read.key.decode(), "the request record", made)
        return made

    monkeypatch.setattr(service.pipeline, "_begin", begin)
    # Distinct pixels per request (the vision-feature cache keys on content: a repeat would be a cache hit).
    uris = [[stack.put(f"big/{n}-{k}.png", make_smooth_png(SIDE - n, SIDE - k)) for k in range(IMAGES_PER_REQUEST)]
            for n in range(REQUESTS)]
    small = stack.put("small.png", make_png(64, 64, seed=4))
    bootstrap = stack.broker.bootstrap_servers
    requests = [{"id": f"big-{n}", "state": f"big-{n}", "questions": {"noul": Q_NOUL}, "images": uris[n]}
                for n in range(REQUESTS)]
    # A small image after them: a request served after the large ones frees theirs too.
    requests.append({"id": "small", "state": "small", "questions": {"noul": Q_NOUL}, "images": [small]})
    still_alive: dict[str, list[str]] = {}

    async def gone(reader: Reader, rid: str, task: asyncio.Task) -> None:
        """Until nothing of ``rid`` is alive; what is left, with its holders, if that never comes."""
        try:
            await reader.wait(lambda: not followed.alive(rid), 30, task, what=f"{rid}'s objects to be freed")
        except AssertionError:
            still_alive[rid] = [*followed.alive(rid), followed.referrers(rid)]

    async def scenario() -> dict[str, Any]:
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                for each in requests:  # one at a time, as the worker served them
                    await produce(bootstrap, stack.requests, [record(each)])
                    await reader.wait_ids([each["id"]], 120, task)
                    await gone(reader, each["id"], task)
            finally:
                await stop(service, task)
            return reader.by_id()

    answers = run(scenario())
    assert all("error" not in answers[each["id"]] for each in requests), answers
    # Each large request was followed through its record, its two images and the processor's output.
    for n in range(REQUESTS):
        kinds = {what for what, _ in followed.refs[f"big-{n}"]}
        assert {"the request record", "a decoded image", "the processor's output",
                "the vision input pixel_values"} <= kinds, kinds
    assert not still_alive, f"alive after the answer, with the cyclic collector off: {still_alive}"
