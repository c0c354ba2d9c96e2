"""Structured logs: JSON lines for machines, readable lines on a terminal; one call configures both.

Every line goes through one handler on the standard library's root logger, formatted by structlog's
``ProcessorFormatter``: d3stream's own structlog events and the records of every library (aiokafka,
botocore, transformers, Python ``warnings``) come out in the same shape, so with ``--log-format json`` a
log pipeline can parse every line. The libraries' warnings and errors are shown at ``info`` (a broker
refusing a request, a deprecated call in a checkpoint's code are worth seeing); their chatty info and debug
lines only at ``debug``.

Two kinds of library records are known not to mean what their level says, and are logged lower
(``_Levels``) so that a run that works reads clean:

* aiokafka's reports of a group coordinator that is not there yet (a broker that has just started, a
  coordinator that moved), and of a produce it retries (``NotEnoughReplicas`` right after a topic is
  created, a leader that moved), which it retries by itself: ``info`` while the condition is young; one that
  lasts longer than ``TRANSIENT_GRACE_S`` (a broker whose offsets topic cannot be created, a partition whose
  replicas stay out of sync) is a real problem and is logged at its own level again.
* transformers' warnings that a Gated DeltaNet op falls back to its reference PyTorch code (the fast
  kernels are CUDA-only): ``debug``. Commands say it once, in plain words, from what the model really runs
  (:func:`kernel_notice`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TextIO

import structlog
from structlog.typing import Processor

# The handler this module installs on the root logger (found again, and replaced, by a second call).
HANDLER_NAME = "d3stream"

# How long a known transient condition may go on (records no further apart than this) before it is shown at
# its own level: a coordinator election on a starting broker takes seconds, not half a minute.
TRANSIENT_GRACE_S = 30.0

# aiokafka records (logger, message template) for conditions it retries by itself while a broker's group
# coordinator starts or moves. Matched on the template, so a reworded message in a later aiokafka is shown
# at its own level again rather than hidden.
_COORDINATOR_STARTING = frozenset({
    ("aiokafka.consumer.group_coordinator", "Group Coordinator Request failed: %s"),  # only retriable errors
    ("aiokafka.consumer.group_coordinator", "Marking the coordinator dead (node %s)for group %s."),
    ("aiokafka.consumer.group_coordinator",
     "Heartbeat failed for group %s: coordinator (node %s) is either not started or not valid"),
    ("aiokafka.cluster", "Topic %s is not available during auto-create initialization"),
    # Only the errors it may retry reach this template (the others fail the batch).
    ("aiokafka.producer.sender", "Got error produce response on topic-partition %s, retrying. Error: %s"),
})

# transformers.integrations.hub_kernels: "`chunk_gated_delta_rule` is falling back to its reference PyTorch
# implementation because `flash-linear-attention` is not installed. This is correct but much slower; ..."
_KERNEL_FALLBACK = ("transformers.integrations.hub_kernels", "is falling back to its reference PyTorch implementation")


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to the ``sys.stderr`` of the moment, not the one it was created with
    (a test that captured stderr closes its capture file afterwards)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # logging.StreamHandler assigns it in __init__
        pass


def configure_logging(log_format: str = "auto", level: str = "info") -> Callable[[], None]:
    """Route structlog and the standard library's loggers (aiokafka's, botocore's, transformers', warnings)
    through one formatter to stderr: JSON lines, or readable lines (``console``, or ``auto`` on a terminal).
    Returns a function that puts the previous set-up back (for a caller inside a longer-lived process)."""
    restore = _snapshot()
    numeric = getattr(logging, level.upper(), logging.INFO)
    console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    # The console renderer draws exceptions itself (a plain traceback: a rich one would print local variables,
    # credentials among them); JSON gets the traceback as a string field.
    rendering: list[Processor] = (
        [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)] if console
        else [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *rendering],
    )
    handler = _StderrHandler()
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(formatter)
    # On the handler, not a logger: it sees every library's records, and tqdm's logging_redirect_tqdm
    # copies a handler's filters to the handler it puts in its place while a progress bar is drawn.
    handler.addFilter(_Levels(numeric))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME or isinstance(h, logging.StreamHandler)
                and getattr(h, "stream", None) in (sys.stderr, sys.stdout)]:
        root.removeHandler(old)
    root.addHandler(handler)
    # Libraries log through the root logger's level: their warnings show at info, their chatter at debug.
    root.setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    logging.getLogger("d3stream").setLevel(numeric)
    logging.getLogger("aiokafka").setLevel(logging.NOTSET)  # earlier versions of this module silenced it
    logging.captureWarnings(True)  # warnings.warn(...) from any library: a log record of "py.warnings"
    _route_transformers(numeric, quiet_progress=not console)
    if not console:
        sys.excepthook = _log_uncaught
    return restore


class _Levels(logging.Filter):
    """Logs the known transient and noisy library records at the level they deserve (module docstring), then
    lets through what is at or above the configured level. ``clock`` is for tests."""

    def __init__(self, threshold: int, *, grace_s: float = TRANSIENT_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.threshold = threshold
        self.grace_s = grace_s
        self.clock = clock
        # Per condition: when its current run of records began, and when the last one came.
        self.runs: dict[tuple[str, str], tuple[float, float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and record.name == _KERNEL_FALLBACK[0] \
                and _KERNEL_FALLBACK[1] in str(record.msg):
            _relevel(record, logging.DEBUG)
        elif record.levelno > logging.INFO and self._transient(record):
            _relevel(record, logging.INFO)
        return record.levelno >= self.threshold

    def _transient(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        if key not in _COORDINATOR_STARTING:
            return False
        if key[1].startswith("Group Coordinator Request failed"):
            # aiokafka retries a retriable error and raises any other: only the retried ones are transient.
            error = record.args[0] if isinstance(record.args, tuple) and record.args else None
            if not getattr(error, "retriable", False):
                return False
        now = self.clock()
        began, last = self.runs.get(key, (now, now))
        if now - last > self.grace_s:
            began = now  # a new run: the condition had cleared up in between
        self.runs[key] = (began, now)
        return now - began <= self.grace_s


def _relevel(record: logging.LogRecord, level: int) -> None:
    record.levelno = level
    record.levelname = logging.getLevelName(level)


def kernel_notice(kernels: Mapping[str, str], device: str) -> str | None:
    """One plain sentence when a model runs its Gated DeltaNet layers on transformers' reference PyTorch code
    (``kernels``: ``D3.kernel_record()``, ``path`` reference or mixed), else None: said once by the commands
    instead of transformers' warnings, which name packages that cannot be installed on a CPU anyway."""
    path = kernels.get("path")
    if path not in ("reference", "mixed"):
        return None
    which = "reference" if path == "reference" else "partly reference"
    # One short line (it should fit a terminal): where the model runs, what that means, where to read on.
    if device == "cpu":
        return (f"The model runs on the CPU with transformers' {which} kernels (correct, slower); "
                "the fast ones need a CUDA GPU: docs/GPU.md")
    return (f"The model runs on {device} with transformers' {which} kernels (correct, slower); "
            "docs/GPU.md says how to install the fast ones")


def _snapshot() -> Callable[[], None]:
    """What ``configure_logging`` changes, to be put back."""
    root = logging.getLogger()
    structlog_config = structlog.get_config()
    handlers, root_level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in ("d3stream", "aiokafka")}
    hook = sys.excepthook

    def restore() -> None:
        structlog.configure(**structlog_config)
        root.handlers[:] = handlers
        root.setLevel(root_level)
        for name, value in levels.items():
            logging.getLogger(name).setLevel(value)
        logging.captureWarnings(False)
        sys.excepthook = hook
        from transformers.utils import logging as hf_logging

        hf_logging.disable_propagation()
        hf_logging.enable_default_handler()

    return restore


def _route_transformers(numeric: int, *, quiet_progress: bool) -> None:
    """transformers prints through a handler of its own, not propagating to the root logger: hand its records
    to ours instead, at the same threshold as other libraries. Its progress bars (tqdm, on stderr) are not
    log lines: off outside a terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.set_verbosity(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    if quiet_progress:
        hf_logging.disable_progress_bar()


def _log_uncaught(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    """An exception nobody caught ends the process as one JSON line too (not a bare traceback)."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("d3stream").critical("uncaught exception", exc_info=(kind, value, traceback))
