"""d3stream-client: the d3stream event contract, and a light Kafka client for the services on either side.

* ``contract``: the request, answer and dead-letter Structs (the worker uses these very definitions);
* ``validation``: the checks a worker makes before any model work, with its messages;
* ``D3Client`` / ``Publisher``: publish requests, or ``ask`` and wait for one answer;
* ``AnswerSubscription``: read answers in a consumer group, each once, committed after use;
* ``media``: upload local files and point requests at them (``pip install 'd3stream-client[s3]'``);
* ``RegistryFormat``: requests framed for a Schema Registry, framed answers read (``pip install
  'd3stream-client[registry]'``; ``registry=`` of the classes above).

It needs aiokafka and msgspec only: importing it loads no model library. The names below are loaded when
first used, so a program that reads only the contract (the worker's core does) never loads aiokafka, and
one that names no ``RegistryFormat`` never loads confluent-kafka or fastavro.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "AnswerWaiter": "asking", "AskTimeout": "asking",
    "D3Client": "client",
    "partition_for": "connection",
    "ERROR_CODES": "contract", "HEADERS": "contract", "SCHEMA_VERSION": "contract", "Answer": "contract",
    "DeadLetter": "contract", "ErrorInfo": "contract", "Provenance": "contract", "Request": "contract",
    "Source": "contract", "decode_answer": "contract", "decode_dead_letter": "contract", "encode": "contract",
    "Published": "publisher", "Publisher": "publisher",
    "AnswerSubscription": "subscriber", "consume_answers": "subscriber",
    "DEFAULT_LIMITS": "validation", "EventError": "validation", "RequestLimits": "validation",
    "decode_request": "validation", "validate_request": "validation",
}
__all__ = sorted(_EXPORTS)
# Names of the [registry] extra: resolved like those above, but left out of __all__, so that
# ``from d3stream_client import *`` works without the extra and loads nothing of it.
_EXTRA_EXPORTS = {"RegistryError": "registry", "RegistryFormat": "registry", "UnreadableRecord": "registry"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _EXTRA_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'd3stream_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"d3stream_client.{module}"), name)
