"""confluent-kafka's own Schema Registry serializers and deserializers, set up as the tests use them against
the embedded registry (Apicurio): the clients nobody here wrote, which must read and write what d3stream does.

Two settings keep a run from hanging on Apicurio rather than failing:

* Subjects by topic name, given as the strategy function. confluent-kafka 2.16's default strategy
  (``ASSOCIATED``) first asks the registry for the topic's associations, an endpoint of Confluent's own
  registry; Apicurio 3.3.3 answers it 404, except for about one request in a hundred that it never answers
  (300 tries with curl: three hung), which held a CI run's test for its whole timeout.
* A timeout on each registry request, so that any other request that goes unanswered fails the test
  promptly with the request it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer

REQUEST_TIMEOUT_S = 30
BY_TOPIC: dict[str, Any] = {"subject.name.strategy": topic_subject_name_strategy}


def registry_client(url: str, **config: Any) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": url, "timeout": REQUEST_TIMEOUT_S, **config})


def avro_serializer(client: SchemaRegistryClient, schema: str, to_dict: Callable[..., Any],
                    conf: dict[str, Any] | None = None) -> AvroSerializer:
    return AvroSerializer(client, schema, to_dict, conf={**BY_TOPIC, **(conf or {})})


def avro_deserializer(client: SchemaRegistryClient) -> AvroDeserializer:
    return AvroDeserializer(client, conf=BY_TOPIC)


def json_serializer(client: SchemaRegistryClient, schema: str, conf: dict[str, Any] | None = None) -> JSONSerializer:
    return JSONSerializer(schema, client, conf={**BY_TOPIC, **(conf or {})})


def json_deserializer(client: SchemaRegistryClient) -> JSONDeserializer:
    return JSONDeserializer(None, schema_registry_client=client, conf=BY_TOPIC)
