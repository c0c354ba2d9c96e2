"""The embedded stack starts every time: ports are picked together, a start that loses a port race retries on
fresh ones, and the Schema Registry runs beside Kafka and S3 with its schemas kept across a restart."""

from __future__ import annotations

import http.client
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from d3stream.dev.infra import KafkaBroker, ObjectStore, SchemaRegistry, embedded_stack, free_ports

pytestmark = pytest.mark.timeout(300)


def _answers(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/")
        return conn.getresponse().status > 0
    finally:
        conn.close()


def test_ports_picked_together_never_repeat() -> None:
    picked = [port for _ in range(50) for port in free_ports(4)]
    assert len(set(picked)) == len(picked)


def test_many_stores_start_in_a_row_and_in_parallel() -> None:
    def start_and_check(_: int) -> int:
        with ObjectStore() as store:
            assert _answers(store.port)
            return store.port

    in_a_row = [start_and_check(i) for i in range(3)]
    with ThreadPoolExecutor(4) as pool:
        side_by_side = list(pool.map(start_and_check, range(4)))
    assert len(set(in_a_row + side_by_side)) == 7


def _taken(port: int) -> socket.socket:
    """A listening socket on ``port``: another program that took the port between the pick and the bind."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def test_a_store_that_loses_its_port_starts_on_a_fresh_one() -> None:
    store = ObjectStore()
    lost = store.port
    with _taken(lost), store:
        assert store.port != lost
        assert _answers(store.port)


def test_a_broker_that_loses_its_port_starts_on_a_fresh_one() -> None:
    broker = KafkaBroker()
    lost = broker.port
    with _taken(lost), broker:
        assert broker.port != lost
        broker.create_topic("after-a-lost-port", partitions=1)


def test_a_given_port_that_is_taken_fails_and_says_so() -> None:
    (port,) = free_ports(1)
    with _taken(port), pytest.raises(Exception, match="port picked for it was taken"), ObjectStore(port=port):
        pass


def test_registry_keeps_its_schemas_across_a_restart(schema_registry: SchemaRegistry) -> None:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    schema = Schema('{"type":"record","name":"Kept","fields":[{"name":"a","type":"string"}]}', "AVRO")
    schema_id = SchemaRegistryClient({"url": schema_registry.url}).register_schema("kept-value", schema)
    schema_registry.restart()
    again = SchemaRegistryClient({"url": schema_registry.url}).get_schema(schema_id)
    assert "Kept" in again.schema_str


def test_the_embedded_stack_runs_all_three() -> None:
    with embedded_stack(partitions=1) as stack:
        assert stack.registry is not None
        ports = {stack.broker.port, stack.broker.controller_port, stack.store.port, stack.registry.port,
                 stack.registry.management_port}
        assert len(ports) == 5
        stack.broker.create_topic("stack-topic", partitions=1)
        assert _answers(stack.store.port)
        conn = http.client.HTTPConnection("127.0.0.1", stack.registry.port, timeout=5)
        conn.request("GET", "/apis/ccompat/v7/subjects")
        assert conn.getresponse().status == 200
