"""The S3 store: S3Proxy (its self-contained jar, from the same pom as Kafka's) on 127.0.0.1.

It runs with the jclouds ``filesystem`` backend, so objects are ordinary files in a temporary folder and
survive a stop/start of the server. A real S3 HTTP API rather than a mock, for what the service relies on:
signatures checked, S3 ETags and range reads.
"""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from typing import TYPE_CHECKING, Self

from d3stream.dev.infra.class_data import server_archive
from d3stream.dev.infra.jars import _java, _jvm_options, _s3proxy_jar, ensure_jars
from d3stream.dev.infra.processes import _free_port, _LocalServer, _workdir, _write_properties

if TYPE_CHECKING:
    from botocore.client import BaseClient


class ObjectStore(_LocalServer):
    """S3Proxy on 127.0.0.1 with the filesystem backend: a real S3 HTTP API whose objects are files.

    Signatures are checked (V2 or V4) against fixed test keys, so code that forgets credentials fails
    here as it would against AWS. :meth:`stop`/:meth:`start` keep the port and the files, so a test can
    take the store away under a running service and bring it back.
    """

    event, label = "s3", "S3Proxy"

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        port: int | None = None,
        access_key: str = "d3stream-test",
        secret_key: str = "d3stream-test-secret",
        region: str = "us-east-1",
        heap: str = "256m",
        startup_timeout: float = 60.0,
        stop_grace: float = 10.0,
    ) -> None:
        self.workdir, self._owns_workdir = _workdir(workdir, "d3stream-s3-")
        self._ports_picked = port is None
        self.port = port or _free_port()
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "s3proxy.log"
        self.startup_seconds = None
        self._proc = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pick_ports(self) -> None:
        self.port = _free_port()

    def _start(self) -> Self:
        """Launch S3Proxy and wait until its HTTP port answers (any status: unauthenticated gets 403)."""
        if self.running:
            return self
        jar = _s3proxy_jar(ensure_jars())
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props_path = self.workdir / "s3proxy.properties"
        _write_properties(
            props_path,
            {
                "s3proxy.endpoint": self.endpoint_url,
                "s3proxy.authorization": "aws-v2-or-v4",
                "s3proxy.identity": self.access_key,
                "s3proxy.credential": self.secret_key,
                "jclouds.provider": "filesystem",
                "jclouds.filesystem.basedir": str(self.data_dir),
            },
        )
        java = _java()
        archive = server_archive("s3proxy", java, str(jar))
        cmd = [
            java,
            f"-Xmx{self.heap}",
            "-Xms32m",
            *_jvm_options(),
            *archive.options(),
            "-Djava.awt.headless=true",
            "-Dlogback.statusListenerClass=ch.qos.logback.core.status.NopStatusListener",
            "-jar",
            str(jar),
            "--properties",
            str(props_path),
        ]
        self._launch(cmd, time.monotonic(), poll_s=0.1, on_exit=archive.exited,
                     endpoint=self.endpoint_url)
        return self

    def _ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status > 0
        except OSError:
            return False
        finally:
            conn.close()

    @property
    def client_kwargs(self) -> dict[str, str]:
        """What ``boto3.client("s3", **kwargs)`` needs to reach this store (also useful for service config)."""
        return {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def client(self, **config: object) -> BaseClient:
        """A boto3 S3 client for this store: path-style addressing (no DNS for bucket names on 127.0.0.1).

        ``config`` goes to ``botocore.config.Config`` (e.g. ``retries``, ``connect_timeout``).
        """
        import boto3
        from botocore.config import Config

        cfg = Config(s3={"addressing_style": "path"}, **config)
        return boto3.client("s3", config=cfg, **self.client_kwargs)

    def create_bucket(self, name: str) -> None:
        """Create a bucket; one that already exists (and is ours) is fine."""
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise
