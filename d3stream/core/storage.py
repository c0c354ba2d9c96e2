"""Media references in, bytes out: reading the objects a request names from S3-compatible storage.

A request names media as ``s3://bucket/key`` (optionally ``?versionId=...``) or inline ``data:`` URLs.
Everything else (``http(s)://`` URLs, local paths, other schemes) is refused before any network call,
and so is any bucket or prefix outside the configured allowlist: a producer must not be able to make a
worker read what it was not meant to read. Credentials come only from the standard AWS chain
(environment, profile, instance role), never from events.

Reads are blocking boto3 calls run in a bounded thread pool. Each object is sized with HEAD first and
refused unread when it is over the runtime's strict limit; the GET then asks for exactly the ETag
HEAD saw, so an object replaced in between is noticed rather than mixed up. Throttling, 5xx answers
and connection errors are retried by botocore's standard retry mode with backoff; what still fails
becomes a per-request error with a code the answer event carries.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypedDict
from urllib.parse import parse_qs, urlsplit

import structlog

from d3stream.runtime import media as media_io
from d3stream.runtime.kinds import media_kind
from d3stream.settings import StorageSettings

log = structlog.get_logger(__name__)

# S3 bucket names (and the dotted names older buckets have): lower case, digits, dots, hyphens.
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


class MediaError(Exception):
    """A media reference that cannot be read; ``code`` is the answer's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str
    version_id: str | None = None

    @property
    def uri(self) -> str:
        suffix = f"?versionId={self.version_id}" if self.version_id else ""
        return f"s3://{self.bucket}/{self.key}{suffix}"


@dataclass
class FetchedMedia:
    """The bytes of one media reference and what identifies them."""

    uri: str
    data: bytes
    etag: str | None = None
    version: str | None = None
    sha256: str = ""

    def __post_init__(self) -> None:
        if not self.sha256:
            self.sha256 = hashlib.sha256(self.data).hexdigest()


def parse_s3_reference(reference: str) -> S3Location:
    """``s3://bucket/key[?versionId=v]`` -> S3Location; MediaError(media_not_allowed) for anything else."""
    if reference.startswith(("http://", "https://")):
        raise MediaError("media_not_allowed", "web addresses are not fetched; store the object in an allowed bucket")
    # URL parsing forgives what a reference must not carry: it drops tabs and newlines anywhere (so a bucket
    # name with one reads as another bucket), and a fragment. Each is refused, named, rather than rewritten.
    control = next((char for char in reference if ord(char) < 0x20 or ord(char) == 0x7F), None)
    if control is not None:
        raise MediaError("media_not_allowed",
                         f"{reference[:200]!r} contains the control character {control!r}; references are not rewritten")
    if "#" in reference:
        raise MediaError("media_not_allowed",
                         f"{reference[:200]!r} has a #fragment; an S3 reference is s3://bucket/key[?versionId=...]")
    try:
        parts = urlsplit(reference)
        netloc = parts.netloc
    except ValueError as exc:  # e.g. "s3://[bucket]/x": brackets read as a malformed IPv6 host
        raise MediaError("media_not_allowed", f"{reference[:200]!r} is not a valid s3://bucket/key reference") from exc
    if parts.scheme != "s3":
        raise MediaError(
            "media_not_allowed",
            f"media must be s3://bucket/key or a data: URL; {reference[:80]!r} is neither (local paths are refused)",
        )
    key = parts.path[1:]  # the key is everything after the bucket's slash: s3://bucket//key has an empty segment
    if not netloc or not key:
        raise MediaError("media_not_allowed", f"{reference[:200]!r} names no bucket and key")
    if not BUCKET_NAME.fullmatch(netloc):  # user info, ports, brackets, upper case: not a bucket
        raise MediaError("media_not_allowed", f"{reference[:200]!r}: {netloc[:80]!r} is not an S3 bucket name")
    # HTTP layers resolve dot segments and merge empty ones, so such a key could read an object outside
    # the prefix the allowlist checked: refuse it rather than normalise it.
    segments = key.split("/")
    if any(segment in ("", ".", "..") for segment in segments) or "\\" in key:
        raise MediaError("media_not_allowed", f"{reference[:200]!r}: keys may not contain '.', '..' or empty segments")
    query = parse_qs(parts.query, keep_blank_values=True)
    if set(query) - {"versionId"} or len(query.get("versionId", ())) > 1:
        raise MediaError("media_not_allowed",
                         f"{reference[:200]!r}: the only query a reference may carry is one ?versionId=...")
    version = query.get("versionId", [None])[0]
    return S3Location(netloc, key, version)


