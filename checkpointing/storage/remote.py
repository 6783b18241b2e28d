"""Remote tier: any fsspec filesystem behind the Storage protocol (s3:// natively; memory://, file://, others generically).

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

Every request runs under a RetryPolicy and errors are translated once (retry.translate). The SDK's own
retries are switched off (s3fs retries=1, botocore total_max_attempts=1) so one policy decides.
Each FsspecStorage builds its own filesystem instance (skip_instance_cache): no state shared with
other fsspec users. Credentials never appear in `url`, repr or any message.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Mapping, TypeVar

import fsspec
from fsspec.core import split_protocol

from checkpointing.errors import CheckpointConfigError
from checkpointing.format.naming import new_token
from checkpointing.storage.retry import RetryPolicy, redact, redact_url, retry_call, secret_values, translate
from checkpointing.storage.upload import S3_MIN_PART, S3Stream, TempStream, Throttle, upload_file

log = logging.getLogger("checkpointing")
T = TypeVar("T")

MiB = 1 << 20
S3_MAX_PUT = 5 << 30  # the largest single PutObject
_S3 = ("s3", "s3a")
_LOCAL = ("file", "local")
_MEMORY = ("memory",)
_MEMORY_LOCK = threading.Lock()  # exclusive create on memory://: the store is this process's


class FsspecStorage:
    """A tier at an fsspec URL; see the module docstring for how each backend keeps writes atomic.

    `storage_options` go to the fsspec filesystem (s3: endpoint_url, key, secret, token,
    client_kwargs, config_kwargs...). Uploads run `max_concurrency` parts of `part_bytes` at a time,
    paced to `max_bytes_per_s` if set. Call close() to stop the upload threads.
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
    ) -> None:
        protocol, _ = split_protocol(url)
        self.url = redact_url(url.rstrip("/") if not url.endswith("://") else url)
        if not protocol:
            raise CheckpointConfigError(f"{self.url!r} is not a URL: use LocalStorage for a directory, or file://")
        self.protocol = protocol
        self.is_s3 = protocol in _S3
        _check_sizes(self.url, max_concurrency, part_bytes, max_bytes_per_s, self.is_s3)
        self.max_concurrency, self.part_bytes, self.retry = max_concurrency, part_bytes, retry
        self._secrets = secret_values(storage_options, url)
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise CheckpointConfigError(
                f"no filesystem for {protocol}:// ({exc}); install its fsspec package (s3fs for s3://)"
            ) from None
        options = _default_options(protocol, max_concurrency, storage_options or {})
        options.update({k: v for k, v in cls._get_kwargs_from_urls(url).items() if k not in options})
        try:
            self.fs = cls(skip_instance_cache=True, **options)
        except Exception as exc:  # noqa: BLE001 - report it as a configuration problem, without secrets
            raise CheckpointConfigError(
                f"cannot open {self.url}: {redact(f'{type(exc).__name__}: {exc}', self._secrets)}; check storage_options"
            ) from None
        self.root = cls._strip_protocol(url).rstrip("/")
        if self.is_s3:
            self.fs.retries = 1  # our RetryPolicy is the only retry loop
            self._bucket, _, self._prefix = self.root.partition("/")
            if not self._bucket:
                raise CheckpointConfigError(f"{self.url!r} names no bucket: use s3://bucket/prefix")
        self.supports_conditional_create = protocol in _S3 + _LOCAL + _MEMORY
        self._pace = Throttle(max_bytes_per_s) if max_bytes_per_s else _no_pace
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # ------------------------------------------------------------ plumbing (also used by .upload)

    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _where(self, path: str) -> str:
        return f"{self.url}/{path}" if path else self.url

    def _key(self, path: str) -> str:
        return "/".join(p for p in (self._prefix, path) if p)

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        return retry_call(fn, self.retry, what=what, where=self._where(path), secrets=self._secrets)

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(method, Bucket=self._bucket, **kwargs)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="ckpt-upload")
            return self._pool

    def close(self) -> None:
        """Stop the upload threads (after the uploads they run). The storage stays usable."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _fsync_file(self, f: Any) -> None:
        """file://: make a written temporary durable before it is renamed into place."""
        if self.protocol in _LOCAL:
            f.flush()
            os.fsync(f.fileno())

    def _sync_parent(self, full: str) -> None:
        """file://: fsync the directory holding `full`, so a rename or link survives a power cut."""
        if self.protocol in _LOCAL:
            fd = os.open(os.path.dirname(full) or "/", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write_temp(self, path: str, body: bytes) -> str:
        """Write `body` to a fresh temporary beside `path` (fsynced on file://); returns its full path."""
        tmp = f"{self._full(path)}.tmp-{new_token()}"

        def write() -> None:
            with self.fs.open(tmp, "wb") as f:
                f.write(body)
                self._fsync_file(f)

        try:
            self._call("write", path, write)
        except BaseException:
            self._discard(tmp)
            raise
        return tmp

    def _discard(self, full: str) -> None:
        try:
            self.fs.rm(full)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except Exception as exc:  # noqa: BLE001 - cleanup of a temporary must not hide the real error
            log.warning("checkpointing: could not remove temporary %s: %s", self._where(full[len(self.root) + 1 :]),
                        redact(str(exc), self._secrets))

    # ------------------------------------------------------------ Storage protocol

    def makedirs(self, path: str) -> None:
        """Directories exist only on file://; object stores create prefixes with their first object."""
        if self.protocol in _LOCAL:
            self._call("mkdir", path, lambda: self.fs.makedirs(self._full(path), exist_ok=True))

    def open_stream(self, path: str) -> S3Stream | TempStream:
        if self.is_s3:
            return S3Stream(self, path)
        return TempStream(self, path)

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> None:
        # durable=False changes nothing here: an object store's put is durable, file:// keeps its fsyncs
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        if self.is_s3:
            if exclusive:
                self._s3_create(path, body)
            elif len(body) > self.part_bytes:
                stream = S3Stream(self, path)
                try:
                    stream.write(memoryview(body))
                    stream.close()
                except BaseException:
                    stream.abort()
                    raise
            else:
                self._pace(len(body))
                self._call("put", path, lambda: self._s3("put_object", Key=self._key(path), Body=body))
            return
        self._pace(len(body))
        full = self._full(path)
        if self.protocol in _MEMORY:
            if exclusive:
                self._call("create", path, lambda: _memory_create(self.fs, full, body))
            else:
                self._call("put", path, lambda: self.fs.pipe_file(full, body))
            return
        if exclusive and self.protocol not in _LOCAL and self.fs.exists(full):
            raise FileExistsError(f"{self._where(path)} already exists (check-then-write: no conditional create here)")
        tmp = self._write_temp(path, body)
        try:
            if exclusive and self.protocol in _LOCAL:
                self._call("create", path, lambda: self.fs.link(tmp, full))  # EEXIST: never replaces an object
                self._discard(tmp)
            else:
                self._call("rename", path, lambda: self.fs.mv(tmp, full))
        except BaseException:
            self._discard(tmp)
            raise
        self._sync_parent(full)

    def _s3_create(self, path: str, body: bytes) -> None:
        if len(body) > S3_MAX_PUT:
            raise CheckpointConfigError(f"exclusive put of {len(body)} bytes to {self._where(path)}: at most 5 GiB")
        attempts = 0

        def create() -> Any:
            nonlocal attempts
            attempts += 1
            return self._s3("put_object", Key=self._key(path), Body=body, IfNoneMatch="*")

        self._pace(len(body))
        try:
            self._call("create", path, create)
        except FileExistsError:
            if attempts > 1 and self.get(path) == body:
                return  # an earlier attempt of ours created it; only its response was lost
            raise

    def get(self, path: str) -> bytes:
        kwargs = {"max_concurrency": 1} if self.is_s3 else {}  # s3fs: one GET, no HEAD first
        return bytes(self._call("read", path, lambda: self.fs.cat_file(self._full(path), **kwargs)))

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Read len(buf) bytes at `offset`; a range larger than part_bytes is fetched as parallel ranged GETs."""
        view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        n = len(view)
        if n == 0:
            self.size(path)  # a missing object is an error even for an empty read
            return
        if n <= self.part_bytes or self.max_concurrency == 1:
            self._read_range(path, offset, view)
            return
        pool = self._executor()
        futures = [pool.submit(self._read_range, path, offset + o, view[o : o + self.part_bytes]) for o in range(0, n, self.part_bytes)]
        wait(futures)  # every range lands (or fails) before the buffer is handed back
        for fut in futures:
            fut.result()

    def _read_range(self, path: str, offset: int, view: memoryview) -> None:
        n = len(view)
        data = self._call("read", path, lambda: self.fs.cat_file(self._full(path), start=offset, end=offset + n))
        if len(data) < n:
            raise EOFError(f"{self._where(path)} ends at byte {offset + len(data)}, {n - len(data)} bytes short")
        view[:] = data[:n]

    def size(self, path: str) -> int:
        if self.is_s3:
            head = self._call("stat", path, lambda: self._s3("head_object", Key=self._key(path)))
            return int(head["ContentLength"])
        info = self._call("stat", path, lambda: self.fs.info(self._full(path)))
        if info.get("type") != "file":
            raise FileNotFoundError(f"{self._where(path)}: no such object (a directory)")
        return int(info["size"])

    def mtime(self, path: str) -> float:
        """Seconds since the epoch of the object's last change (not part of the protocol: gc's age filter)."""
        if self.is_s3:
            head = self._call("stat", path, lambda: self._s3("head_object", Key=self._key(path)))
            return head["LastModified"].timestamp()
        info = self._call("stat", path, lambda: self.fs.info(self._full(path)))
        for key in ("mtime", "LastModified", "created"):
            value = info.get(key)
            if hasattr(value, "timestamp"):
                return value.timestamp()
            if isinstance(value, (int, float)):
                return float(value)
        return 0.0

    def exists_with_size(self, path: str, nbytes: int) -> bool:
        """Whether `path` exists with exactly `nbytes` (an upload that completed: objects appear whole)."""
        try:
            return self.size(path) == nbytes
        except FileNotFoundError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        if self.is_s3:
            return sorted(self._s3_names(prefix, delimiter=True))
        full = self._full(prefix)
        try:
            entries = self._call("list", prefix, lambda: self.fs.ls(full, detail=True))
        except FileNotFoundError:
            return []
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["name"].rstrip("/") != full}
        return sorted(names)

    def _s3_names(self, prefix: str, *, delimiter: bool) -> set[str]:
        """Names below `prefix`: immediate children (delimiter) or every key, relative to `prefix/`."""
        base = self._key(prefix)
        base = f"{base}/" if base else ""
        query: dict[str, Any] = {"Prefix": base, **({"Delimiter": "/"} if delimiter else {})}
        names: set[str] = set()
        while True:
            page = self._call("list", prefix, lambda: self._s3("list_objects_v2", **query))
            names.update(p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(base) :] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                break
            query["ContinuationToken"] = page["NextContinuationToken"]
        names.discard("")
        return names

    def delete(self, path: str) -> None:
        if self.is_s3:
            key = self._key(path)
            keys = [f"{key}/{n}" if key else n for n in sorted(self._s3_names(path, delimiter=False))]
            keys += [key] if key else []
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
                out = self._call("delete", path, lambda: self._s3("delete_objects", Delete=batch))
                if out.get("Errors"):
                    err = out["Errors"][0]
                    raise translate(_ServiceError(err.get("Code"), err.get("Message")), what="delete", where=self._where(path),
                                    secrets=self._secrets)
            return
        full = self._full(path)
        try:
            self._call("delete", path, lambda: self.fs.rm(full, recursive=True))
        except FileNotFoundError:
            return
        self._sync_parent(full)

    def remove_dir(self, path: str) -> None:
        if self.is_s3:  # no directories: only a stray object of exactly that name
            if path and not self._s3_names(path, delimiter=False):
                try:
                    self._call("delete", path, lambda: self._s3("delete_object", Key=self._key(path)))
                except FileNotFoundError:
                    pass
            return
        full = self._full(path)
        try:
            info = self.fs.info(full)
        except (FileNotFoundError, OSError):
            return
        try:
            if info.get("type") == "directory":
                if not self.fs.ls(full):
                    self.fs.rmdir(full)
            else:
                self.fs.rm(full)
        except OSError:  # not empty (any more), or gone
            return
        self._sync_parent(full)

    # ------------------------------------------------------------ whole local files (the upload pipeline)

    def upload_file(self, local_path: str | os.PathLike, dest: str, length: int | None = None) -> None:
        """Upload the first `length` bytes (default: all) of a local file as the object `dest`.

        s3: one PutObject up to `part_bytes`, else a parallel multipart upload whose parts are read
        with os.pread when their turn comes (memory: about max_concurrency * part_bytes), each part
        retried on its own. Elsewhere: streamed through open_stream.
        """
        upload_file(self, local_path, dest, length)


def _no_pace(nbytes: int) -> None:
    return None


class _ServiceError(Exception):
    """An error reported inside a 200 response (DeleteObjects), shaped like botocore's for classify()."""

    def __init__(self, code: str | None, message: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.response = {"Error": {"Code": code, "Message": message}}


def _memory_create(fs: Any, full: str, body: bytes) -> None:
    with _MEMORY_LOCK:
        if fs.exists(full):
            raise FileExistsError(full)
        fs.pipe_file(full, body)


def _default_options(protocol: str, max_concurrency: int, user: Mapping[str, Any]) -> dict[str, Any]:
    """storage_options with our defaults underneath: one retry loop (ours), no listing cache, enough connections."""
    options = dict(user)
    if protocol in _S3:
        options.setdefault("use_listings_cache", False)
        config = {"retries": {"total_max_attempts": 1}, "max_pool_connections": max(10, 2 * max_concurrency)}
        options["config_kwargs"] = {**config, **dict(user.get("config_kwargs") or {})}
    elif protocol in _LOCAL:
        options.setdefault("auto_mkdir", True)
    return options


def _check_sizes(url: str, max_concurrency: int, part_bytes: int, max_bytes_per_s: float | None, is_s3: bool) -> None:
    if max_concurrency < 1:
        raise CheckpointConfigError(f"max_concurrency={max_concurrency} for {url}: must be >= 1")
    minimum = S3_MIN_PART if is_s3 else 1
    if part_bytes < minimum:
        raise CheckpointConfigError(f"part_bytes={part_bytes} for {url}: must be >= {minimum} (S3 parts are at least 5 MiB)")
    if max_bytes_per_s is not None and max_bytes_per_s <= 0:
        raise CheckpointConfigError(f"max_bytes_per_s={max_bytes_per_s} for {url}: must be > 0, or None for no limit")
