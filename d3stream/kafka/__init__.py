"""The Kafka side of a worker: the consume loop and its read policies, offsets, commit policies, sinks,
record batches, the topics' size limits and the connection settings every aiokafka client is made with.

Built on the core (``d3stream.core``), never the other way round: the core hands back answers as values and
this layer decides when they are written and when offsets commit.
"""
