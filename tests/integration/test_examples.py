"""The README's "your own stream": ``examples/requests.jsonl`` published with ``d3stream produce
--upload-media`` (its local picture uploaded to the object store and rewritten to an ``s3://`` reference),
served, and every request answered without an error, on the session's real broker and object store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from d3stream.cli import main
from tests.support.stream_helpers import Reader, assigned_and_ready, stop

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REQUESTS = EXAMPLES / "requests.jsonl"


def _lines() -> list[dict]:
    return [json.loads(line) for line in REQUESTS.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_the_example_stream_is_published_with_produce_and_answered(stack, qwen35_model):
    from d3stream.service import Service

    ids = [request["id"] for request in _lines()]
    settings = stack.settings()
    service = Service(settings, qwen35_model)

    async def run() -> Reader:
        async with Reader(stack.broker.bootstrap_servers, stack.answers) as reader:
            task = asyncio.create_task(service.run())
            try:
                await reader.wait(lambda: assigned_and_ready(service), 60, task, what="the service's assignment")
                code = await asyncio.to_thread(main, [
                    "produce", stack.requests, str(REQUESTS), "--bootstrap-servers", stack.broker.bootstrap_servers,
                    "--upload-media", stack.bucket, "--s3-endpoint-url", stack.store.endpoint_url,
                ])
                assert code == 0
                await reader.wait_ids(ids, 90, task)
            finally:
                await stop(service, task)
            return reader

    answers = asyncio.run(run()).by_id()
    assert sorted(answers) == sorted(ids)
    for request_id, answer in answers.items():
        assert "error" not in answer, (request_id, answer.get("error"))
        assert all("error" not in slot for slot in answer["answers"].values()), request_id
        assert answer["metadata"]["queue"].startswith("support-")
    picture = answers["picture-2001"]
    (media,) = picture["provenance"]["media"]
    assert media["uri"].startswith(f"s3://{stack.bucket}/"), "the local picture was uploaded and referenced"
    assert media["sha256"]


def test_produce_uploads_through_the_settings_files_store_and_names_a_missing_bucket(stack, tmp_path, capsys):
    """--upload-media reaches the object store that the settings file names (no --s3-endpoint-url); a bucket
    that is not there ends the command with exit status 2 and a line naming it, before anything is published."""
    settings_file = tmp_path / "d3stream.toml"
    settings_file.write_text(f's3_endpoint_url = "{stack.store.endpoint_url}"\n', encoding="utf-8")
    common = ["--config", str(settings_file), "--bootstrap-servers", stack.broker.bootstrap_servers]

    missing = main(["produce", stack.requests, str(REQUESTS), *common, "--upload-media", "no-such-bucket"])
    refusal = capsys.readouterr().err
    assert missing == 2
    assert "bucket 'no-such-bucket'" in refusal and stack.store.endpoint_url in refusal and "Traceback" not in refusal

    assert main(["produce", stack.requests, str(REQUESTS), *common, "--upload-media", stack.bucket]) == 0
    assert f"published {len(_lines())} records" in capsys.readouterr().err
