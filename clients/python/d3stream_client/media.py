"""Local media files to the bucket the worker reads, and requests rewritten to point at them.

A request names its images and videos as ``s3://bucket/key`` references (or inline ``data:`` URLs). A
producer holding local files uploads them first: :func:`upload_media` stores one under a content-addressed
key, so the same file is stored once whatever it is called, and :func:`rewrite_media` replaces every local
path of a request with its reference. Both take a boto3 S3 client (``pip install 'd3stream-client[s3]'``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from d3stream_client.contract import MEDIA_FIELDS


def upload_media(s3: Any, bucket: str, path: Path) -> str:
    """Store a local file under a content-addressed key and return its ``s3://`` reference."""
    data = path.read_bytes()
    key = f"media/{hashlib.sha256(data).hexdigest()[:16]}/{path.name}"
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


def rewrite_media(request: dict[str, Any], s3: Any, bucket: str, base: Path) -> dict[str, Any]:
    """The request with every media entry that names a local file (relative to ``base``) uploaded and replaced
    by its ``s3://`` reference; references and entries that are not files stay as they are."""
    for kind in MEDIA_FIELDS:
        values = request.get(kind.field)
        if not isinstance(values, list):
            continue
        rewritten = []
        for value in values:
            local = base / value if isinstance(value, str) and not value.startswith(("s3://", "data:")) else None
            rewritten.append(upload_media(s3, bucket, local) if local is not None and local.is_file() else value)
        request[kind.field] = rewritten
    return request
