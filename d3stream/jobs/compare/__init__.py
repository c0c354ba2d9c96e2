"""``d3stream compare A B``: how far apart two sets of answers are, and (with labels) which one is right.

A and B are answer events -- two model versions, a replay against the live topic, a GPU run against a
CPU run -- read from JSON-lines files or from Kafka topic ranges (``kafka:TOPIC`` or
``kafka:TOPIC@START-END``). They are joined by request id and question id and compared on:

* agreement of the decisions: the choice key for ``choice``, ``p >= 0.5`` for ``noul``, the most
  probable level (argmax) for ``score``;
* ``|Δp|``, the absolute difference of the probability of each option, its mean and maximum;
* the score MAE ``|score_a - score_b|`` and the confidence shift ``mean(conf_b - conf_a)``;

overall, per question type and per question id, with the requests that disagree most side by side.
With labels (label events, or ``{"id", "question", "answer"}`` lines) each side also gets accuracy, Brier
score, log loss and expected calibration error (ECE), and what its answers expected of themselves.

Three parts, each a module: ``sources`` (files and Kafka ranges in: ``load_answers``, ``load_labels``,
``read_topic``), ``report`` (``compare``: the figures, a ``Report``) and ``render`` (``write_report``:
``report.md`` and PNG plots; ``render_text``); the sub-command is ``d3stream/cli/compare.py``. The other jobs, the demo and the
benchmarks read Kafka ranges and answer files through the names below.
"""

from d3stream.jobs.compare.render import render_markdown, render_text, write_report
from d3stream.jobs.compare.report import LabelReport, Report, SideSummary, compare, summarise
from d3stream.jobs.compare.sources import (
    DEFAULT_OUT,
    DEFAULT_TOP,
    AnswerSet,
    Labels,
    SourceError,
    TopicRange,
    default_bootstrap_servers,
    label_events,
    labels_of,
    load_answers,
    load_labels,
    parse_source,
    read_jsonl,
    read_range,
    read_topic,
    records_to_answers,
)

__all__ = [
    "DEFAULT_OUT", "DEFAULT_TOP", "AnswerSet", "LabelReport", "Labels", "Report", "SideSummary", "SourceError",
    "TopicRange", "compare", "default_bootstrap_servers", "label_events", "labels_of", "load_answers",
    "load_labels", "parse_source", "read_jsonl", "read_range", "read_topic", "records_to_answers",
    "render_markdown", "render_text", "summarise", "write_report",
]
