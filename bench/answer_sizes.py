"""Sizes of answer and dead-letter records, uncompressed and with each codec the producer offers.

The table under "Message size limits" in docs/DELIVERY.md comes from this script (`python bench/answer_sizes.py`).
Answers carry full-precision random probabilities, as a trained model's do (the tiny random test checkpoint's
near-identical probabilities would compress far better than real answers).
"""

from __future__ import annotations

import base64
import hashlib
import json
import random

from d3stream.kafka.limits import compress

rng = random.Random(0)
PROVENANCE = {
    "model": {"name": "d3-random-qwen3_5-tiny-seed0", "runtime": "d3-runtime/1", "provenance_sha256": "9f" * 32},
    "media": [], "batch": {"passes": 2, "rows": 41, "real_tokens": 9120, "padded_tokens": 9840},
    "timings": {"queued": 3.1, "fetch": 12.4, "decode": 4.0, "prepare": 6.2, "forward": 88.5, "total": 115.0},
    "worker": {"host": "d3stream-7c9f", "pid": 1, "version": "0.1.0"},
}


def choice(options: list[str]) -> dict:
    weights = [rng.random() for _ in options]
    total = sum(weights)
    probabilities = {option: weight / total for option, weight in zip(options, weights, strict=True)}
    return {"type": "choice", "choice": max(probabilities, key=probabilities.get), "probabilities": probabilities,
            "confidence": rng.random()}


def noul() -> dict:
    p = rng.random()
    return {"type": "noul", "noul": p, "probabilities": {"false": 1 - p, "true": p}}


def answer(answers: dict) -> bytes:
    return json.dumps({"id": "r", "answer_id": "a" * 32,
                       "source": {"topic": "d3.requests", "partition": 0, "offset": 1, "timestamp": 1},
                       "model": "m", "answers": answers, "usage": {"input_tokens": 1, "output_tokens": 0},
                       "provenance": PROVENANCE}).encode()


def main() -> None:
    raw = hashlib.shake_256(b"not json").digest(1_000_000)
    rows = [
        ("answer, 3 questions (choice, noul, score)",
         answer({"team": choice(["billing", "tech", "sales"]), "refund": noul(), "urgency": choice(["0", "1", "2"])})),
        ("answer, 150 choice questions x 255 options",
         answer({f"q{i}": choice([f"option-{j:03d}" for j in range(255)]) for i in range(150)})),
        ("answer, 12,000 noul questions", answer({f"q{i}": noul() for i in range(12_000)})),
        ("dead letter of a 1 MB non-JSON record, whole (before)",
         json.dumps({"value_base64": base64.b64encode(raw).decode()}).encode()),
        ("dead letter of the same, bounded (64 KiB kept)",
         json.dumps({"value_base64": base64.b64encode(raw[:65_536]).decode(), "value_bytes": len(raw),
                     "value_sha256": hashlib.sha256(raw).hexdigest(), "value_truncated": True}).encode()),
    ]
    print("| record | uncompressed | zstd | lz4 | gzip |")
    print("|---|---:|---:|---:|---:|")
    for name, body in rows:
        sizes = " | ".join(f"{len(compress(codec, body)):,}" for codec in ("zstd", "lz4", "gzip"))
        print(f"| {name} | {len(body):,} | {sizes} |")


if __name__ == "__main__":
    main()
