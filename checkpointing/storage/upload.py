"""Writing large objects for FsspecStorage: S3 multipart uploads, temp-then-rename streams, pacing.

Layer: storage (I/O). Everything here works through two objects it is handed: an Endpoint (where the
tier is, and every request through the retry wrapper: endpoint.py) and Transfers (part size,
parallelism, pacing and the thread pool: transfers.py). It never sees FsspecStorage, which builds on it.

S3 multipart order: CreateMultipartUpload (lazily, with the first full part) -> UploadPart x N on the Transfers'
thread pool, at most `max_concurrency` in flight per upload (so memory stays near
max_concurrency * part_bytes) -> ListParts, checking every part's size against what was sent ->
CompleteMultipartUpload. The object appears under its name only at completion, whole. Any failure
aborts the upload (AbortMultipartUpload), and an aborted or crashed upload leaves nothing visible
(uploaded parts of an upload that is never completed are invisible; a bucket lifecycle rule
"abort incomplete multipart uploads" reclaims them after a crash).

Filesystems without multipart uploads (memory, file, ...) get TempStream: write `<name>.tmp-<token>`,
rename it over the final name on close. Every upload is paced by Transfers.pace.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable

from checkpointing.storage.endpoint import Endpoint
from checkpointing.storage.retry import ErrorInfo, ErrorKind, RemoteStorageError
from checkpointing.storage.transfers import Transfers

log = logging.getLogger("checkpointing")

S3_MAX_PARTS = 10_000


class _Aborted(Exception):
    """Stops parts that have not started yet once an upload is aborted."""


class Multipart:
    """One multipart upload of the object `path`; parts are submitted in order by one thread."""

    def __init__(self, endpoint: Endpoint, transfers: Transfers, path: str) -> None:
        self.endpoint, self.transfers, self.path, self.key = endpoint, transfers, path, endpoint.key(path)
        self.upload_id: str | None = None
        self.sent: dict[int, int] = {}  # part number -> bytes sent
        self.etags: dict[int, str] = {}
        self.futures: list[Future] = []
        self.slots = threading.BoundedSemaphore(transfers.max_concurrency)
        self.lock = threading.Lock()
        self.failure: BaseException | None = None

    def _s3(self, what: str, method: str, **kwargs: Any) -> Any:
        return self.endpoint.s3(what, self.path, method, Key=self.key, **kwargs)

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def submit(self, number: int, body: Callable[[], bytes | bytearray], size: int) -> None:
        """Upload part `number` (1-based) in the background; blocks while max_concurrency parts are in flight."""
        if number > S3_MAX_PARTS:
            raise OSError(errno.EFBIG, f"{self.endpoint.where(self.path)}: more than {S3_MAX_PARTS} parts; raise part_bytes")
        self._check()
        if self.upload_id is None:
            self.upload_id = self._s3("start upload", "create_multipart_upload")["UploadId"]
        self.slots.acquire()
        try:
            self._check()
            self.sent[number] = size
            self.futures.append(self.transfers.executor().submit(self._upload, number, body))
        except BaseException:
            self.slots.release()
            raise

    def _upload(self, number: int, body_fn: Callable[[], bytes | bytearray]) -> None:
        try:
            self._check()  # fail fast: no more parts once one has failed or the upload was aborted
            body = body_fn()
            self.transfers.pace(len(body))
            out = self._s3(f"upload part {number} of", "upload_part", UploadId=self.upload_id, PartNumber=number, Body=body)
            with self.lock:
                self.etags[number] = out["ETag"]
        except BaseException as exc:  # noqa: BLE001 - kept and raised by the submitting thread
            with self.lock:
                self.failure = self.failure or exc
        finally:
            self.slots.release()

    def complete(self) -> None:
        """Wait for every part, check their sizes on the server, then make the object visible."""
        wait(self.futures)
        self._check()
        self._verify()
        parts = [{"PartNumber": n, "ETag": self.etags[n]} for n in sorted(self.sent)]
        self._s3("complete upload", "complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        self.upload_id = None

    def _verify(self) -> None:
        """A part the server holds with another size than we sent (a truncated body) must never be completed."""
        stored: dict[int, int] = {}
        query: dict[str, Any] = {"UploadId": self.upload_id}
        while True:
            page = self._s3("check upload", "list_parts", **query)
            stored.update({p["PartNumber"]: int(p["Size"]) for p in page.get("Parts", [])})
            if not page.get("IsTruncated"):
                break
            query["PartNumberMarker"] = page["NextPartNumberMarker"]
        bad = [(n, size, stored.get(n)) for n, size in sorted(self.sent.items()) if stored.get(n) != size]
        if bad:
            n, size, got = bad[0]
            cause = OSError(errno.EIO, f"part {n} is {got} bytes on the server, {size} were sent ({len(bad)} bad part(s))")
            info = ErrorInfo(ErrorKind.PERMANENT, hint="the upload was damaged in transit and has been aborted; write it again")
            raise RemoteStorageError("upload", self.endpoint.where(self.path), cause, info, 1)

    def abort(self) -> None:
        """Stop and discard the upload (idempotent). Errors are logged: abort runs on failure paths."""
        with self.lock:
            self.failure = self.failure or _Aborted("upload aborted")
        for fut in self.futures:
            fut.cancel()
        wait(self.futures)  # parts still uploading would otherwise outlive the abort
        if self.upload_id is None:
            return
        upload_id, self.upload_id = self.upload_id, None
        try:
            self._s3("abort upload", "abort_multipart_upload", UploadId=upload_id)
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001 - the parts stay invisible; a lifecycle rule reclaims them
            log.warning("checkpointing: could not abort the multipart upload of %s: %s",
                        self.endpoint.where(self.path), self.endpoint.redact(str(exc)))


class S3Stream:
    """StreamWriter for S3: bytes are buffered into parts of part_bytes and uploaded as they fill.

    An object smaller than one part becomes a single PutObject at close(). Nothing is visible under
    the name until close() returns.
    """

    alignment = 1

    def __init__(self, endpoint: Endpoint, transfers: Transfers, path: str) -> None:
        self.endpoint, self.transfers, self.path = endpoint, transfers, path
        self.upload = Multipart(endpoint, transfers, path)
        self.buf = bytearray()
        self.parts = 0
        self.done = False

    def write(self, data: memoryview) -> None:
        if self.done:
            raise ValueError(f"write to {self.endpoint.where(self.path)} after close() or abort()")
        view = memoryview(data).cast("B")
        size = self.transfers.part_bytes
        while len(view):
            take = min(len(view), size - len(self.buf))
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) == size:
                self._send()

    def _send(self) -> None:
        body, self.buf = self.buf, bytearray()
        self.parts += 1
        self.upload.submit(self.parts, lambda: body, len(body))

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            if self.parts == 0:
                body, self.buf = bytes(self.buf), bytearray()
                put_object(self.endpoint, self.transfers, self.path, body)
                return
            if self.buf:
                self._send()
            self.upload.complete()
        except BaseException:
            self.upload.abort()
            raise

    def abort(self) -> None:
        self.done = True
        self.buf = bytearray()
        self.upload.abort()


class TempStream:
    """Stream for filesystems without multipart uploads: write `<name>.tmp-<token>`, rename on close."""

    alignment = 1

    def __init__(self, endpoint: Endpoint, transfers: Transfers, path: str) -> None:
        self.endpoint, self.pace, self.path = endpoint, transfers.pace, path
        self.full = endpoint.full(path)
        self.tmp = endpoint.temp_name(path)
        self.file = endpoint.request("open", path, lambda: endpoint.fs.open(self.tmp, "wb"))

    def write(self, data: memoryview) -> None:
        self.pace(len(data))
        try:
            self.file.write(data)
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            raise self.endpoint.translate(exc, "write", self.path) from exc

    def close(self) -> None:
        ep = self.endpoint
        if self.file is None:
            return  # already closed or aborted
        try:
            ep.fsync_file(self.file)
            self.file.close()
            self.file = None
            ep.request("rename", self.path, lambda: ep.fs.mv(self.tmp, self.full))
        except BaseException:
            self.abort()
            raise
        ep.sync_parent(self.full)

    def abort(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except Exception:  # noqa: BLE001 - we are discarding it anyway
                pass
            self.file = None
        self.endpoint.discard(self.tmp)


def pread_exact(fd: int, n: int, offset: int, *, name: str) -> bytes:
    """`n` bytes of `fd` at `offset`; EOFError if the file is shorter."""
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    chunks, got = [data], len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            raise EOFError(f"{name} ends at byte {offset + got}: {n - got} bytes short of the length to upload")
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


def open_stream(endpoint: Endpoint, transfers: Transfers, path: str) -> S3Stream | TempStream:
    """The StreamWriter for `path`: a multipart upload on S3, a temporary renamed on close elsewhere."""
    if endpoint.is_s3:
        return S3Stream(endpoint, transfers, path)
    return TempStream(endpoint, transfers, path)


def put_object(endpoint: Endpoint, transfers: Transfers, path: str, body: bytes | bytearray) -> None:
    """S3: `body` (at most one part) as one PutObject, paced: the object appears whole or not at all."""
    transfers.pace(len(body))
    endpoint.s3("put", path, "put_object", Key=endpoint.key(path), Body=body)


def upload_file(endpoint: Endpoint, transfers: Transfers, local_path: str | os.PathLike, dest: str, length: int | None) -> None:
    """FsspecStorage.upload_file: parallel multipart on S3 above one part, else one put or a stream."""
    with open(local_path, "rb") as f:
        fd = f.fileno()
        total = os.fstat(fd).st_size if length is None else length
        read = functools.partial(pread_exact, fd, name=os.fspath(local_path))
        if endpoint.is_s3 and total > transfers.part_bytes:
            part = max(transfers.part_bytes, -(-total // S3_MAX_PARTS))
            upload = Multipart(endpoint, transfers, dest)
            try:
                for number, offset in enumerate(range(0, total, part), start=1):
                    n = min(part, total - offset)
                    upload.submit(number, functools.partial(read, n, offset), n)
                upload.complete()
            except BaseException:
                upload.abort()
                raise
            return
        if endpoint.is_s3:
            put_object(endpoint, transfers, dest, read(total, 0))
            return
        stream = open_stream(endpoint, transfers, dest)
        try:
            for offset in range(0, total, transfers.part_bytes):
                stream.write(memoryview(read(min(transfers.part_bytes, total - offset), offset)))
            stream.close()
        except BaseException:
            stream.abort()
            raise
