"""The writer lock of a local tier: one writing process (a job's leader rank of that tier) at a time (I/O).

The lock is `fcntl.flock(LOCK_EX)` on the file `WRITER` in the tier's root, taken without waiting and
held for the writer's lifetime; the kernel drops it when the process dies (a SIGKILLed job leaves no
stale lock). The file's content (JSON: pid, host, since) names the holder for the error a second
writer gets; it is only informative, the flock is the lock. Readers (a manager opened read_only=True,
the CLI's read-only commands) never take it; `checkpointing gc` and `rm` take it to delete. Within
one process a second manager on the same directory shares the lock (reference-counted) and does not
tidy (`first` is False).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

from checkpointing.errors import CheckpointError, DirectoryLockedError

LOCK_NAME = "WRITER"
_HELD: dict[tuple[int, int], "WriterLock"] = {}
_GUARD = threading.RLock()  # the registry, and no fork while a lock's descriptor is opened or closed


class WriterLock:
    """A held writer lock; release() once per acquire()."""

    def __init__(self, fd: int, key: tuple[int, int], path: Path) -> None:
        self.fd, self.key, self.path, self.count, self.first = fd, key, path, 1, True

    def release(self) -> None:
        with _GUARD:  # the close too: a fork between the two would leave the child holding the lock
            self.count -= 1
            if self.count > 0 or self.fd < 0:
                return
            _HELD.pop(self.key, None)
            fd, self.fd = self.fd, -1
            os.close(fd)  # drops the flock


def _in_child() -> None:
    """A forked child: the parent's writer locks are not its own. Its copies of their descriptors are closed (never
    unlocked, which would drop the parent's lock too), so a lock goes when its parent exits, whatever children live on."""
    global _GUARD
    _GUARD = threading.RLock()  # held by the fork itself (below)
    for held in _HELD.values():
        if held.fd >= 0:
            try:
                os.close(held.fd)
            except OSError:
                pass
            held.fd = -1
    _HELD.clear()


os.register_at_fork(before=lambda: _GUARD.acquire(), after_in_parent=lambda: _GUARD.release(), after_in_child=_in_child)


def acquire(root: Path, *, purpose: str = "a CheckpointManager") -> WriterLock:
    """Take the writer lock of the tier at `root` (DirectoryLockedError naming the holder if taken)."""
    with _GUARD:  # no fork between the open and the registration: a child would keep the descriptor, and the lock
        return _acquire(root, purpose)


def _acquire(root: Path, purpose: str) -> WriterLock:
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:  # a link there (never followed), or the directory is read-only
        raise CheckpointError(f"cannot open the writer lock {path}: {exc}; it must be a regular file in a writable directory "
                              "(remove a link or anything else there); to only read the checkpoints there, open "
                              "CheckpointManager(dir, read_only=True)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file: remove it (it is the checkpoint directory's writer lock)")
        key = (st.st_dev, st.st_ino)
        held = _HELD.get(key)
        if held is not None and held.fd >= 0:  # this process holds it already (another manager here)
            held.count += 1
            os.close(fd)
            return _Shared(held)
        if not _flock(fd):
            raise DirectoryLockedError(_locked_message(root, _holder(fd), purpose))
        _describe(fd)
        lock = _HELD[key] = WriterLock(fd, key, path)
        return lock
    except BaseException:
        if fd not in [h.fd for h in _HELD.values()]:
            os.close(fd)
        raise


def _flock(fd: int) -> bool:
    """Take the flock without waiting; False when another holds it. When the lock file names this process, which no
    longer holds it, the holder is a child forked a moment ago that has not closed its copy yet (_in_child): a little
    while is given to it."""
    deadline = time.monotonic() + FORKED_CHILD_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() > deadline or not _names_this_process(fd):
            return False
        time.sleep(0.005)


FORKED_CHILD_S = 2.0  # how long a child forked while this process held the lock may take to let go of it


def _names_this_process(fd: int) -> bool:
    info = _read_info(fd)
    return info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()


class _Shared(WriterLock):
    """A second manager of this process on a directory whose lock the process holds already."""

    def __init__(self, held: WriterLock) -> None:
        self.held, self.first, self.done = held, False, False

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.held.release()


def _describe(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "since_unix": round(time.time(), 3)}
    data = (json.dumps(info, sort_keys=True) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_info(fd: int) -> dict:
    """What the lock file says of its holder (_describe); {} when it says nothing readable."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (ValueError, OSError):
        return {}
    return info if isinstance(info, dict) else {}


def _holder(fd: int) -> str:
    info = _read_info(fd)
    try:
        return f"process {int(info['pid'])} on host {str(info['host'])[:100]!r} since {str(info['since'])[:40]}"
    except (KeyError, TypeError, ValueError):
        return "another process (its lock file does not say which)"


def _locked_message(root: Path, holder: str, purpose: str) -> str:
    return (f"cannot open {root} for writing with {purpose}: {holder} writes it (it holds {root / LOCK_NAME}). "
            "Two writers would delete each other's saves in flight. Stop that process, or give this one its own "
            "directory; to only read the checkpoints open CheckpointManager(dir, read_only=True) (it takes no lock) or use "
            "the CLI (checkpointing ls/inspect/verify/export)")


class NotHeld:
    """What a rank holds whose tier's leader holds the lock for it: nothing to release."""

    first = False

    def release(self) -> None:
        pass
