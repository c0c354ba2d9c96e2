"""The README's "your own stream": ``examples/requests.jsonl`` holds valid requests whose media are at hand (it
is published and answered in tests/integration/test_examples.py)."""

from __future__ import annotations

import json
from pathlib import Path

from d3stream_client.validation import decode_request

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
REQUESTS = EXAMPLES / "requests.jsonl"


def _lines() -> list[dict]:
    return [json.loads(line) for line in REQUESTS.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_example_requests_are_valid_and_their_media_are_at_hand():
    requests = _lines()
    assert len(requests) >= 3
    for line in REQUESTS.read_text(encoding="utf-8").splitlines():
        decode_request(line.encode())  # raises EventError naming what is wrong
    local = [ref for request in requests for ref in request.get("images", []) if not ref.startswith("s3://")]
    assert local, "the example shows a local picture that produce --upload-media uploads"
    assert all((EXAMPLES / ref).is_file() for ref in local)