@dataclass
class Allowlist:
    """Buckets, or bucket/prefix pairs, that requests may name. Empty means nothing is allowed.

    A prefix matches whole path segments: ``bucket/prefix`` (with or without a trailing slash) allows
    ``bucket/prefix/...``, never ``bucket/prefixEVIL/...``."""

    entries: list[str] = field(default_factory=list)

    def allows(self, location: S3Location) -> bool:
        key_segments = location.key.split("/")
        for entry in self.entries:
            bucket, _, prefix = entry.partition("/")
            if location.bucket != bucket:
                continue
            prefix_segments = [segment for segment in prefix.split("/") if segment]
            if key_segments[: len(prefix_segments)] == prefix_segments and len(key_segments) > len(prefix_segments):
                return True
        return False


class ObjectBody(Protocol):
    """An object's bytes as S3 streams them (botocore's ``StreamingBody``)."""

    def read(self, amt: int | None = None) -> bytes: ...

    def close(self) -> None: ...


class HeadObjectResponse(TypedDict, total=False):
    """What is read of a HEAD answer (botocore's dict has more keys)."""

    ContentLength: int
    ETag: str


class GetObjectResponse(TypedDict, total=False):
    """What is read of a GET answer (botocore's dict has more keys)."""

    Body: ObjectBody
    ETag: str
    VersionId: str


class S3Client(Protocol):
    """The calls media reads make on a boto3 S3 client (boto3 ships no types of its own)."""

    def head_object(self, *, Bucket: str, Key: str, VersionId: str = ...) -> HeadObjectResponse: ...

    def get_object(self, *, Bucket: str, Key: str, IfMatch: str | None = ...,
                   VersionId: str = ...) -> GetObjectResponse: ...


class S3ClientOptions(TypedDict):
    """The arguments of ``s3_client``."""

    endpoint_url: str | None
    region_name: str | None
    connect_timeout: float
    read_timeout: float
    max_attempts: int


