"""``d3stream compare``: known differences give known figures, from files and the CLI (a topic range on the
broker: tests/integration/test_compare.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from d3stream.cli import build_parser
from d3stream.jobs.compare import (
    Report,
    TopicRange,
    compare,
    load_answers,
    load_labels,
    parse_source,
    records_to_answers,
    write_report,
)
from tests.support.compare_answers import (
    event,
    noul,
    write_jsonl,
)

approx = pytest.approx


def known_report(files: dict[str, Path], labels: bool = False) -> Report:
    return compare(load_answers(files["a"]), load_answers(files["b"]),
                   load_labels(files["labels"]) if labels else None)


def test_known_differences_give_known_figures(files: dict[str, Path]) -> None:
    report = known_report(files)
    overall = report.overall
    assert overall.joined == 6
    assert overall.agreement == approx(5 / 6)
    assert overall.mean_abs_dp == approx(1.8 / 16)
    assert overall.max_abs_dp == approx(0.3)
    assert overall.score_mae == approx(0.1)  # |1.4 - 1.5| and |0.6 - 0.7|
    # confidence B - A where both have one: team -0.1, urgency -0.05, r2 team 0, r3 urgency +0.1
    assert overall.confidence_shift == approx(-0.05 / 4)

    choice_stats, noul_stats, score_stats = (report.by_type[k] for k in ("choice", "noul", "score"))
    assert (choice_stats.joined, choice_stats.agreement) == (2, 0.5)
    assert choice_stats.mean_abs_dp == approx(0.8 / 6)
    assert choice_stats.max_abs_dp == approx(0.3)
    assert choice_stats.score_mae is None
    assert (noul_stats.joined, noul_stats.agreement) == (2, 1.0)
    assert noul_stats.mean_abs_dp == approx(0.15)
    assert noul_stats.confidence_shift is None
    assert (score_stats.joined, score_stats.agreement) == (2, 1.0)
    assert score_stats.mean_abs_dp == approx(0.4 / 6)
    assert score_stats.score_mae == approx(0.1)
    assert score_stats.confidence_shift == approx(0.025)

    assert set(report.by_question) == {"team", "refund", "urgency"}
    assert report.by_question["team"].agreement == 0.5 and report.by_question["team"].types == "choice"
    assert report.by_question["refund"].max_abs_dp == approx(0.2)

    assert [d.request_id for d in report.top] == ["r2", "r1", "r3"]
    assert [d.max_abs_dp for d in report.top] == approx([0.3, 0.2, 0.1])
    worst = report.top[0].questions[0]
    assert (worst.question_id, worst.a.decision, worst.b.decision, worst.agree) == ("team", "billing", "tech", False)


def test_only_duplicates_and_errors(files: dict[str, Path]) -> None:
    a, b = load_answers(files["a"]), load_answers(files["b"])
    assert (a.duplicates, b.duplicates) == (0, 1)
    assert b["r1"]["answers"]["team"]["choice"] == "billing"  # the last record of r1 was kept
    report = compare(a, b)
    assert report.only_a == ("r4",)
    assert report.only_b == ("r5", "r6")
    assert (report.only_a_questions, report.only_b_questions) == (0, 1)  # r3.extra
    # r2.photo (an error slot in B) and the two questions B answered for r7, which A refused
    assert report.skipped_questions == 3
    assert (report.a.request_errors, report.b.request_errors) == (1, 1)
    assert report.a.request_error_codes == {"media_missing": 1}
    assert report.b.request_error_codes == {"invalid_request": 1}
    assert (report.a.question_errors, report.b.question_errors) == (0, 1)
    assert report.b.question_error_codes == {"max_length_exceeded": 1}
    assert (report.a.requests, report.b.requests, report.b.duplicates) == (5, 6, 1)


def test_labels_give_known_accuracy_brier_and_ece(files: dict[str, Path]) -> None:
    labels = known_report(files, labels=True).labels
    assert labels is not None
    assert (labels.n, labels.unmatched, labels.invalid) == (6, 1, 0)
    # A decides billing for r2.team (label tech): 5 of 6 right. Brier per question (two-class sum for noul):
    # .14 .08 .26 .86 .18 .38; B: .26 .32 .42 .26 .32 .24
    assert labels.a.accuracy == approx(5 / 6)
    assert labels.b.accuracy == 1.0
    assert labels.a.brier == approx(1.90 / 6)
    assert labels.b.brier == approx(1.82 / 6)
    # A's confidences .7 .8 .6 .6 .7 .5: bins 5 {.5 right}, 6 {.6 right, .6 wrong}, 7 {.7, .7 right}, 8 {.8 right}
    assert labels.a.ece == approx((0.5 + 2 * 0.1 + 2 * 0.3 + 0.2) / 6)
    # B's: .6 .6 .5 .6 .6 .6, all right
    assert labels.b.ece == approx((0.5 + 5 * 0.4) / 6)
    bins = {round(b.lower, 1): b for b in labels.a.bins if b.count}
    assert {k: (v.count, v.accuracy) for k, v in bins.items()} == {0.5: (1, 1.0), 0.6: (2, 0.5), 0.7: (2, 1.0),
                                                                    0.8: (1, 1.0)}
    noul_a, noul_b = labels.by_type["noul"]
    assert (noul_a.n, noul_a.brier, noul_b.brier) == (2, approx(0.13), approx(0.32))


def test_identical_sides_agree_completely(files: dict[str, Path]) -> None:
    a = load_answers(files["a"])
    report = compare(a, a)
    assert report.overall.agreement == 1.0
    assert report.overall.max_abs_dp == 0.0 and report.overall.score_mae == 0.0
    assert report.only_a == report.only_b == ()


def test_minimal_records_and_fallbacks() -> None:
    """Only id and answers are required; noul without probabilities and score without a score value work."""
    a = records_to_answers([
        {"id": "x", "answers": {"q": {"type": "noul", "noul": 0.25},
                                "s": {"type": "score", "probabilities": {"0": 0.5, "1": 0.5}},
                                "c": {"type": "choice", "probabilities": {"k": 0.4, "m": 0.6}}}},
        {"no id": True}, "not an object",
    ])
    b = records_to_answers([{"id": "x", "answers": {"q": {"type": "noul", "noul": 0.75},
                                                    "s": {"type": "score", "probabilities": {"0": 0.5, "1": 0.5}},
                                                    "c": {"type": "choice", "probabilities": {"k": 0.6, "m": 0.4}}}}])
    assert a.invalid == 2
    report = compare(a, b)
    assert report.overall.joined == 3
    assert report.by_type["noul"].agreement == 0.0  # 0.25 -> false, 0.75 -> true
    assert report.by_type["noul"].mean_abs_dp == approx(0.5)
    assert report.by_type["choice"].agreement == 0.0  # argmax without a choice field
    assert report.overall.score_mae == 0.0  # expected level 0.5 on both sides
    assert report.overall.confidence_shift is None


def test_parse_source() -> None:
    assert parse_source("kafka:d3.answers") == TopicRange("d3.answers")
    assert parse_source("kafka:t@5-10") == TopicRange("t", 5, 10)
    assert parse_source("kafka:t@5") == TopicRange("t", 5, None)
    assert parse_source("kafka:t@5-") == TopicRange("t", 5, None)
    assert parse_source("kafka:t@-7") == TopicRange("t", None, 7)
    assert parse_source("answers.jsonl") == Path("answers.jsonl")
    for bad in ("kafka:", "kafka:t@x", "kafka:t@9-3"):
        with pytest.raises(ValueError):
            parse_source(bad)


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def test_cli_json(files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    code = run_cli(["compare", str(files["a"]), str(files["b"]), "--labels", str(files["labels"]), "--out",
                    str(out), "--json"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert stdout.count("\n") == 1
    headline = json.loads(stdout)
    assert headline["joined"] == 6
    assert (headline["only_a"], headline["only_b"]) == (1, 2)
    assert headline["agreement"] == approx(5 / 6)
    assert headline["mean_abs_dp"] == approx(0.1125)
    assert headline["max_abs_dp"] == approx(0.3)
    assert headline["score_mae"] == approx(0.1)
    assert headline["accuracy_a"] == approx(5 / 6) and headline["accuracy_b"] == 1.0
    assert headline["brier_a"] == approx(1.9 / 6) and headline["brier_b"] == approx(1.82 / 6)
    assert headline["ece_a"] == approx(0.25) and headline["ece_b"] == approx(2.5 / 6)
    assert (headline["duplicates_b"], headline["errors_a"], headline["errors_b"]) == (1, 1, 1)


def test_cli_json_without_labels_or_scores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [event("r", {"q": noul(0.5, 0.5)})])
    assert run_cli(["compare", str(path), str(path), "--out", str(tmp_path / "r"), "--json"]) == 0
    headline = json.loads(capsys.readouterr().out)
    assert headline["score_mae"] is None and headline["agreement"] == 1.0
    assert "accuracy_a" not in headline


def test_cli_text_and_bad_input(files: dict[str, Path], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["compare", str(files["a"]), str(files["b"]), "--out", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert "agreement" in text and "83.3%" in text and "r2" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\nnot json\n', encoding="utf-8")
    assert run_cli(["compare", str(bad), str(files["b"]), "--out", str(tmp_path / "r2")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert run_cli(["compare", str(tmp_path / "missing.jsonl"), str(files["b"]), "--out", str(tmp_path)]) == 2


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
        assert image.size[0] > 100 and image.size[1] > 100


def test_report_files(files: dict[str, Path], tmp_path: Path) -> None:
    written = write_report(known_report(files, labels=True), tmp_path / "out")
    names = {p.name for p in written}
    assert {"report.md", "abs_dp_histogram.png", "reliability.png"} <= names
    for path in written:
        if path.suffix == ".png":
            assert_png(path)
    markdown = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    for heading in ("## Headline", "## Per question type", "## Per question id", "## Largest disagreements",
                    "## Against the labels", "![reliability diagram](reliability.png)"):
        assert heading in markdown
    assert "billing (0.600)" in markdown and "tech (0.600)" in markdown  # r2.team side by side

    unlabelled = write_report(known_report(files), tmp_path / "plain")
    assert "reliability.png" not in {p.name for p in unlabelled}
    assert_png(tmp_path / "plain" / "abs_dp_histogram.png")
    empty = write_report(compare({}, {}), tmp_path / "empty")  # nothing joined still draws and writes
    assert_png(tmp_path / "empty" / "abs_dp_histogram.png")
    assert empty[0].is_file()


def test_unreachable_broker_is_an_input_error(files: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["compare", "kafka:nowhere", str(files["b"]), "--bootstrap-servers", "127.0.0.1:1",
                    "--timeout", "5", "--out", str(tmp_path / "r")])
    assert code == 2
    assert "cannot connect to Kafka at 127.0.0.1:1" in capsys.readouterr().err  # checked before any source is read
