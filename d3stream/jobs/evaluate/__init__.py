"""``d3stream evaluate``: live evaluation on the one consume loop, and its figures read back.

    d3stream evaluate                      # the worker: join labels with answers, publish evaluations, metrics
    d3stream evaluate --report [--json]    # accuracy, Brier, log loss, ECE and the estimates per model

The worker (worker.py) joins the label topic with the answer topic and the shadow topic, per partition and
exactly once, publishes one evaluation record per joined request and model
(``d3stream_client.contract.Evaluation``), and exports the quality and drift series (``ops/quality.py``) on
``/metrics``. Its parts, each in a module of this folder: the topics it checks or makes (topics.py), the
handler that joins records (joining.py) in each unit's join state (join_state.py) kept in a local file
(state_store.py) backed by a changelog topic (changelog.py), the drift and estimate windows (drift.py,
estimation.py), and the report (report.py).
"""

from d3stream.jobs.evaluate.report import (
           FiguresJson,
           ModelFigures,
           figures,
           figures_json,
           read_figures,
           render,
)
from d3stream.jobs.evaluate.topics import EvaluateSetupError, EvaluateTopics, prepare_topics
from d3stream.jobs.evaluate.worker import Evaluator, load_drift, make_evaluator, run_worker

__all__ = ["EvaluateSetupError", "EvaluateTopics", "Evaluator", "FiguresJson", "ModelFigures", "figures",
           "figures_json", "load_drift", "make_evaluator", "prepare_topics", "read_figures", "render", "run_worker"]
