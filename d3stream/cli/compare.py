"""``d3stream compare A B``: read both sides (and labels), compare, write and print the report (jobs/compare)."""

from __future__ import annotations

import argparse
import json
import sys

from d3stream.cli.common import reach_kafka
from d3stream.cli.shape import Command

# The defaults shown by --help (the sources themselves, with msgspec and the Kafka reader, load when it runs).
DEFAULT_OUT = "compare-report"
DEFAULT_TOP = 10


def _run(args: argparse.Namespace) -> int:
    from d3stream.jobs.compare import (
        SourceError,
        compare,
        load_answers,
        load_labels,
        render_text,
        write_report,
    )
    from d3stream.kafka.connection import check_connection
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args)
        check_connection(settings.connection)
        if any(source.startswith("kafka:") for source in (args.a, args.b, args.labels or "")):
            reach_kafka(settings)  # one line naming the setting, before aiokafka's own about the refusal
        side_a = load_answers(args.a, settings=settings, timeout_s=args.timeout)
        side_b = load_answers(args.b, settings=settings, timeout_s=args.timeout)
        labels = load_labels(args.labels, settings=settings, timeout_s=args.timeout) if args.labels else None
    except (OSError, ValueError, SourceError) as exc:
        print(f"d3stream compare: {exc}", file=sys.stderr)
        return 2
    report = compare(side_a, side_b, labels, top=args.top)
    written = write_report(report, args.out)
    for side in (side_a, side_b):
        if side.invalid:
            print(f"d3stream compare: {side.source}: {side.invalid} records without an id were left out",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(report.headline()))
    else:
        print(render_text(report))
        print(f"\nreport: {written[0]}")
    return 0


DESCRIPTION = ("Join two sets of answer events by request and question id and report agreement, |Δp|, "
        "score MAE and confidence shift; with --labels also accuracy, Brier score, ECE and log loss of each side "
        "(the figures d3stream evaluate keeps live, from the same implementation). "
        "A source is a JSON-lines file of answer events or kafka:TOPIC[@START-END] (offsets "
        "START <= offset < END of every partition, committed records only, up to the end offsets at the "
        "time of the call).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="answers: JSON-lines file or kafka:TOPIC[@START-END]")
    parser.add_argument("b", metavar="B", help="answers to compare with A, same forms")
    parser.add_argument("--labels", metavar="L",
                        help='labels: label events {"id", "labels": {question: answer}} (a JSON-lines file or '
                        'kafka:TOPIC[@START-END]), or JSON lines {"id", "question", "answer"}; the first label '
                        'of a question counts')
    parser.add_argument("--out", default=DEFAULT_OUT, help="report folder (report.md and PNG plots)")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON object")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP, help="requests listed as largest disagreements")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to read one Kafka topic range")
    from d3stream.settings import CONNECTION_FIELDS
    from d3stream.settings import add_arguments as add_settings

    add_settings(parser, only=CONNECTION_FIELDS)  # for kafka: sources


COMMAND = Command("compare", "compare two sets of answers (files or Kafka topic ranges), optionally against labels",
                  add_arguments, _run, description=DESCRIPTION)
