"""An S3 server on 127.0.0.1 for the demo and the benchmarks: moto, in a child process, stopped on exit.

    with EmbeddedS3() as s3:
        url = s3.bucket("demo") + "/run1"          # s3://demo/run1
        CheckpointManager(local_dir, remote=url, storage_options=s3.storage_options)

It runs in its own process so that its request handling (Python) does not share the GIL with the
training loop. The child also exits when its parent dies (it watches its stdin). Needs
`pip install 'moto[server]'` (part of the dev extra). The credentials are made up: only this server
sees them. For a real bucket pass its URL and real credentials instead (see the README, "A durable copy in object storage").
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

_CHILD = r"""
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes it (or dies)
server.stop()
"""

KEY, SECRET, REGION = "demo-key-id", "demo-secret-key", "us-east-1"


class EmbeddedS3:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self) -> str:
        try:
            import moto.server  # noqa: F401 - only to fail early with a clear message
        except ImportError as exc:
            raise RuntimeError(f"moto[server] is not installed ({exc}): pip install 'moto[server]'") from None
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        port = self.proc.stdout.readline().strip()
        if not port.isdigit():
            self.stop()
            raise RuntimeError("the embedded S3 server did not start")
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}

    def bucket(self, name: str) -> str:
        """Create the bucket `name`; returns 's3://name'."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                     region_name=REGION).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.proc is not None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def __enter__(self) -> "EmbeddedS3":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
