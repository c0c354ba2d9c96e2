"""Development: what a newcomer, the demo and the tests need and production does not. The local Kafka and S3
servers (``infra``), the demo (``demo``) and its task (``tasks``), the tiny checkpoints built and trained here
(``build_checkpoint``, ``train``), and a progress bar for long runs (``progress``)."""
