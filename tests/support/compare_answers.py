"""Two answer files and a label file with known differences, as ``d3stream compare`` tests read them (the unit
tests from files and the CLI, the integration test from a topic range): the builders of answer events, the
records and the ``files`` fixture that writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def choice(probabilities: dict[str, float], confidence: float, pick: str | None = None) -> dict[str, Any]:
    pick = pick or max(probabilities, key=lambda k: probabilities[k])
    return {"type": "choice", "choice": pick, "probabilities": probabilities, "confidence": confidence}


def noul(p: float, p_false: float) -> dict[str, Any]:
    return {"type": "noul", "noul": p, "probabilities": {"false": p_false, "true": p}}


def score(levels: list[float], value: float, confidence: float) -> dict[str, Any]:
    return {"type": "score", "score": value, "probabilities": {str(i): p for i, p in enumerate(levels)},
            "confidence": confidence, "legend": {str(i): f"level {i}" for i in range(len(levels))}}


def event(request_id: str, answers: dict[str, Any]) -> dict[str, Any]:
    return {"id": request_id, "source": {"topic": "d3.requests", "partition": 0, "offset": 0},
            "model": "m", "answers": answers, "usage": {"input_tokens": 10, "output_tokens": 0}}


def refusal(request_id: str, code: str = "media_missing") -> dict[str, Any]:
    return {"id": request_id, "source": {"topic": "d3.requests", "partition": 0, "offset": 0},
            "error": {"code": code, "message": "no such object"}}


QUESTION_ERROR = {"type": "choice", "error": "max_length_exceeded", "message": "too long"}

# Six joined questions (r1: team, refund, urgency; r2: team, refund; r3: urgency); r2.team differs.
# |Δp| per option: r1.team .1 .1 0, r1.refund .2 .2, r1.urgency 0 .1 .1, r2.team .3 .3 0, r2.refund .1 .1,
# r3.urgency .1 .1 0: 16 options summing to 1.8.
A_RECORDS = [
    event("r1", {
        "team": choice({"billing": 0.7, "tech": 0.2, "sales": 0.1}, 0.5),
        "refund": noul(0.8, 0.2),
        "urgency": score([0.1, 0.3, 0.6], 1.5, 0.4),
    }),
    event("r2", {
        "team": choice({"billing": 0.6, "tech": 0.3, "sales": 0.1}, 0.3),
        "refund": noul(0.3, 0.7),
        "photo": choice({"yes": 0.9, "no": 0.1}, 0.8),
    }),
    event("r3", {"urgency": score([0.5, 0.3, 0.2], 0.7, 0.2)}),
    event("r4", {"refund": noul(0.9, 0.1)}),
    refusal("r7"),
]
B_RECORDS = [
    event("r1", {"team": choice({"billing": 0.1, "tech": 0.8, "sales": 0.1}, 0.9)}),  # replaced below
    event("r2", {
        "team": choice({"billing": 0.3, "tech": 0.6, "sales": 0.1}, 0.3),
        "refund": noul(0.4, 0.6),
        "photo": QUESTION_ERROR,
    }),
    event("r3", {"urgency": score([0.6, 0.2, 0.2], 0.6, 0.3), "extra": noul(0.5, 0.5)}),
    event("r1", {
        "team": choice({"billing": 0.6, "tech": 0.3, "sales": 0.1}, 0.4),
        "refund": noul(0.6, 0.4),
        "urgency": score([0.1, 0.4, 0.5], 1.4, 0.35),
    }),
    event("r5", {"refund": noul(0.2, 0.8)}),
    refusal("r6", "invalid_request"),
    event("r7", {"team": choice({"billing": 0.5, "tech": 0.5}, 0.0), "refund": noul(0.5, 0.5)}),
]
LABELS = [
    {"id": "r1", "question": "team", "answer": "billing"},
    {"id": "r1", "question": "refund", "answer": True},
    {"id": "r1", "question": "urgency", "answer": 2},
    {"id": "r2", "question": "team", "answer": "tech"},
    {"id": "r2", "question": "refund", "answer": False},
    {"id": "r3", "question": "urgency", "answer": 0},
    {"id": "r9", "question": "team", "answer": "billing"},  # no such request: unmatched
]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {
        "a": write_jsonl(tmp_path / "a.jsonl", A_RECORDS),
        "b": write_jsonl(tmp_path / "b.jsonl", B_RECORDS),
        "labels": write_jsonl(tmp_path / "labels.jsonl", LABELS),
    }
