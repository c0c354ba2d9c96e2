"""A small real HTTP reverse proxy in front of the test S3 store, with faults that can be switched on.

Point a service's ``s3_endpoint_url`` at ``proxy.endpoint_url`` and every object-store call it makes
goes through here, where a test can

* see it: ``proxy.log`` is the list of ``(method, path)`` seen, in order (path without the query; the
  full request line is in ``proxy.entries``), so "no GET happened" or "no request for that bucket" can
  be proven;
* break it: ``fail_next(n, status=500)`` answers the next ``n`` matching requests itself with an S3-style
  error document, ``delay(seconds)`` holds matching responses back (a store slower than the client's
  read timeout), ``refuse()`` drops connections without an answer (so does a store that is down:
  the proxy hangs up rather than inventing a 502);
* change the world between two calls: ``after_head(path, hook)`` runs ``hook()`` after the store answered
  a HEAD of ``path`` and before that answer reaches the client -- e.g. replace the object, so the GET
  that follows asks for an ETag that is no longer there.

Signatures. S3 SigV4 signs the ``Host`` header. The client signs ``127.0.0.1:<proxy port>``; the proxy
forwards the request to the store's port with the client's ``Host`` header verbatim (``http.client``
with ``skip_host``), and S3Proxy verifies the signature against the headers it received, so the
signature stays valid without turning authorization off (``tests/integration/test_faults.py`` checks this with a
wrong secret too: it is still refused through the proxy).

Only what the tests route through it is supported: requests with a ``Content-Length`` body (or none),
responses read whole (objects in tests are small). Standard library only: ``ThreadingHTTPServer`` in a
daemon thread, ``http.client`` upstream.

Registered as a pytest plugin in ``tests/conftest.py``: the ``proxy`` fixture is a ``FaultProxy`` in front
of the session's object store, for one test.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

# Not forwarded either way: they describe one connection, not the message.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",  # the body was read already: a 100-continue handshake upstream would only stall
}
THREAD_PREFIX = "fault-proxy"


@dataclass
class Entry:
    """One request the proxy received, and what became of it."""

    method: str
    path: str  # without the query
    target: str  # the full request target, query included
    status: int | None = None  # what the client got (None: the connection was dropped)
    fault: str | None = None  # "fail", "delay", "refuse", "hook" when a fault touched it


@dataclass
class _Rule:
    """A fault for requests whose method and path match."""

    remaining: int | None  # None: until cleared
    methods: frozenset[str] | None
    path: str | None  # exact path, or a prefix when it ends with "*"

    def matches(self, method: str, path: str) -> bool:
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.methods is not None and method not in self.methods:
            return False
        if self.path is None:
            return True
        if self.path.endswith("*"):
            return path.startswith(self.path[:-1])
        return path == self.path

    def take(self) -> None:
        if self.remaining is not None:
            self.remaining -= 1


@dataclass
class _Failure(_Rule):
    status: int = 500
    code: str = "InternalError"


@dataclass
class _Delay(_Rule):
    seconds: float = 0.0
    released: threading.Event = field(default_factory=threading.Event)  # set by release(): the wait ends


@dataclass
class _Hook(_Rule):
    hook: Callable[[], None] = field(default=lambda: None)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):  # socketserver's signature
        # ThreadingMixIn's, with named threads: a thread-leak check can tell the proxy's own apart.
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"{THREAD_PREFIX}-request",
            daemon=True,
        )
        thread.start()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # the base class's names
        return None

    def _relay(self) -> None:
        proxy = self.server.proxy
        path = urlsplit(self.path).path
        entry = Entry(self.command, path, self.path)
        with proxy._lock:
            proxy.entries.append(entry)
            failure = proxy._first(proxy._failures, self.command, path)
            delay = proxy._first(proxy._delays, self.command, path)
            hook = proxy._first(proxy._hooks, self.command, path)
            refusing = proxy._refusing
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if refusing:
            entry.fault = "refuse"
            self.close_connection = True
            return
        if delay is not None:
            entry.fault = "delay"
            delay.released.wait(delay.seconds)
        if failure is not None:
            entry.fault = "fail"
            payload = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{failure.code}</Code><Message>injected by the fault proxy</Message>"
                f"<Resource>{path}</Resource><RequestId>fault-proxy</RequestId></Error>"
            ).encode()
            self._answer(entry, failure.status, [("Content-Type", "application/xml")], payload)
            return
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=proxy.upstream_timeout)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    upstream.putheader(name, value)  # Host verbatim: the client's signature covers it
            upstream.endheaders(body or None)
            response = upstream.getresponse()
            payload = response.read()
            status = response.status
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
        except OSError:
            # The store is down: hang up without an answer, as the store itself would have refused the
            # connection (the client sees a connection error, not an HTTP status the proxy made up).
            entry.fault = "upstream-down"
            self.close_connection = True
            return
        finally:
            upstream.close()
        if hook is not None and 200 <= status < 300:
            entry.fault = "hook"
            hook.hook()
        self._answer(entry, status, headers, payload)

    def _answer(self, entry: Entry, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
        entry.status = status
        self.send_response(status)
        has_length = False
        for name, value in headers:
            if name.lower() == "content-length":
                has_length = True
            self.send_header(name, value)
        if not has_length:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD" and payload:
            try:
                self.wfile.write(payload)
            except OSError:  # the client gave up (its read timeout): nothing to deliver to
                pass

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay  # http.server's names


class FaultProxy:
    """A reverse proxy on 127.0.0.1 (a free port) forwarding to ``upstream_url``; see the module docstring."""

    def __init__(self, upstream_url: str, *, upstream_timeout: float = 30.0):
        parts = urlsplit(upstream_url)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self.upstream_timeout = upstream_timeout
        self.entries: list[Entry] = []
        self._failures: list[_Failure] = []
        self._delays: list[_Delay] = []
        self._hooks: list[_Hook] = []
        self._refusing = False
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- lifecycle

    def start(self) -> FaultProxy:
        self._server = _Server(("127.0.0.1", 0), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"{THREAD_PREFIX}-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(10)
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what was seen

    @property
    def log(self) -> list[tuple[str, str]]:
        """(method, path) of every request received, in order."""
        with self._lock:
            return [(e.method, e.path) for e in self.entries]

    def requests(self, method: str | None = None, path: str | None = None) -> list[Entry]:
        """Entries with this method and path (a path ending in ``*`` is a prefix)."""
        rule = _Rule(None, frozenset({method}) if method else None, path)
        with self._lock:
            return [e for e in self.entries if rule.matches(e.method, e.path)]

    def clear_log(self) -> None:
        with self._lock:
            self.entries.clear()

    # -- faults

    def fail_next(
        self, count: int, *, status: int = 500, code: str = "InternalError", methods: set[str] | None = None,
        path: str | None = None,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` (an S3 error document), not forwarding them."""
        with self._lock:
            self._failures.append(_Failure(count, _methods(methods), path, status=status, code=code))

    def delay(
        self, seconds: float, *, count: int | None = None, methods: set[str] | None = None, path: str | None = None
    ) -> None:
        """Hold matching responses back ``seconds`` (the next ``count`` of them, or all until ``clear()``)."""
        with self._lock:
            self._delays.append(_Delay(count, _methods(methods), path, seconds=seconds))

    def after_head(self, path: str, hook: Callable[[], None], *, count: int | None = 1) -> None:
        """Run ``hook()`` after the store answered a HEAD of ``path``, before the client sees that answer."""
        with self._lock:
            self._hooks.append(_Hook(count, frozenset({"HEAD"}), path, hook=hook))

    def refuse(self, on: bool = True) -> None:
        """Drop every connection without an answer (a store that accepts and hangs up)."""
        with self._lock:
            self._refusing = on

    def release(self) -> None:
        """Let the responses held back now go at once, and switch the delays off."""
        with self._lock:
            for delay in self._delays:
                delay.released.set()
            self._delays.clear()

    def clear(self) -> None:
        """Switch every fault off (responses already held back stay held for their delay: ``release``)."""
        with self._lock:
            self._failures.clear()
            self._delays.clear()
            self._hooks.clear()
            self._refusing = False

    @staticmethod
    def _first(rules: list, method: str, path: str):  # one of the _Rule subclasses
        for rule in rules:
            if rule.matches(method, path):
                rule.take()
                return rule
        return None


def _methods(methods: set[str] | None) -> frozenset[str] | None:
    return frozenset(m.upper() for m in methods) if methods else None


@pytest.fixture
def proxy(object_store):
    """A fault proxy in front of the session's object store, for this test."""
    with FaultProxy(object_store.endpoint_url) as running:
        yield running
