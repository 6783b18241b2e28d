"""Where a remote tier lives and how every request reaches it: what FsspecStorage and its streams share.

Layer: storage (I/O). An Endpoint holds the fsspec filesystem, where names go on it (the root; on S3
the bucket and the key prefix), the URL shown in messages (credentials redacted), and the retry
wrapper (retry.Retrying) that every request runs under: `request` retries transient errors and
translates the rest once, so nothing above it retries or translates again. It also knows the few
durability steps file:// needs (fsync a written temporary, then its directory) and how to discard a
temporary. remote.py (the Storage protocol) and upload.py (multipart uploads, streams) both work
through it; neither reaches into the other.

`open_endpoint` builds the filesystem: our defaults under the caller's storage_options, its own
instance (skip_instance_cache: no state shared with other fsspec users), the SDK's own retries
switched off (s3fs retries=1, botocore total_max_attempts=1) so that one policy decides; with
`own_loop`, an async filesystem (s3fs) runs on an event loop of its own (`ioloop`, storage/ioloop.py)
instead of fsspec's loop shared with every other async filesystem in the process.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import os
from typing import Any, Callable, Iterator, Mapping, TypeVar

import fsspec

from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import new_token
from checkpointing.storage.ioloop import IoLoop
from checkpointing.storage.redact import secret_values
from checkpointing.storage.retry import RetryPolicy, Retrying

log = logging.getLogger("checkpointing")
T = TypeVar("T")

S3_PROTOCOLS = ("s3", "s3a")
LOCAL_PROTOCOLS = ("file", "local")
MEMORY_PROTOCOLS = ("memory",)


class Endpoint:
    """One remote location. `fs` may be replaced (tests wrap it to inject faults): requests read it when they run."""

    def __init__(self, fs: Any, *, url: str, protocol: str, root: str, retrying: Retrying, ioloop: IoLoop | None = None) -> None:
        self.fs, self.url, self.protocol, self.root, self.retrying = fs, url, protocol, root, retrying
        self.ioloop = ioloop  # the filesystem's own event loop (open_endpoint's own_loop), else None
        self.is_s3 = protocol in S3_PROTOCOLS
        self.is_local = protocol in LOCAL_PROTOCOLS  # file://: the only one with fsync and directories
        self.is_memory = protocol in MEMORY_PROTOCOLS
        self.bucket, _, self.prefix = root.partition("/") if self.is_s3 else ("", "", "")

    # ------------------------------------------------------------ names

    def full(self, path: str) -> str:
        """`path` as the filesystem names it."""
        return f"{self.root}/{path}" if path else self.root

    def where(self, path: str) -> str:
        """`path` as messages show it (the redacted URL)."""
        return f"{self.url}/{path}" if path else self.url

    def key(self, path: str) -> str:
        """`path` as an S3 key in the bucket."""
        return "/".join(p for p in (self.prefix, path) if p)

    # ------------------------------------------------------------ requests, through the retry wrapper

    def request(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """`fn()` (one request, safe to repeat) under the retry wrapper; `what` names it in messages."""
        return self.retrying(what, self.where(path), fn)

    def s3(self, what: str, path: str, method: str, **kwargs: Any) -> Any:
        """One S3 API call (`method` of botocore's client) on this bucket, through `request`."""
        return self.request(what, path, lambda: self.s3_once(method, **kwargs))

    def ls(self, path: str) -> list[dict[str, Any]]:
        """fsspec's detailed listing of the directory `path` (not S3: see s3_listing); [] if it is missing."""
        full = self.full(path)
        try:
            return self.request("list", path, lambda: self.fs.ls(full, detail=True))
        except FileNotFoundError:
            return []

    def s3_listing(self, path: str, *, delimiter: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        """The pages of ListObjectsV2 below `path/` (its immediate children with `delimiter`, else
        every key), each with the key prefix its names are relative to."""
        key = self.key(path)
        under = f"{key}/" if key else ""
        query: dict[str, Any] = {"Prefix": under, **({"Delimiter": "/"} if delimiter else {})}
        while True:
            page = self.s3("list", path, "list_objects_v2", **query)
            yield under, page
            if not page.get("IsTruncated"):
                return
            query["ContinuationToken"] = page["NextContinuationToken"]

    def s3_once(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call on this bucket, not retried: for a caller that wraps it in `request` itself."""
        body = kwargs.get("Body")
        return self.fs.call_s3(method, Bucket=self.bucket, **kwargs, **self.deadline(len(body) if body is not None else 0))

    def deadline(self, nbytes: int = 0) -> dict[str, float]:
        """`timeout=` for one request of an asynchronous filesystem (fsspec's sync() cancels it past that and raises a
        TimeoutError, which the retry wrapper takes for transient); nothing for a synchronous one."""
        return {"timeout": self.retrying.policy.deadline_s(nbytes)} if getattr(self.fs, "async_impl", False) else {}

    def translate(self, exc: Exception, what: str, path: str) -> BaseException:
        """The exception to raise for `exc` when it did not come from a request (a stream's write)."""
        return self.retrying.translate(exc, what=what, where=self.where(path))

    def redact(self, text: str) -> str:
        return self.retrying.redact(text)

    # ------------------------------------------------------------ temporaries and durability (file://)

    def fsync_file(self, f: Any) -> None:
        """file://: make a written temporary durable before it is renamed into place."""
        if self.is_local:
            f.flush()
            os.fsync(f.fileno())

    def sync_parent(self, full: str) -> None:
        """file://: fsync the directory holding `full`, so a rename or link survives a power cut."""
        if self.is_local:
            fd = os.open(os.path.dirname(full) or "/", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def temp_name(self, path: str) -> str:
        """A fresh temporary beside `path` (full name): `<name>.tmp-<token>`."""
        return f"{self.full(path)}.tmp-{new_token()}"

    def write_temp(self, path: str, body: bytes) -> str:
        """Write `body` to a fresh temporary beside `path` (fsynced on file://); returns its full name."""
        tmp = self.temp_name(path)

        def write() -> None:
            with self.fs.open(tmp, "wb") as f:
                f.write(body)
                self.fsync_file(f)

        try:
            self.request("write", path, write)
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def discard(self, full: str) -> None:
        """Remove a temporary (full name); a failure is logged, never raised: cleanup must not hide the real error."""
        try:
            self.fs.rm(full)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except Exception as exc:  # noqa: BLE001 - cleanup of a temporary must not hide the real error
            log.warning("checkpointing: could not remove temporary %s: %s", self.where(full[len(self.root) + 1 :]),
                        self.redact(str(exc)))


def open_endpoint(url: str, protocol: str, shown: str, storage_options: Mapping[str, Any] | None, *,
                  retry: RetryPolicy, max_concurrency: int, own_loop: bool = False) -> Endpoint:
    """The Endpoint at `url` (`shown`: the URL redacted); CheckpointConfigError, saying how to fix it, if it cannot be opened."""
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointConfigError(f"storage_options must be a dict of fsspec options (e.g. {{'endpoint_url': ...}}), "
                                    f"not a {type(storage_options).__name__}")
    secrets = secret_values(storage_options, url)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        if protocol in S3_PROTOCOLS:
            raise CheckpointConfigError(
                f"{shown}: the remote tier on {protocol}:// needs s3fs, which is not installed: "
                "pip install 'tiered-checkpointing[s3]'"
            ) from None
        raise CheckpointConfigError(
            f"no filesystem for {protocol}:// ({exc}); install its fsspec package"
        ) from None
    if protocol in LOCAL_PROTOCOLS and not url.partition("://")[2].startswith("/"):
        raise CheckpointConfigError(f"{shown!r} names a relative path, which would lie under the current directory: "
                                    f"use file:///absolute/path (three slashes)")
    if protocol in S3_PROTOCOLS:
        _check_s3_options(cls, shown, storage_options or {})
    options = _default_options(protocol, max_concurrency, storage_options or {})
    options.update({k: v for k, v in cls._get_kwargs_from_urls(url).items() if k not in options})
    retrying = Retrying(retry, secrets)
    ioloop = IoLoop() if own_loop and getattr(cls, "async_impl", False) and "loop" not in options else None
    if ioloop is not None:
        options["loop"] = ioloop.loop
    try:
        fs = cls(skip_instance_cache=True, **options)
    except Exception as exc:  # noqa: BLE001 - report it as a configuration problem, without secrets
        if ioloop is not None:
            ioloop.close()
        raise CheckpointConfigError(
            f"cannot open {shown}: {retrying.redact(f'{type(exc).__name__}: {exc}')}; check storage_options"
        ) from None
    if ioloop is not None:
        ioloop.at_close(functools.partial(_close_session, fs))
    endpoint = Endpoint(fs, url=shown, protocol=protocol, root=cls._strip_protocol(url).rstrip("/"), retrying=retrying, ioloop=ioloop)
    if endpoint.is_s3:
        fs.retries = 1  # our RetryPolicy is the only retry loop
        if not endpoint.bucket:
            raise CheckpointConfigError(f"{shown!r} names no bucket: use s3://bucket/prefix")
    return endpoint


async def _close_session(fs: Any) -> None:
    """Close the HTTP session s3fs opened on our own loop, on that loop (its own finalizer cannot
    once the loop has stopped); other async filesystems close theirs in their finalizers."""
    creator = getattr(fs, "_s3creator", None)
    if creator is not None:
        await creator.__aexit__(None, None, None)


def _check_s3_options(cls: Any, shown: str, options: Mapping[str, Any]) -> None:
    """A storage_options key s3fs would hand on to the botocore session fails at the first request, as a
    TypeError from inside s3fs: refuse it here, naming it (never a value) and what it may mean."""
    known = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "batch_size"}
    for fn in (cls.__init__, _session_init()):
        known |= {p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD and p.name != "self"}
    unknown = sorted(str(k) for k in options if k not in known)
    client = options.get("client_kwargs")
    if isinstance(client, Mapping):  # handed to botocore's create_client at the first request
        takes = {p.name for p in inspect.signature(_client_init()).parameters.values()
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("self", "service_name")}
        unknown += [f"client_kwargs.{k}" for k in sorted(map(str, client)) if takes and k not in takes]
        known |= {f"client_kwargs.{k}" for k in takes}
    if unknown:
        near = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        hints = "; ".join(f"{k!r}" + (f" (did you mean {near[k][0]!r}?)" if near[k] else "") for k in unknown)
        raise CheckpointConfigError(f"cannot open {shown}: storage_options has key(s) s3fs does not take: {hints}. "
                                    "It takes e.g. endpoint_url, key, secret, token, anon, client_kwargs, config_kwargs")


def _session_init() -> Any:
    """The botocore session's constructor, which s3fs hands its other keyword arguments to."""
    try:
        from aiobotocore.session import AioSession
    except ImportError:  # an s3fs of another make: nothing more is known
        return lambda: None
    return AioSession.__init__


def _client_init() -> Any:
    """botocore's create_client, which s3fs hands client_kwargs to (no parameters known: nothing is checked)."""
    try:
        from botocore.session import Session
    except ImportError:
        return lambda: None
    return Session.create_client


def _default_options(protocol: str, max_concurrency: int, user: Mapping[str, Any]) -> dict[str, Any]:
    """storage_options with our defaults underneath: one retry loop (ours), no listing cache, enough connections."""
    options = dict(user)
    if protocol in S3_PROTOCOLS:
        options.setdefault("use_listings_cache", False)
        config = {"retries": {"total_max_attempts": 1}, "max_pool_connections": max(10, 2 * max_concurrency)}
        options["config_kwargs"] = {**config, **dict(user.get("config_kwargs") or {})}
    elif protocol in LOCAL_PROTOCOLS:
        options.setdefault("auto_mkdir", True)
    return options
