"""The worker's Kafka hash (d3stream/kafka/publishing.py): murmur2 is Kafka's hash for every key length. Where
the record batches land on the broker: tests/integration/test_publishing.py."""

from __future__ import annotations

import os
import random

from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from d3stream.kafka.publishing import murmur2


def test_murmur2_is_kafkas_hash_of_every_key_length():
    rng = random.Random(7)
    keys = [b"", b"a", b"ab", b"abc", b"abcd", "caf\u00e9-\u00fc".encode()]
    keys += [os.urandom(rng.randint(0, 64)) for _ in range(5_000)]
    assert [murmur2(key) for key in keys] == [aiokafka_murmur2(key) for key in keys]
