"""A ``Report`` as people read it: Markdown (``report.md``), PNG plots, and the terminal's short text."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from d3stream.core.agreement import (
    ECE_BINS,
    GroupStats,
    Slot,
)
from d3stream.runtime.kinds import QUESTION_TYPE_NAMES

if TYPE_CHECKING:
    from matplotlib.figure import Figure


from d3stream.jobs.compare.report import LabelReport, Report

# -- output ----------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.4f}"


def _md(text: object) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in rows]
    return lines


def _stats_row(name: str, stats: GroupStats) -> list[str]:
    return [name, str(stats.joined), _pct(stats.agreement), _fmt(stats.mean_abs_dp), _fmt(stats.max_abs_dp),
            _fmt(stats.score_mae), _signed(stats.confidence_shift)]


_STATS_HEADER = ["", "joined", "agreement", "mean abs Δp", "max abs Δp", "score MAE", "confidence shift (B − A)"]


def _probabilities_text(slot: Slot) -> str:
    return ", ".join(f"{k} {p:.3f}" for k, p in slot.probabilities.items())


def _decision_text(slot: Slot) -> str:
    text = f"{slot.decision} ({slot.decision_probability:.3f})"
    if slot.type == "score" and slot.score is not None:
        text += f", score {slot.score:.3f}"
    return text


def _codes(codes: Mapping[str, int]) -> str:
    return ", ".join(f"{code} {count}" for code, count in codes.items()) or "–"


def _headline_section(report: Report) -> list[str]:
    headline = report.headline()
    return ["## Headline", "", *_table(["figure", "value"], [
        ["joined questions", headline["joined"]],
        ["agreement (choice, noul, score decisions)", _pct(headline["agreement"])],
        ["mean abs Δp (per option)", _fmt(headline["mean_abs_dp"])],
        ["max abs Δp", _fmt(headline["max_abs_dp"])],
        ["score MAE", _fmt(headline["score_mae"])],
        ["confidence shift (B − A)", _signed(headline["confidence_shift"])],
        ["requests only in A / only in B", f"{len(report.only_a)} / {len(report.only_b)}"],
        ["questions only in A / only in B", f"{report.only_a_questions} / {report.only_b_questions}"],
        ["questions not compared: errors / unreadable or type differs",
         f"{report.skipped_questions} / {report.unreadable_questions}"],
    ])]


def _sides_section(report: Report) -> list[str]:
    a, b = report.a, report.b
    lines = ["", "## Sides", ""]
    lines += _table(["", "A", "B"], [
        ["requests", a.requests, b.requests],
        ["duplicate records (last kept)", a.duplicates, b.duplicates],
        ["invalid records (no id)", a.invalid_records, b.invalid_records],
        ["request-level errors", a.request_errors, b.request_errors],
        ["request errors by code", _codes(a.request_error_codes), _codes(b.request_error_codes)],
        ["questions", a.questions, b.questions],
        ["question errors", a.question_errors, b.question_errors],
        ["question errors by code", _codes(a.question_error_codes), _codes(b.question_error_codes)],
    ])
    if report.only_a or report.only_b:
        lines += [""]
        for side, ids in (("A", report.only_a), ("B", report.only_b)):
            if ids:
                shown = ", ".join(f"`{_md(i)}`" for i in ids[:20]) + (" ..." if len(ids) > 20 else "")
                lines.append(f"Only in {side} ({len(ids)}): {shown}  ")
    return lines


def _groups_section(report: Report, plots: Sequence[str]) -> list[str]:
    """Per question type and per question id, with their plots."""
    lines: list[str] = []
    for plot in plots:
        if plot == "abs_dp_histogram.png":
            lines += ["", f"![abs Δp histogram]({plot})"]
    lines += ["", "## Per question type", ""]
    lines += _table(["type"] + _STATS_HEADER[1:],
                    [_stats_row(kind, stats) for kind, stats in report.by_type.items()] + [
                        _stats_row("all", report.overall)])
    lines += ["", "## Per question id", ""]
    lines += _table(["question", "type"] + _STATS_HEADER[1:],
                    [[qid, stats.types] + _stats_row(qid, stats)[1:] for qid, stats in report.by_question.items()])
    if "agreement_by_question.png" in plots:
        lines += ["", "![agreement by question](agreement_by_question.png)"]
    return lines


def _disagreements_section(report: Report) -> list[str]:
    lines = ["", f"## Largest disagreements (top {len(report.top)} requests by max abs Δp)", ""]
    if not report.top:
        lines.append("No joined questions.")
    for item in report.top:
        lines += [f"### `{_md(item.request_id)}`: max abs Δp {item.max_abs_dp:.4f}", ""]
        lines += _table(
            ["question", "type", "A decision", "B decision", "agree", "max abs Δp", "A probabilities",
             "B probabilities"],
            [[q.question_id, q.type, _decision_text(q.a), _decision_text(q.b), "yes" if q.agree else "**no**",
              f"{q.max_abs_dp:.4f}", _probabilities_text(q.a), _probabilities_text(q.b)] for q in item.questions],
        )
        lines.append("")
    return lines


def _labels_section(labels: LabelReport, plots: Sequence[str]) -> list[str]:
    lines = ["## Against the labels", "",
             f"{labels.n} labelled joined questions ({labels.unmatched} labels match no joined question, "
             f"{labels.invalid} name no option of their question).", ""]
    rows: list[list[object]] = [[
        "all", labels.n, _fmt(labels.a.accuracy), _fmt(labels.b.accuracy), _fmt(labels.a.brier),
        _fmt(labels.b.brier), _fmt(labels.a.ece), _fmt(labels.b.ece), _fmt(labels.a.log_loss),
        _fmt(labels.b.log_loss)]]
    rows += [[kind, sa.n, _fmt(sa.accuracy), _fmt(sb.accuracy), _fmt(sa.brier), _fmt(sb.brier), _fmt(sa.ece),
              _fmt(sb.ece), _fmt(sa.log_loss), _fmt(sb.log_loss)] for kind, (sa, sb) in labels.by_type.items()]
    lines += _table(["type", "n", "accuracy A", "accuracy B", "Brier A", "Brier B", "ECE A", "ECE B", "log loss A",
                     "log loss B"], rows)
    lines += ["", "Brier score: the sum over the options of (p − onehot)², averaged over questions (0 best, 2 "
              "worst); for noul the two-class sum over false and true, i.e. twice the binary Brier score. "
              f"ECE: {ECE_BINS} equal-width bins on the probability of the decided option (the max "
              "probability), sum of bin weight × abs(accuracy − mean confidence). Log loss: −ln p(label), "
              "p clipped at 1e-15.", ""]
    if "reliability.png" in plots:
        lines += ["![reliability diagram](reliability.png)", ""]
    return lines


def render_markdown(report: Report, plots: Sequence[str] = ()) -> str:
    """``report.md``: headline, per type, per question id, the top disagreements side by side, labels."""
    lines = ["# d3stream compare", "", f"- **A**: `{report.a.source}`", f"- **B**: `{report.b.source}`", ""]
    lines += _headline_section(report)
    lines += _sides_section(report)
    lines += _groups_section(report, plots)
    lines += _disagreements_section(report)
    if report.labels is not None:
        lines += _labels_section(report.labels, plots)
    return "\n".join(lines).rstrip() + "\n"


# One colour per question type in registry order (a new type fails here until it has one), one per side.
_TYPE_COLORS = dict(zip(QUESTION_TYPE_NAMES, ("#4C72B0", "#DD8452", "#55A868"), strict=True))
_SIDE_COLORS = {"A": "#4C72B0", "B": "#C44E52"}


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_abs_dp_histogram(report: Report, path: Path) -> Path:
    """Histogram of ``|Δp|`` per option, stacked by question type, with the mean and max marked."""
    figure = _figure(8, 4.8)
    axes = figure.add_subplot()
    groups = {kind: [d for q in report.joined if q.type == kind for d in q.deltas.values()] for kind in QUESTION_TYPE_NAMES}
    groups = {kind: values for kind, values in groups.items() if values}
    overall = report.overall
    if groups:
        top = max(overall.max_abs_dp or 0.0, 0.01) * 1.02
        edges = [top * i / 30 for i in range(31)]
        axes.hist(list(groups.values()), bins=edges, stacked=True, color=[_TYPE_COLORS[k] for k in groups],
                  label=[f"{k} ({len(v)} options)" for k, v in groups.items()], edgecolor="white", linewidth=0.5)
        axes.axvline(overall.mean_abs_dp or 0.0, color="black", linestyle="--", linewidth=1,
                     label=f"mean {overall.mean_abs_dp:.4f}")
        axes.axvline(overall.max_abs_dp or 0.0, color="black", linestyle=":", linewidth=1,
                     label=f"max {overall.max_abs_dp:.4f}")
        axes.set_xlim(0, top)
        axes.legend(title="question type", frameon=False)
    else:
        axes.text(0.5, 0.5, "no joined questions", ha="center", va="center", transform=axes.transAxes)
    axes.set_title(f"How far apart A and B are: |Δp| per option over {overall.joined} joined questions "
                   f"(agreement {_pct(overall.agreement)})", fontsize=10)
    axes.set_xlabel("|p_A − p_B| of an option")
    axes.set_ylabel("options")
    axes.grid(axis="y", alpha=0.3)
    figure.savefig(path)
    return path


def plot_agreement_by_question(report: Report, path: Path, limit: int = 30) -> Path:
    """Decision agreement per question id (the least agreeing ``limit``), with the mean ``|Δp|`` written on."""
    items = sorted(report.by_question.items(), key=lambda kv: ((kv[1].agreement or 0.0), kv[0]))[:limit]
    figure = _figure(8, max(2.5, 0.35 * len(items) + 1.5))
    axes = figure.add_subplot()
    names = [f"{qid} ({stats.types})" for qid, stats in items]
    values = [100 * (stats.agreement or 0.0) for _, stats in items]
    colors = [_TYPE_COLORS.get(stats.types, "#8172B3") for _, stats in items]
    bars = axes.barh(names, values, color=colors)
    for bar, (_, stats) in zip(bars, items, strict=True):
        axes.text(min(bar.get_width(), 100) + 1, bar.get_y() + bar.get_height() / 2,
                  f"{stats.joined} q, mean |Δp| {_fmt(stats.mean_abs_dp, 3)}", va="center", fontsize=8)
    axes.invert_yaxis()
    axes.set_xlim(0, 135)
    axes.set_xticks([0, 20, 40, 60, 80, 100])
    axes.set_xlabel("decisions that agree (%)")
    axes.set_title("Agreement of A and B per question id (least agreeing first)", fontsize=10)
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(path)
    return path


def plot_reliability(report: Report, path: Path) -> Path:
    """Reliability diagram of both sides: accuracy against confidence per bin, and the bin counts."""
    labels = report.labels
    assert labels is not None
    figure = _figure(7, 7.5)
    grid = figure.add_gridspec(2, 1, height_ratios=(3, 1))
    top = figure.add_subplot(grid[0])
    bottom = figure.add_subplot(grid[1], sharex=top)
    top.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly calibrated")
    width = 1 / ECE_BINS
    for offset, (side, stats, source) in zip(
        (-width / 5, width / 5), (("A", labels.a, report.a.source), ("B", labels.b, report.b.source)), strict=True
    ):
        filled = [(b.mean_confidence, b.accuracy) for b in stats.bins  # the bins with questions
                  if b.mean_confidence is not None and b.accuracy is not None]
        top.plot([confidence for confidence, _ in filled], [accuracy for _, accuracy in filled], marker="o",
                 color=_SIDE_COLORS[side], label=f"{side}: {source} (ECE {_fmt(stats.ece, 3)}, accuracy "
                 f"{_pct(stats.accuracy)})")
        bottom.bar([(b.lower + b.upper) / 2 + offset for b in stats.bins], [b.count for b in stats.bins],
                   width=width * 0.4, color=_SIDE_COLORS[side], label=side)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.02)
    top.set_ylabel("accuracy in the bin")
    top.set_title(f"Reliability diagram: {labels.n} labelled questions, {ECE_BINS} bins", fontsize=10)
    top.legend(loc="upper left", fontsize=8, frameon=False)
    top.grid(alpha=0.3)
    bottom.set_xlabel("confidence: probability of the decided option (max probability)")
    bottom.set_ylabel("questions")
    bottom.legend(fontsize=8, frameon=False)
    bottom.grid(axis="y", alpha=0.3)
    figure.savefig(path)
    return path


def write_report(report: Report, out: str | Path) -> list[Path]:
    """Write ``report.md`` and the PNG plots into ``out`` (created); return the paths written."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    plots = [plot_abs_dp_histogram(report, folder / "abs_dp_histogram.png")]
    if report.by_question:
        plots.append(plot_agreement_by_question(report, folder / "agreement_by_question.png"))
    if report.labels is not None:
        plots.append(plot_reliability(report, folder / "reliability.png"))
    markdown = folder / "report.md"
    markdown.write_text(render_markdown(report, [p.name for p in plots]), encoding="utf-8")
    return [markdown, *plots]


