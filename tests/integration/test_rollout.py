"""Rolling out models on a live stream (``model_source``, ``--canary``; d3stream/models/rollout.py), against a real
broker, a real S3 endpoint and tiny real checkpoints: a pointer changed mid-stream swaps the default model
without losing, repeating or re-assigning anything; a tampered checkpoint is refused once and the old model
keeps answering; the canary share splits requests by their id and follows the pointer.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from d3stream_client.publisher import produce
from structlog.testing import capture_logs

from d3stream.models.checkpoints import POINTER
from d3stream.models.rollout import (
    load_source_models,
    share_point,
)
from d3stream.runtime.package import MANIFEST, package_files
from d3stream.service import Service
from tests.support.model_fixtures import copy_checkpoint
from tests.support.stream_helpers import Reader, assigned_and_ready, close_to, read_all, record, run, stop

# serve sets up logging in process, on the test's captured stderr: undone after each test.
pytestmark = pytest.mark.usefixtures("logging_restored")

Q_NOUL = {"type": "noul", "question": "Is the customer asking for a refund?"}


def write_pointer(put: Any, current: str, canary: tuple[str, float] | None = None) -> None:
    """A pointer document handed to ``put`` (bytes): one atomic write of CURRENT.json."""
    document: dict[str, Any] = {"schema": "d3-model-pointer/1", "current": current}
    if canary is not None:
        document["canary"] = {"checkpoint": canary[0], "share": canary[1]}
    put(json.dumps(document).encode())


def local_pointer(root: Path) -> Any:
    def put(data: bytes) -> None:
        staging = root / ".CURRENT.json.tmp"
        staging.write_bytes(data)
        staging.replace(root / POINTER)  # readers see the old pointer or the new one, never a mix

    return put


def request(rid: str, model: str | None = None) -> tuple[bytes, bytes]:
    body: dict[str, Any] = {"id": rid, "state": {"text": f"ticket {rid}: I was charged twice, refund me"},
                            "questions": {"refund": Q_NOUL}}
    if model is not None:
        body["model"] = model
    return record(body)


def sample(service: Service, name: str, **labels: str) -> float:
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def swaps(service: Service, outcome: str) -> float:
    return sample(service, "d3stream_model_swaps_total", outcome=outcome)


async def until_swaps(service: Service, reader: Reader, task: asyncio.Task, outcome: str, count: int) -> None:
    """Until ``count`` swaps of ``outcome``; on a timeout the failure shows where the rollout's watch waits."""
    try:
        await reader.wait(lambda: swaps(service, outcome) == count, 240, task, what=f"{count} {outcome}")
    except AssertionError as exc:
        stack = io.StringIO()
        if service.rollout is not None and service.rollout._task is not None:
            service.rollout._task.print_stack(file=stack)
        raise AssertionError(f"{exc}\nthe rollout's watch:\n{stack.getvalue()}") from exc


