"""Local filesystem tier: O_DIRECT streams where supported, atomic durable puts, fsync everywhere.

Layer: storage (I/O). The Storage protocol (base.py) on a directory of node-local storage.
Hostile contents: below the root nothing is followed through a symbolic link (every path is walked
with directory file descriptors and O_NOFOLLOW; a link is skipped by list() with a warning, is a
missing object to get/size/mtime and is never deleted through), only regular files are read
(O_NONBLOCK: a FIFO never blocks), and a directory this class creates is made durable in its parent
(fsync of the parent) before anything is created in it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Callable, Iterator

from checkpointing.errors import CheckpointCorruptError
from checkpointing.format import naming
from checkpointing.format.naming import new_token
from checkpointing.storage import base, listing, sizes
from checkpointing.storage.local_stream import LocalStream, lone_file

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

log = logging.getLogger("checkpointing")


class SymlinkSkipped(FileNotFoundError):
    """A symbolic link where an object or directory is expected: never followed, so it is no object."""


class LocalStorage:
    """A directory on node-local storage.

    put: write `<name>.tmp-<token>`, fsync, rename over the final name (exclusive: link(), which
    fails if the name exists), fsync the directory. open_stream: O_DIRECT when `direct` and the
    filesystem accepts it (tmpfs does not: buffered then), fsync on close. `create=False` (readers:
    the CLI) never creates the root.
    """

    def __init__(self, root: str | os.PathLike, *, direct: bool = True, fsync: bool = True, create: bool = True) -> None:
        self.root = Path(os.path.expanduser(os.fspath(root))).absolute()  # "~/ckpt": the home directory's, as a shell would
        self.url = str(self.root)
        self.direct = direct
        self.fsync = fsync
        self._warned: set[str] = set()
        if create:
            self._make_root()

    def _make_root(self) -> None:
        """Create the root and any missing parent, each made durable in its parent (fsync of the parent
        directory) before anything is created in it: a COMMIT that survives a power cut is never in a
        directory whose own entry did not (format.md, "Write order", 0)."""
        missing = [p for p in [self.root, *self.root.parents] if not p.exists()][::-1]
        for path in missing:
            try:
                path.mkdir()
            except FileExistsError:  # ranks sharing a tier race to create it
                continue
            if self.fsync:
                try:
                    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's path: links followed
                except PermissionError:  # a parent we may create in but not read (mode --x): its entry is the filesystem's to keep
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if not self.root.is_dir():
            self.root.mkdir(exist_ok=True)  # a file or a dangling link there: mkdir's own error names it

    def _abs(self, path: str) -> Path:
        return self.root / path if path else self.root

    def _skip(self, path: str) -> SymlinkSkipped:
        """The error for a link at `path`, logged once per path."""
        where = self._abs(path)
        if path not in self._warned:
            self._warned.add(path)
            log.warning("checkpointing: skipping %s: a symbolic link (never followed; remove it if it is not meant to be there)", where)
        return SymlinkSkipped(errno.ENOENT, f"{where}: a symbolic link, not followed (checkpointing never follows links below its root)")

    @contextlib.contextmanager
    def _dir(self, path: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of directory `path` below the root, walked without following a link
        (create: make the missing ones, each made durable in its parent before it is used)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            done: list[str] = []
            for part in [p for p in path.split("/") if p]:
                done.append(part)
                old, fd = fd, -1
                fd = self._step_into(old, part, "/".join(done), create)  # closes `old`
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _step_into(self, fd: int, part: str, rel: str, create: bool) -> int:
        """Open `part` in directory `fd` (closing `fd`): a directory, never a link."""
        try:
            for _ in range(8):
                try:
                    return os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                        if self.fsync:
                            os.fsync(fd)  # the new directory's entry is durable before anything relies on it
                    except FileExistsError:  # ranks sharing a tier race to create it
                        pass
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise self._skip(rel) from None
                    fix = "; a file of that name is in the way: move or rename it" if create else ""
                    raise FileNotFoundError(errno.ENOENT, f"{self._abs(rel)}: not a directory{fix}") from None
            raise FileNotFoundError(errno.ENOENT, f"{self._abs(rel)}: removed while being created")
        finally:
            os.close(fd)

    def _split(self, path: str) -> tuple[str, str]:
        parent, _, name = path.rpartition("/")
        if not name:
            raise FileNotFoundError(errno.ENOENT, f"{self._abs(path)}: no such object")
        return parent, name

    def _lstat(self, path: str) -> os.stat_result:
        parent, name = self._split(path)
        try:
            with self._dir(parent) as dfd:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, f"{self._abs(path)}: no such object") from None
        if stat.S_ISLNK(st.st_mode):
            raise self._skip(path)
        return st

    @contextlib.contextmanager
    def _open_read(self, path: str) -> Iterator[tuple[int, int]]:
        """(fd, size) of the regular file `path`: never through a link, never blocking on a FIFO."""
        parent, name = self._split(path)
        try:
            with self._dir(parent) as dfd:
                fd = os.open(name, _READ, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._skip(path) from None
            if isinstance(exc, (NotADirectoryError, IsADirectoryError)):
                raise FileNotFoundError(errno.ENOENT, f"{self._abs(path)}: no such object") from None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, f"{self._abs(path)}: a directory, not an object")
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError(f"{self._abs(path)} is not a regular file (a FIFO, socket or device): "
                                             "not read; remove it, the checkpoint directory holds only regular files")
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            yield fd, st.st_size
        finally:
            os.close(fd)

    def _create(self, target: Path, flags: int) -> int:
        """Open a new file, creating its directory; a collector may remove an empty step directory
        between the mkdir and the open (tier/collect.py), so both are retried."""
        parent, name = self._split(target.relative_to(self.root).as_posix())
        for attempt in range(8):
            try:
                with self._dir(parent, create=True) as dfd:
                    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            except SymlinkSkipped:
                raise
            except FileNotFoundError:
                if attempt == 7:
                    raise
        raise AssertionError("unreachable")

    def _sync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        try:
            with self._dir(path.relative_to(self.root).as_posix()) as fd:
                os.fsync(fd)
        except FileNotFoundError:  # removed meanwhile (a collector emptied it): nothing to make durable
            return

    def makedirs(self, path: str) -> None:
        with self._dir(path, create=True):
            pass

    def open_stream(self, path: str, *, spare: bool = False) -> LocalStream:
        """A new object at `path`, written sequentially. `spare`: write over a spare pack file
        (keep_spare) if one is there, moved to `path`, instead of a new file: no blocks to allocate,
        and none were freed (on a filesystem mounted with online discard, freeing a large file costs
        the device a good part of a second, and on a virtual machine the host's CPU)."""
        reused = self._take_spare(path) if spare else False
        return LocalStream(self._abs(path), direct=self.direct, fsync=self.fsync, create=self._create, reused=reused)

    def keep_spare(self, path: str, limit: int) -> bool:
        """Move the file `path` (a retired pack nothing references) to spares/ for a later
        open_stream(spare=True) to write over, unless `limit` spares are there already; False when
        it was not moved (then delete it). Only a regular file with no other link is kept."""
        parent, name = self._split(path)
        try:
            with self._dir(naming.SPARES_DIR, create=True) as sfd:
                if sum(1 for n in os.listdir(sfd) if naming.is_spare(n)) >= limit:
                    return False
                with self._dir(parent) as dfd:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if not lone_file(st):
                        return False
                    os.rename(name, naming.spare_file(new_token()), src_dir_fd=dfd, dst_dir_fd=sfd)
                    if self.fsync:
                        os.fsync(sfd)
                        os.fsync(dfd)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _take_spare(self, path: str) -> bool:
        """Move a spare pack file to `path` (a new name: pack names carry a fresh token); whether one
        was taken. Another process may take the same spare first (its rename wins), or the spares
        directory hold what this library did not put there: a link, a FIFO, a file with other links
        (a hard link to something else) is left where it is and never written."""
        parent, name = self._split(path)
        try:
            with self._dir(naming.SPARES_DIR) as sfd:
                candidates = sorted(n for n in os.listdir(sfd) if naming.is_spare(n))
                if not candidates:
                    return False
                with self._dir(parent, create=True) as dfd:
                    for n in candidates:
                        try:
                            st = os.stat(n, dir_fd=sfd, follow_symlinks=False)
                            if not lone_file(st):
                                continue
                            os.rename(n, name, src_dir_fd=sfd, dst_dir_fd=dfd)
                        except FileNotFoundError:
                            continue  # taken by another writer meanwhile
                        if self.fsync:
                            os.fsync(dfd)
                        return True
        except (FileNotFoundError, NotADirectoryError):
            pass
        return False

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> None:
        parent, name = self._split(path)
        sync = self.fsync and durable
        tmp = f"{name}.tmp-{new_token()}"
        try:
            fd = self._create(self._abs(f"{parent}/{tmp}" if parent else tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            raise _naming(exc, self._abs(path))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        except OSError as exc:  # a full disk, say: the temporary goes, and the error names the file
            with contextlib.suppress(OSError), self._dir(parent) as dfd:
                os.unlink(tmp, dir_fd=dfd)
            raise _naming(exc, self._abs(path))
        finally:
            os.close(fd)
        with self._dir(parent) as dfd:
            try:
                if exclusive:  # fails with EEXIST: never replaces a commit
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                else:
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)  # done or failed: the temporary goes either way
            if sync:
                os.fsync(dfd)

    def get(self, path: str, *, max_bytes: int | None = None) -> bytes:
        with self._open_read(path) as (fd, size):
            if max_bytes is not None and size > max_bytes:
                raise base.too_large(self._abs(path), size, max_bytes)
            chunks, left = [], size if max_bytes is None else max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 24))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
        if max_bytes is not None and len(data) > max_bytes:  # grew while being read
            raise base.too_large(self._abs(path), len(data), max_bytes)
        return data

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        with self._open_read(path) as (fd, _):
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{self._abs(path)} ends at byte {offset + done}, {len(buf) - done} bytes short")
                done += n

    def size(self, path: str) -> int:
        st = self._lstat(path)
        if stat.S_ISDIR(st.st_mode):
            raise FileNotFoundError(errno.ENOENT, f"{self._abs(path)}: a directory, not an object")
        return st.st_size

    def sizes(self, paths: list[str]) -> dict[str, int | None]:
        return sizes.one_by_one(self, paths)

    def mtime(self, path: str) -> float:
        return (self._lstat(path) if path else self.root.stat()).st_mtime

    def exists_with_size(self, path: str, nbytes: int) -> bool:
        return base.exists_with_size(self, path, nbytes)

    def list(self, prefix: str = "") -> list[str]:
        """The names in directory `prefix`; links are left out (and reported once)."""
        try:
            with self._dir(prefix) as dfd, os.scandir(dfd) as it:
                entries = [(e.name, e.is_symlink()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name, link in entries:
            if link:
                self._skip(f"{prefix}/{name}" if prefix else name)
        return sorted(name for name, link in entries if not link)

    def list_dirs(self, prefix: str = "", *, only: Callable[[str], bool] = lambda name: True) -> dict[str, list[str]]:
        return listing.dir_by_dir(self, prefix, only)

    def delete(self, path: str) -> None:
        """Delete the object or directory tree `path`; a link there is left alone (never deleted through)."""
        try:
            self._remove(path, recursive=True)
        except (FileNotFoundError, NotADirectoryError):
            return

    def remove_dir(self, path: str) -> None:
        try:
            self._remove(path, recursive=False)
        except OSError:  # missing, or not empty
            return

    def _remove(self, path: str, *, recursive: bool) -> None:
        """Unlink `path` (a directory: with its tree when `recursive`, else only if empty) through
        descriptors, never following a link; the parent is fsynced after."""
        parent, name = self._split(path)
        with self._dir(parent) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                self._skip(path)
                return
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
            elif recursive:
                shutil.rmtree(name, dir_fd=dfd)  # fd-based: unlinks links inside, never follows them
            else:
                os.rmdir(name, dir_fd=dfd)  # fails on a directory something was created in meanwhile
            if self.fsync:
                os.fsync(dfd)


def _naming(exc: OSError, path: Path) -> OSError:
    """`exc` naming `path`: an error of a file opened relative to a directory's descriptor names only its name (or nothing)."""
    if not isinstance(exc.filename, (str, bytes)) or not os.path.isabs(os.fsdecode(exc.filename)):
        exc.filename = str(path)
    return exc