def s3_client(
    *,
    endpoint_url: str | None,
    region_name: str | None,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
) -> S3Client:
    """A boto3 S3 client with the worker's endpoint, region, timeouts and retries; credentials from the
    standard AWS chain. Media and checkpoints (``d3stream.models.checkpoints``) are read through the same kind."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region_name,
        config=Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # total_max_attempts counts the first try too (botocore's max_attempts counts retries)
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
            signature_version="s3v4",
        ),
    )


def inline_media(reference: str, kind: str) -> FetchedMedia:
    """The bytes of an inline ``data:`` URL, with the strict type and size checks of its kind."""
    media = media_kind(kind)
    try:
        subtype, text = media_io.split_data_url(reference, media.name)
        if subtype.split(";", 1)[0] not in media.data_url_types:
            raise ValueError(f"{kind} data URLs take the types {', '.join(media.data_url_types)}, got {subtype!r}")
        data = media_io.decode_base64(text, media.max_bytes)
    except ValueError as exc:
        code = "media_too_large" if "limit" in str(exc) else "media_unreadable"
        raise MediaError(code, str(exc)) from exc
    return FetchedMedia(uri=f"data:{kind}/{subtype}", data=data)


class MediaFetcher:
    """Reads a request's media from the object store, a bounded number of objects at a time."""

    def __init__(
        self,
        *,
        allowlist: list[str],
        endpoint_url: str | None = None,
        region: str | None = None,
        max_concurrency: int = 8,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
        max_attempts: int = 4,
        client: S3Client | None = None,
    ):
        self.allowlist = Allowlist(list(allowlist))
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="d3stream-s3")
        self._client = client
        self._client_lock = threading.Lock()
        self._client_options: S3ClientOptions = {
            "endpoint_url": endpoint_url,
            "region_name": region,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "max_attempts": max_attempts,
        }
        self.bytes_fetched = 0

    @classmethod
    def from_settings(cls, storage: StorageSettings) -> MediaFetcher:
        """A fetcher with a worker's allowlist, endpoint, concurrency, timeouts and attempts."""
        return cls(
            allowlist=storage.media_allowlist,
            endpoint_url=storage.s3_endpoint_url,
            region=storage.s3_region,
            max_concurrency=storage.s3_max_concurrency,
            connect_timeout=storage.s3_connect_timeout,
            read_timeout=storage.s3_read_timeout,
            max_attempts=storage.s3_max_attempts,
        )

    @property
    def client(self) -> S3Client:
        # One client for every fetch thread (botocore clients are thread-safe). Built once under a lock: the
        # first requests' threads would otherwise each build one, about half a CPU-second apiece.
        with self._client_lock:
            if self._client is None:
                self._client = s3_client(**self._client_options)
            return self._client

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def check(self, reference: str, kind: str) -> S3Location | None:
        """Refuse a reference before any network call; returns its location (None for inline data)."""
        if not isinstance(reference, str) or not reference:
            raise MediaError("media_not_allowed", f"a {kind} reference must be a nonempty string")
        if reference.startswith("data:"):
            return None
        location = parse_s3_reference(reference)
        if not self.allowlist.allows(location):
            raise MediaError(
                "media_not_allowed",
                f"{location.uri} is outside the allowed buckets and prefixes (setting: media_allowlist)",
            )
        return location

    async def fetch(self, reference: str, kind: str) -> FetchedMedia:
        """The bytes of one reference; MediaError with the code and reason otherwise."""
        location = self.check(reference, kind)
        if location is None:
            return inline_media(reference, kind)
        loop = asyncio.get_running_loop()
        fetched = await loop.run_in_executor(self._executor, self._read, location, kind)
        self.bytes_fetched += len(fetched.data)
        return fetched

    async def fetch_all(self, references: list[str], kind: str) -> list[FetchedMedia]:
        """The bytes of each reference of one media kind (``kinds.MEDIA_KINDS``' name: ``"image"``,
        ``"video"``), in order; a reference named twice is fetched once (the same ``FetchedMedia`` stands
        at both places)."""
        distinct = list(dict.fromkeys(references))
        fetched = dict(zip(distinct, await asyncio.gather(*(self.fetch(r, kind) for r in distinct)), strict=True))
        return [fetched[reference] for reference in references]

    def _read(self, location: S3Location, kind: str) -> FetchedMedia:
        from botocore.exceptions import BotoCoreError, ClientError

        limit = media_kind(kind).max_bytes
        versioned = {"VersionId": location.version_id} if location.version_id else {}
        started = time.perf_counter()
        for attempt in (1, 2):  # a second look when the object changed between HEAD and GET
            try:
                head = self.client.head_object(Bucket=location.bucket, Key=location.key, **versioned)
                size = int(head.get("ContentLength", 0))
                if size > limit:
                    raise MediaError(
                        "media_too_large",
                        f"{location.uri} has {size:,} bytes; a {kind} may have at most {limit:,}",
                    )
                etag = head.get("ETag")
                response = self.client.get_object(
                    Bucket=location.bucket, Key=location.key, IfMatch=etag, **versioned
                )
                body = response["Body"]
                try:
                    data = body.read(limit + 1)
                finally:
                    body.close()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = str(error.get("Code", ""))
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code == "PreconditionFailed" or status == 412:
                    if attempt == 1:
                        continue
                    raise MediaError("media_unavailable", f"{location.uri} kept changing while it was read") from exc
                if code in ("404", "NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound") or status == 404:
                    raise MediaError("media_missing", f"{location.uri} does not exist") from exc
                if code in ("403", "AccessDenied") or status == 403:
                    raise MediaError(
                        "media_unavailable",
                        f"{location.uri}: access denied with this worker's credentials (AWS credential chain)",
                    ) from exc
                raise MediaError("media_unavailable", f"{location.uri}: object store error {code or status}") from exc
            except BotoCoreError as exc:
                raise MediaError(
                    "media_unavailable",
                    f"{location.uri}: the object store did not answer ({type(exc).__name__}); "
                    "settings: s3_endpoint_url, s3_read_timeout, s3_max_attempts",
                ) from exc
            if len(data) > limit:  # the object grew past the limit after HEAD
                raise MediaError("media_too_large", f"{location.uri} is larger than {limit:,} bytes")
            log.debug(
                "media fetched", uri=location.uri, bytes=len(data), ms=round((time.perf_counter() - started) * 1e3, 1)
            )
            return FetchedMedia(
                uri=location.uri,
                data=data,
                etag=(response.get("ETag") or etag or "").strip('"') or None,
                version=response.get("VersionId") or location.version_id,
            )
        raise AssertionError("unreachable")
