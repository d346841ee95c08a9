"""A real S3-compatible server for tests: moto's server mode in a subprocess on localhost.

moto keeps buckets and objects in memory: :meth:`S3Server.stop` loses them, and a
:meth:`S3Server.start` after it (same port) serves an empty store, in which tests create
their bucket again. Only the fake credentials of ``FAKE_AWS_ENV`` are used; nothing leaves
the host.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trainpod.testing.wait import wait_until

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never probe the instance-metadata service
    "AWS_CONFIG_FILE": os.devnull,  # nor read the user's ~/.aws
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
"""Fake credentials: botocore finds these first and looks nowhere else."""
UNSET_AWS_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN")
"""Variables that would point botocore elsewhere; tests start without them."""


_RUN_MOTO = """
import os, sys, threading, time
from moto.server import main

def orphaned(parent=os.getppid()):  # the test process died without stopping us: follow it
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=orphaned, daemon=True).start()
main(sys.argv[1:])
"""
"""``python -m moto.server``, which also exits when the process that started it is gone."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class S3Server:
    """moto's S3 server on ``127.0.0.1:<port>``, started and stopped by the test.

    :meth:`start` blocks until the server answers; :meth:`stop` ends exactly the process it
    started. Both are idempotent. Usable as a context manager (stopped on exit).
    """

    def __init__(self, log: Path, port: int | None = None) -> None:
        self.log = log
        self.port = port if port is not None else free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server (a ``Checkpointer(storage_options=...)``)."""
        return {
            "endpoint_url": self.endpoint,
            "key": FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
            "secret": FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": FAKE_AWS_ENV["AWS_DEFAULT_REGION"]},
            # A stopped server refuses at once; fail fast instead of botocore's backoff so
            # the checkpointer's own retry schedule is what a test observes.
            "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}},
        }

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> None:
        if self.alive():
            return
        env = {**os.environ, **FAKE_AWS_ENV}
        cmd = [sys.executable, "-c", _RUN_MOTO, "-H", "127.0.0.1", "-p", str(self.port)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_until(self._answers, timeout_s=timeout_s, what=f"moto server at {self.endpoint}")

    def _answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"moto server on port {self.port} exited: {tail}")
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=1) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server process (then kill it if it lingers) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API); the server keeps running."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()

    def restart(self) -> None:
        """Stop, then start on the same port: the store comes back empty (moto is in-memory)."""
        self.stop()
        self.start()

    def client(self) -> Any:
        """A boto3 S3 client for this server (for setting up and inspecting buckets)."""
        import boto3  # type: ignore[import-untyped]  # boto3 ships no type hints

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=FAKE_AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=FAKE_AWS_ENV["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix``, sorted."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
