"""Local filesystem tier: O_DIRECT streams where supported, atomic durable puts, fsync everywhere.

Layer: storage (I/O). The Storage protocol (base.py) on a directory of node-local storage.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from checkpointing.format.naming import new_token
from checkpointing.storage import base

DIRECT_ALIGN = 4096


class LocalStorage:
    """A directory on node-local storage.

    put: write `<name>.tmp-<token>`, fsync, rename over the final name (exclusive: link(), which
    fails if the name exists), fsync the directory. open_stream: O_DIRECT when `direct` and the
    filesystem accepts it (tmpfs does not: buffered then), fsync on close.
    """

    def __init__(self, root: str | os.PathLike, *, direct: bool = True, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.url = str(self.root)
        self.direct = direct
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def _abs(self, path: str) -> Path:
        return self.root / path if path else self.root

    @contextlib.contextmanager
    def _missing(self, path: str) -> Iterator[None]:
        """A path below a file, or a directory where an object is expected, is a missing object."""
        try:
            yield
        except (NotADirectoryError, IsADirectoryError):
            raise FileNotFoundError(f"{self._abs(path)}: no such object") from None

    def _sync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # removed meanwhile (a collector emptied it): nothing to make durable
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _create(self, target: Path, flags: int) -> int:
        """Open a new file, creating its directory; a collector may remove an empty step directory
        between the mkdir and the open (tier/collect.py), so both are retried."""
        for attempt in range(8):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                return os.open(target, flags, 0o644)
            except (FileNotFoundError, FileExistsError) as exc:
                if isinstance(exc, FileExistsError) and exc.filename != str(target.parent) or attempt == 7:
                    raise
        raise AssertionError("unreachable")

    def makedirs(self, path: str) -> None:
        target = self._abs(path)
        if not target.is_dir():
            target.mkdir(parents=True, exist_ok=True)  # ranks sharing a tier race to create it
            self._sync_dir(target.parent)

    def open_stream(self, path: str) -> "_LocalStream":
        return _LocalStream(self._abs(path), direct=self.direct, fsync=self.fsync, create=self._create)

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> None:
        target = self._abs(path)
        sync = self.fsync and durable
        tmp = target.with_name(f"{target.name}.tmp-{new_token()}")
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if exclusive:
                os.link(tmp, target)  # fails with EEXIST: never replaces a commit
                tmp.unlink(missing_ok=True)  # done: the name is linked whatever happens to the temporary
            else:
                os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if sync:
            self._sync_dir(target.parent)

    def get(self, path: str) -> bytes:
        with self._missing(path):
            return self._abs(path).read_bytes()

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        with self._missing(path):
            fd = os.open(self._abs(path), os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{self._abs(path)} ends at byte {offset + done}, {len(buf) - done} bytes short")
                done += n
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        with self._missing(path):
            return self._abs(path).stat().st_size

    def mtime(self, path: str) -> float:
        with self._missing(path):
            return self._abs(path).stat().st_mtime

    def exists_with_size(self, path: str, nbytes: int) -> bool:
        return base.exists_with_size(self, path, nbytes)

    def list(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._abs(prefix)))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []

    def delete(self, path: str) -> None:
        target = self._abs(path)
        try:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            else:
                target.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        self._sync_dir(target.parent)

    def remove_dir(self, path: str) -> None:
        target = self._abs(path)
        try:
            os.rmdir(target)  # fails on a directory something was created in meanwhile: never recursive
        except NotADirectoryError:
            target.unlink(missing_ok=True)
        except OSError:  # missing, or not empty
            return
        self._sync_dir(target.parent)


class _LocalStream:
    def __init__(self, path: Path, *, direct: bool, fsync: bool, create: Any) -> None:
        self.path = path
        self.fsync = fsync
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.fd = -1
        self.alignment = 1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = create(path, flags | os.O_DIRECT)
                self.alignment = DIRECT_ALIGN
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = create(path, flags)
        self.offset = 0

    def write(self, data: memoryview) -> None:
        if self.alignment > 1 and len(data) % self.alignment:
            # the short last block: O_DIRECT would need padding, so write it through the page cache
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.alignment = 1
        view = data
        while view:
            n = os.pwrite(self.fd, view, self.offset)
            self.offset += n
            view = view[n:]

    def close(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)
