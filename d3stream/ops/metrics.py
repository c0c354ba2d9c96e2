"""Prometheus metrics and the health endpoints of a worker.

``Metrics`` owns its own ``CollectorRegistry`` (never the process-wide default, so tests and embedded
workers can hold several) and offers one small typed method per thing the service measures.
``MetricsServer`` serves it over HTTP from a daemon thread, beside the probes Kubernetes uses:

    GET /metrics   the Prometheus text exposition of the registry (also at ``/``)
    GET /healthz   200 while the process is alive and its HTTP thread answers (liveness)
    GET /readyz    200 when the readiness check returns True, else 503 (readiness)

Ready means: the model is loaded (and warmed up, when asked), the consumer has joined its group, no
partition's committed offset has stood still with work waiting for ``stall_unready_s``, and no background task
of the worker has died (``Metrics.watch``: such a task is logged with its traceback and named by ``/readyz``).
A worker that is loading, warming up, rebalancing out or shutting down answers 503 on ``/readyz`` but
200 on ``/healthz``, so Kubernetes waits for it instead of restarting it.

    metrics = Metrics(ready=lambda: service.ready)
    server = MetricsServer(metrics, host=address.metrics_host, port=address.metrics_port)
    server.start()           # port 0 picks a free port; server.port tells which
    ...
    server.stop()

Every metric is named ``d3stream_*`` and declared in ``series``, in groups that each bring the methods
feeding them: per-partition progress, the consumer group, in-flight work and quotas, forward passes, the
per-request series, Kafka delivery, inputs (media, prefix reuse), shadow evaluation, the model served. Their
HELP texts say what each one means for an operator. The methods are thread-safe: they may be called from the
event loop, the model thread or the S3 threads, except the per-request ones (``RequestSeries``), which are
fed on the event loop thread.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from collections.abc import Callable
from functools import partial
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

import structlog
from prometheus_client import CollectorRegistry, Gauge, make_wsgi_app

from d3stream.ops.loop_collectors import LoopCounter, LoopHistogram
from d3stream.ops.series import (
    ERROR_CODES,
    LATENCY_BUCKETS,
    MAX_TENANT_LABELS,
    OTHER_TENANT,
    PASS_SECONDS_BUCKETS,
    PREFIX,
    ROW_BUCKETS,
    STAGES,
    SWAP_OUTCOMES,
    TOKEN_BUCKETS,
    DeliverySeries,
    FlowSeries,
    GroupSeries,
    InputSeries,
    ModelSeries,
    PartitionSeries,
    PassSeries,
    RequestSeries,
    ShadowSeries,
)

# The names callers and tests have always imported from here, wherever they are defined now.
__all__ = [
    "ERROR_CODES", "LATENCY_BUCKETS", "MAX_TENANT_LABELS", "OTHER_TENANT", "PASS_SECONDS_BUCKETS", "PREFIX",
    "ROW_BUCKETS", "STAGES", "SWAP_OUTCOMES", "TOKEN_BUCKETS", "LoopCounter", "LoopHistogram", "Metrics",
    "MetricsServer", "serve_metrics",
]

log = structlog.get_logger(__name__)

# Dead background tasks /readyz names (the first ones); past these it counts the rest.
NAMED_DEAD_TASKS = 3


class Metrics(PartitionSeries, GroupSeries, FlowSeries, PassSeries, RequestSeries, DeliverySeries, InputSeries,
              ShadowSeries, ModelSeries):
    """The worker's metrics on a private registry, with one method per measurement the service makes.

    The families and their methods are declared by group in ``series`` (one base class each); this class puts
    them on one registry and adds readiness (``d3stream_ready`` and what ``/readyz`` answers), which a dead
    background task (``watch``) takes away."""

    def __init__(
        self, *, registry: CollectorRegistry | None = None, ready: Callable[[], bool] | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._ready_check: Callable[[], bool] = ready or (lambda: False)
        self._why_not: Callable[[], str | None] | None = None
        # Background tasks that died of an exception (``watch``): how many, and the first few ("name (Type: message)").
        self.tasks_died = 0
        self.dead_tasks: list[str] = []
        # Each group registers its families; the order of these calls is the order of the exposition.
        PartitionSeries.__init__(self, self.registry)
        GroupSeries.__init__(self, self.registry)
        FlowSeries.__init__(self, self.registry)
        PassSeries.__init__(self, self.registry)
        RequestSeries.__init__(self, self.registry)
        DeliverySeries.__init__(self, self.registry)
        InputSeries.__init__(self, self.registry)
        ShadowSeries.__init__(self, self.registry)
        ModelSeries.__init__(self, self.registry)
        self.ready_gauge = Gauge(
            f"{PREFIX}_ready",
            "1 when the worker is ready (model loaded and warmed up, consumer joined, no partition stalled, no "
            "background task dead), else 0; what /readyz answers.",
            registry=self.registry,
        )
        self.ready_gauge.set_function(lambda: 1.0 if self.is_ready() else 0.0)

    # ------------------------------------------------------------------------------- readiness

    def set_ready_check(self, check: Callable[[], bool], why_not: Callable[[], str | None] | None = None) -> None:
        """Replace the readiness check (e.g. once the Service object exists); ``why_not`` says what a not-ready
        ``/readyz`` answers beyond "not ready" (None: nothing more to say)."""
        self._ready_check = check
        self._why_not = why_not

    def why_not_ready(self) -> str | None:
        """What keeps the worker from being ready, when something more can be said than "not ready": the
        background tasks that died first (they never come back), then what the readiness check says."""
        died, named = self.tasks_died, "; ".join(self.dead_tasks)  # written on the event loop thread
        if died:
            more = died - len(self.dead_tasks)
            return f"background task died: {named}" + (f" (and {more} more)" if more > 0 else "")
        try:
            return self._why_not() if self._why_not is not None else None
        except Exception:  # noqa: BLE001 - a broken explanation must not break the probe thread
            return None

    def is_ready(self) -> bool:
        """What ``/readyz`` answers; a check that raises counts as not ready, and so does a dead background task."""
        if self.tasks_died:
            return False
        try:
            return bool(self._ready_check())
        except Exception:  # noqa: BLE001 - a broken check must not break the probe thread
            log.warning("readiness check failed", exc_info=True)
            return False

    # -------------------------------------------------------------------------- background tasks

    def watch(self, task: asyncio.Future[Any], name: str | Callable[[], str]) -> None:
        """Look after a background task of the worker (a fetch being answered, the periodic commit, a partition
        settling, the model source watch): should it die of an exception, the exception is logged with its
        traceback, and the worker is not ready from then on, ``/readyz`` naming the task (``name``: what it was
        doing). Left alone, asyncio would at most say "Task exception was never retrieved", whenever the task
        happened to be collected, and readiness would go on saying 200 over work that nobody does any more. A
        cancelled task did not die: cancelling is how the worker stops its tasks. A ``name`` that costs
        something to say (a fetch's partitions and offsets) is a callable, said only if the task dies."""
        task.add_done_callback(partial(self._task_ended, name))

    def _task_ended(self, said: str | Callable[[], str], task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here: asyncio has nothing more to say about it
        if exc is None:
            return
        name = said if isinstance(said, str) else said()
        cause = f"{type(exc).__name__}: {exc}"[:300]
        log.error("background task died; the worker is not ready", task=name, error=cause, exc_info=exc)
        if len(self.dead_tasks) < NAMED_DEAD_TASKS:
            self.dead_tasks.append(f"{name} ({cause})")
        self.tasks_died += 1


# ------------------------------------------------------------------------------------ HTTP server


class Exposed(Protocol):
    """What the endpoint serves: a registry and a readiness check (``Metrics``, or the evaluator's
    ``QualityMetrics``)."""

    registry: CollectorRegistry

    def is_ready(self) -> bool: ...


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape never keeps the process alive
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every few seconds would flood the logs


def _plain(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
    return [data]


class MetricsPortTaken(OSError):
    """The metrics endpoint's port is taken, most often by another worker on this machine: the message names
    the setting that moves it (``d3stream serve`` defaults to 9464, ``d3stream evaluate`` to 9465)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} is taken (by another d3stream serve or evaluate "
                         "on this machine?), so the metrics endpoint cannot listen there: choose a free one with "
                         "--metrics-port (setting metrics_port, D3STREAM_METRICS_PORT), or --metrics-port '' "
                         "for none")
        self.port = port

    def __str__(self) -> str:  # the sentence alone, without OSError's "[Errno 98]"
        return str(self.strerror)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port``, served from a daemon thread."""

    def __init__(self, metrics: Exposed, *, host: str = "127.0.0.1", port: int = 9464) -> None:
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self._prometheus = make_wsgi_app(metrics.registry)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def app(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        """The WSGI application (usable on its own, e.g. in tests)."""
        path = environ.get("PATH_INFO") or "/"
        if path == "/healthz":
            return _plain(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            if self.metrics.is_ready():
                return _plain(start_response, "200 OK", "ready\n")
            why = getattr(self.metrics, "why_not_ready", lambda: None)()
            return _plain(start_response, "503 Service Unavailable", f"not ready: {why}\n" if why else "not ready\n")
        if path in ("/metrics", "/"):
            return self._prometheus(environ, start_response)
        return _plain(start_response, "404 Not Found", "not found: try /metrics, /healthz or /readyz\n")

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 was asked for); only after ``start()``."""
        if self._httpd is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Where a client on this machine reaches it (the loopback address for a wildcard host)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port. OSError when the port is taken."""
        if self._httpd is not None:
            return self.port

        class Server(_ThreadingWSGIServer):
            pass

        infos = socket.getaddrinfo(self.host or None, self.requested_port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        Server.address_family = infos[0][0]
        try:
            self._httpd = make_server(self.host, self.requested_port, self.app, Server, handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortTaken(self.host, self.requested_port) from exc
            raise OSError(exc.errno, f"cannot serve metrics on {self.host}:{self.requested_port}: {exc.strerror}") \
                from exc
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="d3stream-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics endpoint listening", host=self.host, port=self.port)
        return self.port

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MetricsAddress(Protocol):
    """Where the settings put the endpoint (``ObservabilitySettings`` is one; ops does not import the settings)."""

    @property
    def metrics_host(self) -> str: ...
    @property
    def metrics_port(self) -> int | None: ...


def serve_metrics(metrics: Exposed, address: MetricsAddress) -> MetricsServer | None:
    """Start the endpoint the settings ask for (``metrics_host``/``metrics_port``); None when the port is unset."""
    port = address.metrics_port
    if port is None:
        return None
    server = MetricsServer(metrics, host=address.metrics_host, port=int(port))
    server.start()
    return server
