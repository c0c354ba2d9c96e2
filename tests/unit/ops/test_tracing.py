"""Forwarded headers (d3stream/ops/tracing.py): the allowed names, once each, within the byte bound, trace headers
first. On the broker: tests/integration/test_observability.py."""

from __future__ import annotations

import pytest

from d3stream.ops.tracing import forwarded_headers, header_names

pytestmark = pytest.mark.timeout(240)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01".encode()


# --------------------------------------------------------------------------------- header selection


def test_forwarded_headers_take_the_allowed_names_once_within_the_byte_bound():
    names = header_names(["x-tenant", "traceparent", "x-route"])
    assert names == ("traceparent", "tracestate", "x-tenant", "x-route")
    incoming = [
        ("x-tenant", b"acme"), ("x-secret", b"never"), ("x-tenant", b"second"), ("x-route", None),
        ("tracestate", b"v=1"), ("traceparent", TRACEPARENT),
    ]
    # Trace headers first, the first occurrence of a name only, unlisted and valueless headers never.
    assert forwarded_headers(incoming, names, 4096) == [
        ("traceparent", TRACEPARENT), ("tracestate", b"v=1"), ("x-tenant", b"acme"),
    ]
    # The bound keeps the trace headers and leaves out what no longer fits.
    room = len("traceparent") + len(TRACEPARENT) + len("x-tenant") + len(b"acme")
    assert forwarded_headers([("x-tenant", b"x" * 500), ("traceparent", TRACEPARENT)], names, room) == [
        ("traceparent", TRACEPARENT)
    ]
    assert forwarded_headers(None, names, 4096) == [] and forwarded_headers(incoming, names, 0) == []
