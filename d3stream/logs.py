"""Structured logs: JSON lines for machines, readable lines on a terminal; one call configures both."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str = "auto", level: str = "info") -> None:
    """Route structlog (and the standard library's loggers, e.g. aiokafka's) to stderr."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    if numeric > logging.DEBUG:
        # aiokafka logs expected start-up races (a topic or coordinator not there yet) as errors, and
        # transformers says once per process that it runs the PyTorch Gated DeltaNet kernels on a CPU.
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
