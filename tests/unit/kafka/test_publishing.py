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


def test_the_producers_batches_stay_under_the_smallest_topic_limit() -> None:
    from d3stream.kafka.limits import BATCH_OVERHEAD, Limits

    limits = Limits(max_request_size=4_194_304, compression="zstd")
    assert limits.batch_bytes(131_072) == 131_072  # the broker's default limit (1 MB) allows it
    limits.topics = {"answers": 1_048_588, "dead-letters": 50_000}
    assert limits.batch_bytes(131_072) == 50_000 - BATCH_OVERHEAD - 500
    assert limits.batch_bytes(16_384) == 16_384
    limits.topics = {"answers": 600}  # records go alone at any batch size: the smallest batch is 1 KiB
    assert limits.batch_bytes(131_072) == 1024
