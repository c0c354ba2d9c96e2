"""``d3stream evaluate``: the live evaluator's worker, or with ``--report`` its figures (jobs/evaluate/)."""

from __future__ import annotations

import argparse
import asyncio
import json

from d3stream.cli.common import WORKER_FATAL_EXIT, Refused, reach_kafka
from d3stream.cli.shape import Command

# The settings ``d3stream evaluate`` reads (the connection's, its topics', its own, the consume loop's it runs on
# and the endpoint's).
EVALUATE_FIELDS = (
    "answer_topic", "shadow_topic", "label_topic", "evaluation_topic", "label_dead_letter_topic", "evaluate_group_id",
    "evaluate_state_topic", "evaluate_state_dir", "evaluate_window_s", "evaluate_max_state_bytes", "evaluate_drift_window",
    "evaluate_drift_reference", "transactional_id_prefix", "create_topics", "topic_partitions", "auto_offset_reset",
    "session_timeout_ms", "rebalance_timeout_ms", "commit_interval_ms", "shutdown_timeout_s", "stall_unready_s",
    "metrics_host", "metrics_port", "log_format", "log_level",
)


# Its own defaults: the metrics endpoint one port above a worker's (9464), so the two run side by side on one
# machine as docs/EVALUATION.md runs them (a deployment sets D3STREAM_METRICS_PORT for each pod anyway).
EVALUATE_DEFAULTS: dict[str, object] = {"metrics_port": 9465}


def _run(args: argparse.Namespace) -> int:
    from d3stream.jobs.compare import SourceError
    from d3stream.jobs.evaluate import EvaluateSetupError, figures_json, read_figures, render, run_worker
    from d3stream.kafka.connection import check_connection, connecting
    from d3stream.ops.logs import configure_logging
    from d3stream.settings import load_settings

    try:
        settings = load_settings(args, defaults=EVALUATE_DEFAULTS)
        check_connection(settings.connection)
        if args.report:
            reach_kafka(settings)
            models = read_figures(settings, args.timeout)
            print(json.dumps(figures_json(models)) if args.json else render(models))
            return 0
    except (ValueError, OSError, SourceError) as exc:  # OSError: a file setting that cannot be read
        raise Refused(str(exc)) from exc
    configure_logging(settings.observability.log_format, settings.observability.log_level)
    from d3stream.ops.metrics import serve_metrics
    from d3stream.ops.quality import QualityMetrics

    reach_kafka(settings)  # before the endpoint: a worker that cannot start should not look alive meanwhile
    metrics = QualityMetrics()
    server = serve_metrics(metrics, settings.observability)
    from d3stream.kafka.limits import WorkerFatal

    try:
        asyncio.run(connecting(settings.connection, run_worker(settings, metrics=metrics)))
    except (EvaluateSetupError, ValueError, OSError) as exc:  # OSError: evaluate_state_dir, the drift reference
        raise Refused(str(exc)) from exc
    except WorkerFatal as exc:  # e.g. no permission on the evaluation topic: a restart would not help by itself
        import structlog

        structlog.get_logger("d3stream.evaluate").error("d3stream evaluate stopped", error=str(exc),
                                                        exit_status=WORKER_FATAL_EXIT)
        return WORKER_FATAL_EXIT
    finally:
        if server is not None:
            server.stop()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from d3stream.settings import CONNECTION_FIELDS
    from d3stream.settings import add_arguments as add_settings

    parser.add_argument("--report", action="store_true",
                        help="print accuracy, Brier, log loss and ECE per model and question from the evaluation "
                        "topic (the figures d3stream compare --labels computes offline), then exit")
    parser.add_argument("--json", action="store_true", help="with --report: one JSON object")
    parser.add_argument("--timeout", type=float, default=120.0, help="with --report: seconds to read the topic")
    add_settings(parser, only=CONNECTION_FIELDS + EVALUATE_FIELDS, defaults=EVALUATE_DEFAULTS)


COMMAND = Command("evaluate", "live evaluation: join labels with answers (and shadow answers) per model, exactly "
                  "once; quality, estimates and drift metrics; --report prints the figures", add_arguments, _run,
                  description="A long-running worker in its own consumer group (evaluate_group_id). It reads the answer "
        "topic, the shadow topic (shadow_topic, or the answer topic's name + .shadow when it exists) and "
        "label_topic, read_committed, and joins them by request id: a label may come before or after its "
        "answer, twice, or never; each question is joined once per model. Each joined request and model "
        "becomes an evaluation record on evaluation_topic (the label, the predicted option, p(label), correct "
        "or not, the Brier and log-loss terms), and /metrics exports counts and sums from which accuracy, "
        "Brier, log loss and ECE over any window follow, plus label lag, waiting and expired counts and "
        "answer drift (PSI). Waiting answers and labels live in the compacted evaluate_state_topic, written "
        "in the same transaction as the evaluations and offsets: a restart loses and doubles nothing. "
        "Malformed or misplaced labels go to label_dead_letter_topic. Several workers split the partitions; "
        "the label topic must have as many partitions as the answer topic.",)
