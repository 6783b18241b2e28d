"""Remote tier: any fsspec filesystem behind the Storage protocol (s3:// natively; memory://, file://, others generically).

Layer: storage (I/O). FsspecStorage is composed of an Endpoint (the filesystem and every request,
under the retry wrapper: endpoint.py, retry.py) and Transfers (part size, parallelism, pacing:
upload.py); this module holds only how each backend keeps the Storage protocol's promises.

Atomicity, per backend: nothing partial is ever visible under a final name.
- s3: an object appears whole when its PutObject or CompleteMultipartUpload succeeds. Streams and
  `upload_file` upload parts in parallel as one multipart upload, completed on close() after the
  size of every part on the server is checked (ListParts); abort() aborts the upload. An exclusive
  put is PutObject with `If-None-Match: *`: S3 itself refuses a second creator, atomically, across
  machines. A retried create that finds an object with exactly its own bytes counts as created (its
  first attempt landed but the response was lost).
- memory: put replaces the object in one step; streams write `<name>.tmp-<token>` and move it on
  close; an exclusive put checks and creates under one process-wide lock (the memory filesystem lives
  in this process, so the lock covers every writer).
- file and any other filesystem: write `<name>.tmp-<token>`, then rename it over the final name
  (file://: fsync the file, then the directory). An exclusive put on file:// hard-links the temporary
  to the final name, which fails if it exists; elsewhere it is check-then-write and
  `supports_conditional_create` is False (not safe against a concurrent writer).

Every request runs under a RetryPolicy and errors are translated once (retry.Retrying). Each
FsspecStorage builds its own filesystem instance. Credentials never appear in `url`, repr or any message.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import threading
from concurrent.futures import wait
from typing import Any, Callable, Mapping

from fsspec.core import split_protocol

from checkpointing.errors import CheckpointConfigError
from checkpointing.storage import base, listing, sizes
from checkpointing.storage.endpoint import S3_PROTOCOLS, open_endpoint
from checkpointing.storage.redact import redact_url
from checkpointing.storage.retry import RetryPolicy
from checkpointing.storage.transfers import Transfers
from checkpointing.storage.upload import S3Stream, TempStream, open_stream, put_object, upload_file

MiB = 1 << 20
S3_MAX_PUT = 5 << 30  # the largest single PutObject
_MEMORY_LOCK = threading.Lock()  # exclusive create on memory://: the store is this process's


class FsspecStorage:
    """A tier at an fsspec URL; see the module docstring for how each backend keeps writes atomic.

    `storage_options` go to the fsspec filesystem (s3: endpoint_url, key, secret, token,
    client_kwargs, config_kwargs...). Uploads run `max_concurrency` parts of `part_bytes` at a time,
    paced to `max_bytes_per_s` if set. `retry`: the policy for transient errors (settable later). `own_loop`: an
    async filesystem (s3fs) runs on an event loop of this storage's own, on the thread `ckpt-remote-io`, not on
    fsspec's loop shared by the process (storage/ioloop.py; the manager's remote tier). close() stops the upload threads.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_concurrency: int = 8,
        part_bytes: int = 64 * MiB,
        max_bytes_per_s: float | None = None,
        retry: RetryPolicy = RetryPolicy(),
        own_loop: bool = False,
    ) -> None:
        protocol, _ = split_protocol(url)
        self.url = redact_url(url.rstrip("/") if not url.endswith("://") else url)
        if not protocol:
            raise CheckpointConfigError(f"{self.url!r} is not a URL: use LocalStorage for a directory, or file://")
        self.transfers = Transfers(self.url, is_s3=protocol in S3_PROTOCOLS, part_bytes=part_bytes,
                                   max_concurrency=max_concurrency, max_bytes_per_s=max_bytes_per_s)
        self.endpoint = open_endpoint(url, protocol, self.url, storage_options, retry=retry, max_concurrency=max_concurrency,
                                      own_loop=own_loop)
        self._reopen = functools.partial(open_endpoint, url, protocol, self.url, storage_options, max_concurrency=max_concurrency)
        self.protocol, self.is_s3, self.root = protocol, self.endpoint.is_s3, self.endpoint.root
        self.supports_conditional_create = self.is_s3 or self.endpoint.is_local or self.endpoint.is_memory

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    @property
    def retry(self) -> RetryPolicy:
        """The policy of the retry wrapper; setting it applies to every later request."""
        return self.endpoint.retrying.policy

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self.endpoint.retrying = dataclasses.replace(self.endpoint.retrying, policy=policy)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem every request goes to."""
        return self.endpoint.fs

    @property
    def part_bytes(self) -> int:
        return self.transfers.part_bytes

    @property
    def max_concurrency(self) -> int:
        return self.transfers.max_concurrency

    def on_io_thread(self, hook: Callable[[], None]) -> None:
        """Run `hook` on every thread that does this storage's I/O from now on: the transfer pool's
        threads (the pool restarts with the next transfer), and with own_loop the event loop's thread
        (now) and its executor's. Without own_loop, fsspec's shared loop thread is not among them."""
        self.transfers.hooks.add(hook)
        self.transfers.close()  # threads started before the hook was added: they end; new ones run it
        if self.endpoint.ioloop is not None:
            self.endpoint.ioloop.on_thread(hook)

    def close(self, *, final: bool = False) -> None:
        """Stop the upload threads (after their uploads). With `final` (a manager's close()) its own event loop and threads
        stop too (their hooks refer to it); later requests (a closed manager's tiers()) use fsspec's shared loop."""
        self.transfers.close()
        if final and self.endpoint.ioloop is not None:
            self.endpoint.ioloop.close()
            self.endpoint = self._reopen(retry=self.retry)

    # ------------------------------------------------------------ Storage protocol

    def makedirs(self, path: str) -> None:
        """Directories exist only on file://; object stores create prefixes with their first object."""
        ep = self.endpoint
        if ep.is_local:
            ep.request("mkdir", path, lambda: ep.fs.makedirs(ep.full(path), exist_ok=True))

    def open_stream(self, path: str) -> S3Stream | TempStream:
        return open_stream(self.endpoint, self.transfers, path)

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> None:
        # durable=False changes nothing here: an object store's put is durable, file:// keeps its fsyncs
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        if self.is_s3:
            self._put_s3(path, body, exclusive)
            return
        self.transfers.pace(len(body))
        if self.endpoint.is_memory:
            self._put_memory(path, body, exclusive)
        else:
            self._put_renamed(path, body, exclusive)

    def _put_s3(self, path: str, body: bytes | bytearray, exclusive: bool) -> None:
        """One PutObject (If-None-Match: * when exclusive), or a multipart upload above one part."""
        if exclusive:
            self._s3_create(path, body)
        elif len(body) > self.part_bytes:
            stream = S3Stream(self.endpoint, self.transfers, path)
            try:
                stream.write(memoryview(body))
                stream.close()
            except BaseException:
                stream.abort()
                raise
        else:
            put_object(self.endpoint, self.transfers, path, body)

    def _put_memory(self, path: str, body: bytes | bytearray, exclusive: bool) -> None:
        """memory://: one step, under the process-wide lock when exclusive."""
        ep = self.endpoint
        full = ep.full(path)
        if exclusive:
            ep.request("create", path, lambda: _memory_create(ep.fs, full, body))
        else:
            ep.request("put", path, lambda: ep.fs.pipe_file(full, body))

    def _put_renamed(self, path: str, body: bytes | bytearray, exclusive: bool) -> None:
        """file:// and others: a temporary renamed (exclusive on file://: hard-linked) over the final name."""
        ep = self.endpoint
        full = ep.full(path)
        if exclusive and not ep.is_local and ep.fs.exists(full):
            raise FileExistsError(f"{ep.where(path)} already exists (check-then-write: no conditional create here)")
        tmp = ep.write_temp(path, body)
        try:
            if exclusive and ep.is_local:
                ep.request("create", path, lambda: ep.fs.link(tmp, full))  # EEXIST: never replaces an object
                ep.discard(tmp)
            else:
                ep.request("rename", path, lambda: ep.fs.mv(tmp, full))
        except BaseException:
            ep.discard(tmp)
            raise
        ep.sync_parent(full)

    def _s3_create(self, path: str, body: bytes | bytearray) -> None:
        ep = self.endpoint
        if len(body) > S3_MAX_PUT:
            raise CheckpointConfigError(f"exclusive put of {len(body)} bytes to {ep.where(path)}: at most 5 GiB")
        attempts = 0

        def create() -> Any:
            nonlocal attempts
            attempts += 1
            return ep.s3_once("put_object", Key=ep.key(path), Body=body, IfNoneMatch="*")

        self.transfers.pace(len(body))
        try:
            ep.request("create", path, create)
        except FileExistsError:
            if attempts > 1 and self.get(path) == body:
                return  # an earlier attempt of ours created it; only its response was lost
            raise

    def get(self, path: str, *, max_bytes: int | None = None) -> bytes:
        ep = self.endpoint
        # newer s3fs splits a read into concurrent ranged GETs after a HEAD: ask for one plain GET
        kwargs: dict = {"max_concurrency": 1} if self.is_s3 and _cat_takes_concurrency(type(ep.fs)) else {}
        if max_bytes is not None and (n := self.size(path)) > max_bytes:  # a HEAD first: never GET a huge object whole
            raise base.too_large(ep.where(path), n, max_bytes)
        data = bytes(ep.request("read", path, lambda: ep.fs.cat_file(ep.full(path), **kwargs, **ep.deadline(max_bytes or 64 * MiB))))
        if max_bytes is not None and len(data) > max_bytes:
            raise base.too_large(ep.where(path), len(data), max_bytes)
        return data

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Read len(buf) bytes at `offset`; a range larger than part_bytes is fetched as parallel ranged GETs."""
        view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        n, part = len(view), self.part_bytes
        if n == 0:
            self.size(path)  # a missing object is an error even for an empty read
            return
        if n <= part or self.max_concurrency == 1:
            self._read_range(path, offset, view)
            return
        pool = self.transfers.executor()
        futures = [pool.submit(self._read_range, path, offset + o, view[o : o + part]) for o in range(0, n, part)]
        wait(futures)  # every range lands (or fails) before the buffer is handed back
        for fut in futures:
            fut.result()

    def _read_range(self, path: str, offset: int, view: memoryview) -> None:
        ep = self.endpoint
        n = len(view)
        data = ep.request("read", path, lambda: ep.fs.cat_file(ep.full(path), start=offset, end=offset + n, **ep.deadline(n)))
        if len(data) < n:
            raise EOFError(f"{ep.where(path)} ends at byte {offset + len(data)}, {n - len(data)} bytes short")
        view[:] = data[:n]

    def _stat(self, path: str) -> dict[str, Any]:
        """What the store says about the object `path` (s3: HeadObject; elsewhere fsspec's info)."""
        ep = self.endpoint
        if self.is_s3:
            return ep.s3("stat", path, "head_object", Key=ep.key(path))
        return ep.request("stat", path, lambda: ep.fs.info(ep.full(path)))

    def size(self, path: str) -> int:
        info = self._stat(path)
        if self.is_s3:
            return int(info["ContentLength"])
        if info.get("type") != "file":
            raise FileNotFoundError(f"{self.endpoint.where(path)}: no such object (a directory)")
        return int(info["size"])

    def sizes(self, paths: list[str]) -> dict[str, int | None]:
        return sizes.listed_or_one_by_one(self, paths, functools.partial(sizes.listed, self.endpoint))

    def mtime(self, path: str) -> float:
        """Seconds since the epoch of the object's last change (0.0 where the filesystem keeps no time)."""
        info = self._stat(path)
        if self.is_s3:
            return info["LastModified"].timestamp()
        for key in ("mtime", "LastModified", "created"):
            value = info.get(key)
            if hasattr(value, "timestamp"):
                return value.timestamp()
            if isinstance(value, (int, float)):
                return float(value)
        return 0.0

    def exists_with_size(self, path: str, nbytes: int) -> bool:
        return base.exists_with_size(self, path, nbytes)

    def list(self, prefix: str = "") -> list[str]:
        if self.is_s3:
            return sorted(self._s3_names(prefix, delimiter=True))
        full = self.endpoint.full(prefix)
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.endpoint.ls(prefix) if e["name"].rstrip("/") != full}
        return sorted(names)

    def list_dirs(self, prefix: str = "", *, only: Callable[[str], bool] = lambda name: True) -> dict[str, list[str]]:
        """Storage.list_dirs; on S3 one listing of every key below `prefix` (1,000 a request), not a request per directory."""
        return listing.grouped(self._s3_names(prefix, delimiter=False), only) if self.is_s3 else listing.dir_by_dir(self, prefix, only)

    def _s3_names(self, prefix: str, *, delimiter: bool) -> set[str]:
        """Names below `prefix`: immediate children (delimiter) or every key, relative to `prefix/`."""
        names: set[str] = set()
        for under, page in self.endpoint.s3_listing(prefix, delimiter=delimiter):
            names.update(p["Prefix"][len(under) :].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(under) :] for o in page.get("Contents", []))
        names.discard("")
        return names

    def delete(self, path: str) -> None:
        ep = self.endpoint
        if self.is_s3:
            key = ep.key(path)
            keys = [f"{key}/{n}" if key else n for n in sorted(self._s3_names(path, delimiter=False))]
            keys += [key] if key else []
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                out = ep.s3("delete", path, "delete_objects", Delete=batch)
                if out.get("Errors"):
                    err = out["Errors"][0]
                    raise ep.translate(_ServiceError(err.get("Code"), err.get("Message")), "delete", path)
            return
        full = ep.full(path)
        try:
            ep.request("delete", path, lambda: ep.fs.rm(full, recursive=True))
        except FileNotFoundError:
            return
        ep.sync_parent(full)

    def remove_dir(self, path: str) -> None:
        ep = self.endpoint
        if self.is_s3:  # no directories: only a stray object of exactly that name
            if path and not self._s3_names(path, delimiter=False):
                try:
                    ep.s3("delete", path, "delete_object", Key=ep.key(path))
                except FileNotFoundError:
                    pass
            return
        full = ep.full(path)
        try:
            info = ep.fs.info(full)
        except (FileNotFoundError, OSError):
            return
        try:
            if info.get("type") == "directory":
                if not ep.fs.ls(full):
                    ep.fs.rmdir(full)
            else:
                ep.fs.rm(full)
        except OSError:  # not empty (any more), or gone
            return
        ep.sync_parent(full)

    # ------------------------------------------------------------ whole local files (the upload pipeline)

    def upload_file(self, local_path: str | os.PathLike, dest: str, length: int | None = None) -> None:
        """Upload the first `length` bytes (default: all) of a local file as the object `dest`.

        s3: one PutObject up to `part_bytes`, else a parallel multipart upload whose parts are read
        with os.pread when their turn comes (memory: about max_concurrency * part_bytes), each part
        retried on its own. Elsewhere: streamed through open_stream.
        """
        upload_file(self.endpoint, self.transfers, local_path, dest, length)


class _ServiceError(Exception):
    """An error reported inside a 200 response (DeleteObjects), shaped like botocore's for classify()."""

    def __init__(self, code: str | None, message: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.response = {"Error": {"Code": code, "Message": message}}


def _memory_create(fs: Any, full: str, body: bytes | bytearray) -> None:
    with _MEMORY_LOCK:
        if fs.exists(full):
            raise FileExistsError(full)
        fs.pipe_file(full, body)


@functools.lru_cache(maxsize=None)
def _cat_takes_concurrency(fs_type: type) -> bool:
    """Whether this s3fs's cat_file takes max_concurrency (newer s3fs; older ones always GET once, with no HEAD)."""
    try:
        return "max_concurrency" in inspect.signature(getattr(fs_type, "_cat_file")).parameters
    except (AttributeError, TypeError, ValueError):
        return False
