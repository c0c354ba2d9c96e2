"""d3stream: typed D3 decisions at streaming scale.

Kafka requests in, media from S3-compatible storage, questions from many events batched into forward
passes of the D3 decision model, one answer event per request (with provenance) out.
"""

__version__ = "0.1.0"
