"""Fault injection by wrapping a REAL backend: the fsspec filesystem inside an FsspecStorage.

`inject(storage, Fault("upload_part", "slowdown", times=2))` replaces the filesystem of the storage's
Endpoint (`storage.endpoint.fs`) with a FaultyFS proxy, underneath the retry wrapper. Every request
still goes to the real filesystem (the moto server, memory, a directory); chosen calls fail first,
the way the S3 stack would fail them: s3fs-translated ClientErrors (503 SlowDown, 500, 403),
connection resets, read timeouts, bodies cut short, responses lost after the server acted, or a
crash (an exception that is not a storage error at all, as if the process died).

Operations are s3fs `call_s3` method names (put_object, upload_part, complete_multipart_upload,
list_objects_v2, ...) and the generic filesystem methods FsspecStorage uses (cat_file, pipe_file,
open, mv, link, rm, ls, info). The proxy records every call and the peak number of calls in flight
per operation, which is how tests see parallel multipart uploads.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fnmatch
import sys
import threading
import time
from typing import Any, Callable

from checkpointing.storage import FsspecStorage

GENERIC_OPS = ("cat_file", "pipe_file", "open", "mv", "link", "rm", "ls", "info")
KINDS = ("slowdown", "internal", "denied", "reset", "timeout", "truncate", "short", "lost", "crash")


class InjectedCrash(Exception):
    """The process 'died' here: not an OSError, so no layer retries or translates it."""


@dataclasses.dataclass
class Fault:
    """Fail matching calls: `op` ("*" for any) on a path matching the glob `path`.

    The first `skip` matching calls pass, then `times` calls fail (times < 0: all of them).
    kinds: slowdown/internal/denied (s3fs-translated 503/500/403), reset (ConnectionResetError),
    timeout (botocore ReadTimeoutError), truncate (half the body reaches the server, then a reset),
    short (half the body reaches the server, no error), lost (the call succeeds, its response is
    lost: a reset), crash (InjectedCrash before the call).
    """

    op: str
    kind: str
    times: int = 1
    path: str = "*"
    skip: int = 0
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: one of {KINDS}")

    def matches(self, op: str, path: str) -> bool:
        return self.op in ("*", op) and fnmatch.fnmatchcase(path, self.path)


def _client_error(code: str, status: int, message: str, op: str) -> Exception:
    """What s3fs raises for a failed request: its translated builtin, the ClientError as __cause__."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return translate_boto_error(ClientError(response, op))


def make_error(kind: str, op: str) -> Exception:
    if kind == "slowdown":
        return _client_error("SlowDown", 503, "Please reduce your request rate.", op)
    if kind == "internal":
        return _client_error("InternalError", 500, "We encountered an internal error. Please try again.", op)
    if kind == "denied":
        return _client_error("AccessDenied", 403, "Access Denied", op)
    if kind == "timeout":
        from botocore.exceptions import ReadTimeoutError

        return ReadTimeoutError(endpoint_url="http://127.0.0.1/")
    if kind == "crash":
        return InjectedCrash(f"injected crash in {op}")
    return ConnectionResetError(errno.ECONNRESET, f"Connection reset by peer (injected in {op})")


class FaultyFS:
    """A proxy of a real fsspec filesystem that fails chosen calls (see the module docstring)."""

    def __init__(self, fs: Any, *faults: Fault, latency_s: float = 0.0) -> None:
        self._fs = fs
        self.faults = list(faults)
        self.latency_s = latency_s
        self.calls: list[tuple[str, str, frozenset[str]]] = []  # (op, path, keyword names)
        self.peak: collections.Counter[str] = collections.Counter()
        self._active: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name in GENERIC_OPS:
            return lambda *args, **kwargs: self._run(name, str(args[0]) if args else "", attr, args, kwargs)
        return attr

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        path = str(kwargs.get("Key", "")) or " ".join(o["Key"] for o in kwargs.get("Delete", {}).get("Objects", []))  # delete_objects: its keys
        return self._run(method, path, lambda *a, **k: self._fs.call_s3(method, *a, **k), args, kwargs)

    def count(self, op: str, path: str = "*") -> int:
        return sum(1 for o, p, _ in self.calls if o == op and fnmatch.fnmatchcase(p, path))

    def _pick(self, op: str, path: str, kwargs: dict) -> Fault | None:
        with self._lock:
            self.calls.append((op, path, frozenset(kwargs)))
            for fault in self.faults:
                if fault.matches(op, path):
                    fault.seen += 1
                    if fault.seen > fault.skip and (fault.times < 0 or fault.fired < fault.times):
                        fault.fired += 1
                        return fault
        return None

    def _run(self, op: str, path: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        fault = self._pick(op, path, kwargs)
        if fault is not None and fault.kind not in ("truncate", "short", "lost"):
            raise make_error(fault.kind, op)
        if fault is not None and fault.kind in ("truncate", "short"):
            args, kwargs = _halve_body(args, kwargs)
        with self._lock:
            self._active[op] += 1
            self.peak[op] = max(self.peak[op], self._active[op])
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            result = fn(*args, **kwargs)
        finally:
            with self._lock:
                self._active[op] -= 1
        if fault is not None and fault.kind in ("truncate", "lost"):
            raise make_error("reset", op)
        return result


def _halve_body(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if "Body" in kwargs:
        body = kwargs["Body"]
        return args, {**kwargs, "Body": bytes(body[: len(body) // 2])}
    if len(args) >= 2:  # pipe_file(path, value)
        return (args[0], bytes(args[1][: len(args[1]) // 2]), *args[2:]), kwargs
    raise ValueError("truncate/short faults apply to calls that carry a body (put_object, upload_part, pipe_file)")


def inject(storage: FsspecStorage, *faults: Fault, latency_s: float = 0.0) -> FaultyFS:
    """Wrap `storage`'s filesystem in a FaultyFS (all later calls go through it) and return the proxy."""
    proxy = FaultyFS(storage.endpoint.fs, *faults, latency_s=latency_s)
    storage.endpoint.fs = proxy
    return proxy


class HeldUploads:
    """Wraps the remote tier's real filesystem: calls naming `needle` wait until `open()`."""

    def __init__(self, fs: Any, needle: str) -> None:
        self._fs, self.needle = fs, needle
        self.opened, self.waiting = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if any(self.needle in str(a) for a in (*args, *kwargs.values())):
                self.waiting.set()
                self.opened.wait(120)
            return attr(*args, **kwargs)

        return call


def waiting_for_upload(thread: threading.Thread, step: int) -> bool:
    """Whether `thread` is blocked waiting for the upload of `step` (its UploadJob's wait(), under the manager's wait())."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "wait" else None
        if type(owner).__name__ == "UploadJob" and owner.step == step:
            return True
        frame = frame.f_back
    return False
