"""Structured logs: JSON lines for machines, readable lines on a terminal; one call configures both.

Every line goes through one handler on the standard library's root logger, formatted by structlog's
``ProcessorFormatter``: d3stream's own structlog events and the records of every library (aiokafka,
botocore, transformers, Python ``warnings``) come out in the same shape, so with ``--log-format json`` a
log pipeline can parse every line. The libraries' warnings and errors are shown at ``info`` (a broker
refusing a request, a coordinator moving, a deprecated call in a checkpoint's code are worth seeing); their
chatty info and debug lines only at ``debug``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import structlog

# The handler this module installs on the root logger (found again, and replaced, by a second call).
HANDLER_NAME = "d3stream"


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
    shared: list[Any] = [
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
    rendering: list[Any] = (
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


def _log_uncaught(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
    """An exception nobody caught ends the process as one JSON line too (not a bare traceback)."""
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("d3stream").critical("uncaught exception", exc_info=(kind, value, traceback))
