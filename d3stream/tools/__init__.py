"""Commands around the service rather than in it: benchmarks, the chaos and scale-out reports, the demo and
its task, replays and comparisons of answer sets, the local checkpoint builder and trainer, the produce and
consume helpers, and the local Kafka and S3 servers (``infra``) that the demo and the tests start."""
