"""A local S3 for tests: one moto server per test session, on 127.0.0.1 only, started by our own code.

Import the fixtures into a test module (`from s3_server import s3_endpoint, s3_bucket`), or call
`new_bucket()` directly (the storage contract suite's backend factories do). Nothing here talks to
anything but the loopback server; the credentials are made up and only the server sees them.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import uuid
from typing import Any

import pytest

KEY = "testing-key-id"
SECRET = "testing-secret-9f8e7d6c"  # tests check this never leaks into messages or logs
REGION = "us-east-1"

_lock = threading.Lock()
_server: Any = None
_endpoint: str | None = None


def endpoint() -> str:
    """http://127.0.0.1:<port> of the session's moto server, started on first use (skips if moto is missing)."""
    global _server, _endpoint
    with _lock:
        if _endpoint is None:
            try:
                from moto.server import ThreadedMotoServer
            except ImportError as exc:
                pytest.skip(f"moto[server] is not importable ({exc}): pip install 'moto[server]' to run the S3 tests")
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
            _make_conditional_puts_atomic()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: a free one
            server.start()
            host, port = server.get_host_and_port()
            assert host == "127.0.0.1", host
            _server, _endpoint = server, f"http://{host}:{port}"
            atexit.register(_stop)
        return _endpoint


def _make_conditional_puts_atomic() -> None:
    """Give the local server S3's guarantee for `If-None-Match: *`.

    moto 5.2 checks the condition and then stores the object as two steps of one request handler;
    S3 decides them atomically. Without this, two racing creators could both win on moto (rarely:
    the window is a few hundred microseconds) and the one-winner tests would be flaky for reasons
    that have nothing to do with our code. Only the PutObject handler is serialized (parts and
    reads stay parallel); the request still goes through moto's own condition check.
    """
    from moto.s3.responses import S3Response

    original = S3Response.put_object
    if getattr(original, "serialized_for_tests", False):
        return
    lock = threading.Lock()

    @functools.wraps(original)
    def put_object(self: Any) -> Any:
        with lock:
            return original(self)

    put_object.serialized_for_tests = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign]


def _stop() -> None:
    global _server, _endpoint
    with _lock:
        if _server is not None:
            _server.stop()
        _server, _endpoint = None, None


def storage_options(**extra: Any) -> dict[str, Any]:
    """What FsspecStorage needs to reach the local server."""
    return {"endpoint_url": endpoint(), "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}, **extra}


@functools.lru_cache(maxsize=1)
def _client(url: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION)


def client() -> Any:
    """A boto3 client of the local server (for setting up buckets and looking behind FsspecStorage's back)."""
    return _client(endpoint())


def new_bucket(prefix: str = "root") -> tuple[str, dict[str, Any]]:
    """A fresh, empty bucket: (f"s3://{bucket}/{prefix}", storage_options)."""
    bucket = f"ckpt-{uuid.uuid4().hex[:20]}"
    client().create_bucket(Bucket=bucket)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}", storage_options()


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    return endpoint()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> tuple[str, dict[str, Any]]:
    return new_bucket()