def test_a_pointer_changed_mid_stream_swaps_the_model_without_a_stop(
    stack: Any, tmp_path: Path, qwen35_text_checkpoint: Path, demo_random_checkpoint: Path,
    qwen35_text_model: Any, demo_random_model: Any,
) -> None:
    source = tmp_path / "source"
    copy_checkpoint(qwen35_text_checkpoint, source / "v1")
    copy_checkpoint(demo_random_checkpoint, source / "v2")
    write_pointer(local_pointer(source), "v1")
    settings = stack.settings(model_source=str(source), model_source_poll_ms=100)
    (served,) = load_source_models(settings.models, settings.storage)
    assert served.model_name == "v1"
    bootstrap = stack.broker.bootstrap_servers
    before = [f"before-{n}" for n in range(24)]
    after = [f"after-{n}" for n in range(8)]
    during: list[str] = []

    async def scenario() -> tuple[Service, Reader, dict[str, float]]:
        service = Service(settings, [served])
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                group = {"rebalances": sample(service, "d3stream_rebalances_total"),
                         "generation": sample(service, "d3stream_group_generation")}
                await produce(bootstrap, stack.requests, [request(rid) for rid in before])
                await reader.wait(lambda: len(reader.counts()) >= 6, 60, task, what="the first answers")
                write_pointer(local_pointer(source), "v2")
                # Under load: requests keep arriving while v2 loads, verifies and warms up in the background.
                deadline = asyncio.get_running_loop().time() + 240
                while swaps(service, "swapped") < 1:
                    assert asyncio.get_running_loop().time() < deadline and not task.done(), "no swap"
                    batch = [f"during-{len(during) + n}" for n in range(2)]
                    during.extend(batch)
                    await produce(bootstrap, stack.requests, [request(rid) for rid in batch])
                    await asyncio.sleep(0.25)
                await produce(bootstrap, stack.requests, [*(request(rid) for rid in after), request("names-v1", "v1")])
                await reader.wait_ids([*before, *during, *after, "names-v1"], 240, task)
                # The old model answered what was routed to it, then was dropped.
                await reader.wait(lambda: [h.name for h in service.hosted] == ["v2"], 30, task, what="v1 dropped")
                group_after = {"rebalances": sample(service, "d3stream_rebalances_total"),
                               "generation": sample(service, "d3stream_group_generation")}
                assert group_after == group, "the swap made the worker rejoin its group"
            finally:
                await stop(service, task)
            await reader.caught_up()
        return service, reader, group

    service, reader, group = run(scenario())
    assert group["rebalances"] >= 1
    counts = reader.counts()
    assert set(counts) == {*before, *during, *after, "names-v1"}, "lost answers"
    assert set(counts.values()) == {1}, "duplicated answers"
    assert swaps(service, "swapped") == 1
    assert set(service.pipeline.router.hosted) == {"v2"}
    # The worker's default model is the router's (its one owner), so its aliases follow the swap.
    v2 = service.pipeline.router.hosted["v2"]
    assert service.hosted == [v2] and service.default.model.model_name == "v2" and service.default.passes is v2.passes
    assert service.default.provenance_sha256 == v2.provenance_sha256 and service.default.passes.rows is v2.passes.rows

    references = {"v1": qwen35_text_model, "v2": demo_random_model}
    by_partition: dict[int, list[tuple[int, str]]] = defaultdict(list)
    digests: dict[str, str] = {}
    checked: dict[str, int] = defaultdict(int)
    retired = reader.by_id().pop("names-v1")
    # The retired model takes no new request, even one that names it.
    assert retired["error"]["code"] == "model_not_served" and "'v2'" in retired["error"]["message"]
    for answer in reader.answers():
        if answer["id"] == "names-v1":
            continue
        name = answer["model"]
        assert "error" not in answer, answer
        assert answer["provenance"]["model"]["name"] == name
        digests[name] = answer["provenance"]["model"]["provenance_sha256"]
        if checked[name] < 2:  # the model named is the one that answered (a few each: a CPU is slow)
            checked[name] += 1
            body = json.loads(request(answer["id"])[1])
            alone = references[name].system_one(state=body["state"], questions=body["questions"])["answers"]
            close_to(answer["answers"], alone, answer["id"])
        by_partition[answer["source"]["partition"]].append((answer["source"]["offset"], name))
    models = {answer["id"]: answer.get("model") for answer in reader.answers()}
    assert {models[rid] for rid in after} == {"v2"}
    assert sum(models[rid] == "v1" for rid in before) >= 6
    # One switch per partition: in read order, every answer of v1 comes before every answer of v2.
    for partition, answered in by_partition.items():
        names = [name for _, name in sorted(answered)]
        assert names == sorted(names), (partition, names)
    # A provenance record for the checkpoint swapped in, as for the one served at start.
    stored = {r.key.decode() for r in run(read_all(stack.broker.bootstrap_servers, stack.provenance, 1))}
    assert set(digests.values()) <= stored and len(set(digests.values())) == 2
    assert digests["v2"] == service.default.provenance_sha256


def upload(client: Any, bucket: str, prefix: str, root: Path, damaged: str | None = None) -> None:
    """A checkpoint under ``bucket/prefix/``; ``damaged``: that file with one byte flipped (manifest unchanged)."""
    for name in [*package_files(root), MANIFEST]:
        data = (root / name).read_bytes()
        if name == damaged:
            data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1:]
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


