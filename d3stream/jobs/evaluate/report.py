"""``d3stream evaluate --report``: the evaluation topic folded into figures per model and question.

``--report`` folds the evaluation topic into the same ``Tally`` that ``d3stream compare --labels`` uses, so the
same answers and labels give the same figures both ways.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from d3stream.core.agreement import LabelStats, Scored, Tally

if TYPE_CHECKING:
    from d3stream.settings import Settings


@dataclass(frozen=True)
class ModelFigures:
    """One model's figures over its evaluations, overall and per question."""

    model: str
    role: str
    requests: int
    overall: LabelStats
    by_question: dict[str, LabelStats]


def figures(evaluations: Iterable[object]) -> list[ModelFigures]:
    """Evaluation records (decoded JSON) folded per (role, model) and question; records of another shape are
    skipped. Live models first, then by name."""
    tallies: dict[tuple[str, str], tuple[Tally, dict[str, Tally], list[int]]] = {}
    for record in evaluations:
        if not isinstance(record, dict) or not isinstance(record.get("questions"), dict):
            continue
        key = (str(record.get("role", "live")), str(record.get("model", "unknown")))
        overall, by_question, requests = tallies.setdefault(key, (Tally(), {}, [0]))
        requests[0] += 1
        for question_id, question in record["questions"].items():
            scored = Scored(type=question["type"], label_option=question["label_option"],
                            predicted=question["predicted"], p_label=question["p_label"],
                            confidence=question["confidence"], correct=question["correct"], brier=question["brier"],
                            log_loss=question["log_loss"], expected_brier=question.get("expected_brier"))
            overall.add(scored)
            by_question.setdefault(question_id, Tally()).add(scored)
    return [ModelFigures(model, role, requests[0], overall.stats(),
                         {q: tally.stats() for q, tally in sorted(by_question.items())})
            for (role, model), (overall, by_question, requests) in sorted(tallies.items(), key=lambda item: (
                item[0][0] != "live", item[0][1]))]


class StatsJson(TypedDict):
    """Figures over one group of evaluations (``LabelStats``), as ``--report --json`` prints them."""

    n: int
    accuracy: float | None
    brier: float | None
    log_loss: float | None
    ece: float | None
    estimated_accuracy: float | None
    estimated_brier: float | None
    accuracy_error: float | None
    brier_error: float | None


class ModelJson(StatsJson):
    """One model's figures: overall, and by question."""

    model: str
    role: str
    requests: int
    questions: dict[str, StatsJson]


class FiguresJson(TypedDict):
    """``d3stream evaluate --report --json``."""

    models: list[ModelJson]


def _stats_json(stats: LabelStats) -> StatsJson:
    return {"n": stats.n, "accuracy": stats.accuracy, "brier": stats.brier, "log_loss": stats.log_loss,
            "ece": stats.ece, "estimated_accuracy": stats.estimated_accuracy, "estimated_brier": stats.estimated_brier,
            "accuracy_error": stats.accuracy_error, "brier_error": stats.brier_error}


def figures_json(models: list[ModelFigures]) -> FiguresJson:
    return {"models": [{"model": m.model, "role": m.role, "requests": m.requests, **_stats_json(m.overall),
                        "questions": {q: _stats_json(s) for q, s in m.by_question.items()}} for m in models]}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def render(models: list[ModelFigures]) -> str:
    """The figures as a table: one row per model, then one per model and question."""
    if not models:
        return "no evaluations yet: are labels arriving on the label topic, and is d3stream evaluate running?"
    # The text columns as wide as their longest entry, and a space more: a long model name (a checkpoint's
    # digest, a path) or question id must not run into the next column.
    role = max([8, *(len(m.role) + 2 for m in models)])
    model = max([24, *(len(m.model) + 2 for m in models)])
    asked = max([16, *(len(question) + 2 for m in models for question in m.by_question)])
    lines = [f"{'role':<{role}}{'model':<{model}}{'question':<{asked}}{'n':>8}{'accuracy':>10}{'Brier':>9}"
             f"{'log loss':>10}{'ECE':>9}{'est. acc.':>11}{'est. Brier':>11}{'acc. err.':>11}{'Brier err.':>11}"]
    for m in models:
        for question, stats in [("(all)", m.overall), *m.by_question.items()]:
            lines.append(f"{m.role:<{role}}{m.model:<{model}}{question:<{asked}}{stats.n:>8}{_fmt(stats.accuracy):>10}"
                         f"{_fmt(stats.brier):>9}{_fmt(stats.log_loss):>10}{_fmt(stats.ece):>9}"
                         f"{_fmt(stats.estimated_accuracy):>11}{_fmt(stats.estimated_brier):>11}"
                         f"{_fmt(stats.accuracy_error):>11}{_fmt(stats.brier_error):>11}")
    lines.append("est.: what the answers expected of themselves from their own probabilities (CBPE); err.: expected "
                 "minus realized over the same labelled questions, near 0 while the model is calibrated")
    return "\n".join(lines)


def read_figures(settings: Settings, timeout_s: float = 120.0) -> list[ModelFigures]:
    """The figures of everything on the evaluation topic now (committed records)."""
    from d3stream.jobs.compare import TopicRange, read_topic
    from d3stream.kafka.connection import client_options

    options = client_options(settings.connection, "consumer", client_id=settings.connection.client_id)
    servers = options.pop("bootstrap_servers")
    records = asyncio.run(read_topic(servers, TopicRange(settings.evaluation.evaluation_topic), timeout_s=timeout_s,
                                     security=options, settings=settings))
    return figures(records)
