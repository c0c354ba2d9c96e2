"""What an operator sees of a running worker: Prometheus metrics and the health endpoints, structured logs,
OpenTelemetry traces, and the garbage collector's settings while a worker serves. Nothing here knows a
request's path; the layers above report into it."""