def test_a_tampered_checkpoint_is_refused_and_the_canary_share_follows_the_pointer(
    stack: Any, tmp_path: Path, qwen35_text_checkpoint: Path, demo_random_checkpoint: Path,
) -> None:
    client = stack.store.client()
    prefix = stack.unique("models")
    upload(client, stack.bucket, f"{prefix}/v1", qwen35_text_checkpoint)
    upload(client, stack.bucket, f"{prefix}/v2", demo_random_checkpoint)
    upload(client, stack.bucket, f"{prefix}/v3", demo_random_checkpoint, damaged="model.safetensors")

    def put(data: bytes) -> None:
        client.put_object(Bucket=stack.bucket, Key=f"{prefix}/{POINTER}", Body=data)

    write_pointer(put, "v1")
    settings = stack.settings(model_source=f"s3://{stack.bucket}/{prefix}/", model_source_poll_ms=100,
                              model_allowlist=[f"{stack.bucket}/{prefix}"], model_cache_dir=str(tmp_path / "cache"))
    served = load_source_models(settings.models, settings.storage)
    bootstrap = stack.broker.bootstrap_servers
    batches: dict[str, list[str]] = {"refused": [f"a-{n}" for n in range(10)],
                                     "share-0.3": [f"b-{n}" for n in range(80)],
                                     "share-0.8": [f"c-{n}" for n in range(80)]}
    # Requests that name v1 go there whatever their id's hash says.
    named = [rid for rid in (f"named-{n}" for n in range(60)) if share_point(rid) < 0.8][:6]

    async def scenario() -> tuple[Service, Reader, list[dict[str, Any]]]:
        service = Service(settings, served)
        async with Reader(bootstrap, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the assignment")
                with capture_logs() as logs:
                    write_pointer(put, "v3")
                    await until_swaps(service, reader, task, "refused_verification", 1)
                    await asyncio.sleep(1.0)  # ten polls of the same pointer
                assert swaps(service, "refused_verification") == 1, "the same bad pointer was tried again"
                await produce(bootstrap, stack.requests, [request(rid) for rid in batches["refused"]])
                await reader.wait_ids(batches["refused"], 60, task)

                write_pointer(put, "v1", ("v2", 0.3))
                await until_swaps(service, reader, task, "canary", 1)
                await produce(bootstrap, stack.requests, [request(rid) for rid in batches["share-0.3"]])
                await reader.wait_ids(batches["share-0.3"], 60, task)

                write_pointer(put, "v1", ("v2", 0.8))
                await until_swaps(service, reader, task, "canary", 2)
                await produce(bootstrap, stack.requests, [request(rid) for rid in batches["share-0.8"]] +
                              [request(rid, "v1") for rid in named])
                await reader.wait_ids([*batches["share-0.8"], *named], 60, task)
            finally:
                await stop(service, task)
            await reader.caught_up()
        return service, reader, logs

    service, reader, logs = run(scenario())
    (refusal,) = [line for line in logs if line["event"].startswith("model swap refused")]
    assert refusal["checkpoint"].endswith(f"{prefix}/v3")
    assert "model.safetensors" in refusal["reason"] and "SHA-256 differs" in refusal["reason"]
    assert swaps(service, "swapped") == 0
    models = {answer["id"]: answer["model"] for answer in reader.answers()}
    assert set(reader.counts().values()) == {1}
    assert {models[rid] for rid in batches["refused"]} == {"v1"}, "the old model keeps answering"
    for batch, share in (("share-0.3", 0.3), ("share-0.8", 0.8)):
        ids = batches[batch]
        # Deterministic: exactly the ids whose hash falls under the share, and about that share of them.
        assert {rid for rid in ids if models[rid] == "v2"} == {rid for rid in ids if share_point(rid) < share}
        assert {models[rid] for rid in ids} == {"v1", "v2"}
        assert abs(sum(models[rid] == "v2" for rid in ids) / len(ids) - share) < 0.12, batch
    assert {models[rid] for rid in named} == {"v1"}
