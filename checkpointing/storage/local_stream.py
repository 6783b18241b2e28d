"""A pack file on a local tier, written front to back (LocalStorage.open_stream): O_DIRECT where the
filesystem takes it, a short last block through the page cache, fsync on close; new, or written
over a spare pack file (docs/format.md, "Spare pack files").

Layer: storage (I/O).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Any

DIRECT_ALIGN = 4096


def lone_file(st: os.stat_result) -> bool:
    """A regular file with no other name: one this library may write over (a spare pack file)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


class LocalStream:
    """One pack file written front to back: a new file, or (`reused`) a spare pack file already
    moved to `path`, written over from its start and cut to the written length at close."""

    def __init__(self, path: Path, *, direct: bool, fsync: bool, create: Any, reused: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        self.offset = 0
        self.fd = -1
        self.reused = reused and self._open(create, direct, os.O_WRONLY | os.O_NONBLOCK)  # a FIFO there: no wait for a reader
        if not self.reused:
            if reused:  # not what it should be (replaced meanwhile): removed, never written through
                path.unlink(missing_ok=True)
            self._open(create, direct, os.O_WRONLY | os.O_CREAT | os.O_EXCL)

    def _open(self, create: Any, direct: bool, flags: int) -> bool:
        """Open the file (O_DIRECT where the filesystem takes it); without O_CREAT, False unless it is
        a regular file with no other link."""
        self.alignment = 1
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = create(self.path, flags | os.O_DIRECT)
                    self.alignment = DIRECT_ALIGN
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
            if self.fd < 0:
                self.fd = create(self.path, flags)
        except OSError:
            if flags & os.O_CREAT:
                raise
            return False
        if not flags & os.O_CREAT:
            st = os.fstat(self.fd)
            if not lone_file(st):
                os.close(self.fd)
                self.fd = -1
                return False
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return True

    def write(self, data: memoryview) -> None:
        if self.alignment > 1 and len(data) % self.alignment:
            # the short last block: O_DIRECT would need padding, so write it through the page cache
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.alignment = 1
        view = data
        try:
            while view:
                n = os.pwrite(self.fd, view, self.offset)
                self.offset += n
                view = view[n:]
        except OSError as exc:
            raise self._where(exc, "writing") from None

    def close(self) -> None:
        try:
            if self.reused:
                os.ftruncate(self.fd, self.offset)  # what a longer spare held past the new end goes
            if self.fsync:
                os.fsync(self.fd)
        except OSError as exc:
            raise self._where(exc, "flushing") from None
        finally:
            os.close(self.fd)
            self.fd = -1

    def _where(self, exc: OSError, doing: str) -> OSError:
        """The error with where and what was being done (the kernel's says neither); disk full: the fix.
        The directory, not the file: ranks writing one step directory fail with one message (errors.group_by_cause)."""
        hint = ": free space there, or keep fewer steps (keep_local=)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return OSError(exc.errno, f"{exc.strerror} ({doing} a pack file in {self.path.parent}{hint})")

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)
