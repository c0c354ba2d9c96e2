"""The D3 decision runtime: the model, independent of Kafka and S3, usable as a library on its own.

    from d3stream.runtime import D3
    model = D3.from_pretrained("checkpoints/tiny")
    model.system_one(state="...", questions={"route": {"type": "choice", "criteria": {...}}})
"""

from d3stream.runtime.model import D3, Prepared, Row

__all__ = ["D3", "Prepared", "Row"]