def render_text(report: Report) -> str:
    """The terminal summary: sides, per-type table, labels."""
    a, b = report.a, report.b
    lines = []
    for side, summary in (("A", a), ("B", b)):
        lines.append(f"{side}: {summary.source}: {summary.requests} requests, {summary.duplicates} duplicates, "
                     f"{summary.request_errors} request errors, {summary.question_errors} question errors")
    lines.append(f"requests only in A {len(report.only_a)}, only in B {len(report.only_b)}; questions only in A "
                 f"{report.only_a_questions}, only in B {report.only_b_questions}, not compared "
                 f"{report.skipped_questions + report.unreadable_questions}")
    lines.append("")
    header = f"{'type':<10}{'joined':>8}{'agreement':>11}{'mean|Δp|':>10}{'max|Δp|':>10}{'scoreMAE':>10}" \
             f"{'conf B−A':>10}"
    lines.append(header)
    for name, stats in [*report.by_type.items(), ("all", report.overall)]:
        lines.append(f"{name:<10}{stats.joined:>8}{_pct(stats.agreement):>11}{_fmt(stats.mean_abs_dp):>10}"
                     f"{_fmt(stats.max_abs_dp):>10}{_fmt(stats.score_mae):>10}{_signed(stats.confidence_shift):>10}")
    if report.top:
        lines.append("")
        lines.append("largest disagreements: " + ", ".join(
            f"{d.request_id} ({d.max_abs_dp:.3f})" for d in report.top[:5]))
    if report.labels is not None:
        labels = report.labels
        lines += ["", f"{'labels (n=' + str(labels.n) + ')':<16}{'A':>10}{'B':>10}"]
        for name, va, vb in (("accuracy", labels.a.accuracy, labels.b.accuracy),
                             ("Brier", labels.a.brier, labels.b.brier), ("ECE", labels.a.ece, labels.b.ece),
                             ("log loss", labels.a.log_loss, labels.b.log_loss)):
            lines.append(f"{name:<16}{_fmt(va):>10}{_fmt(vb):>10}")
    return "\n".join(lines)


