"""The service layer: one d3stream worker put together, between the jobs above and Kafka and the models below.

* ``service``: ``Service``, the worker: composes the parts (the only module that knows them all), starts them
  in order, serves until asked to stop, and closes them;
* ``startup``: what the worker makes when it runs (consumer, sink, commit policy, consume loop) and the steps
  it takes, in order, before it serves;
* ``hosting``: each served model's own parts (``core.routing.Hosted``), the same whenever it was loaded;
* ``fetch_handler``: ``FetchHandler``, the consume loop's handler: each fetch answered and delivered, under
  the guard that answers every record, even one the pipeline raises on.

Callers import from here: ``from d3stream.service import Service``.
"""

from d3stream.service.service import (
    OffsetTracker,
    Service,
    answer_identity,
    default_token_budget,
    provenance_digest,
)

__all__ = ["OffsetTracker", "Service", "answer_identity", "default_token_budget", "provenance_digest"]
