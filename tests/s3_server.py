"""A real S3-compatible HTTP endpoint for tests: moto's standalone server, in its own process.

:class:`S3Server` starts ``python -m moto.server`` bound to 127.0.0.1 on a free port and waits
(bounded) until it answers HTTP. It keeps everything in memory and dies with the fixture.
The fixtures here are imported by the test modules that need them (tests/test_storage.py):

- ``s3_server`` (session): the running server.
- ``s3_bucket`` (function): a fresh bucket, with the environment pointing boto3 at the server
  (``AWS_ENDPOINT_URL``) and dummy credentials set for the test only.

Nothing here reaches the network: the server and every client stay on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["S3Server", "s3_bucket", "s3_server"]

# Variables that would point boto3 elsewhere or pick other credentials.
_AWS_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``moto.server`` as a subprocess on 127.0.0.1; ``url`` is its endpoint."""

    def __init__(self, log_path: Path, *, startup_timeout_s: float = 60.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        try:
            self._wait(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"moto server exited with {self.proc.returncode} before answering; "
                    f"its log ({self.log_path}):\n{self.log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP answer means it is serving
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(
            f"moto server on {self.url} did not answer within {timeout_s:.0f}s; "
            f"its log ({self.log_path}):\n{self.log_path.read_text()[-4000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the session (starts in ~2-5 s)."""
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto-server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket on the test server; boto3 is pointed at it through the environment."""
    import boto3

    from rl_core import storage

    for name in _AWS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Never let boto3's credential chain probe the instance-metadata address off this host.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    storage.reset_clients()
    bucket = f"grpoflow-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.url, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    try:
        yield bucket
    finally:
        storage.reset_clients()
