"""The tiers a manager works on, opened: its local tier (for writing, or read-only) and the remote tier (I/O).

`open_local_tier` and `open_remote_tier` turn the options into storages (CheckpointConfigError when
they cannot be used). With read_only=True the local tier is a `ReadOnlyLocalStorage`: is a LocalStorage that never creates its root and refuses every write
(open_stream, put, makedirs, delete, remove_dir) with CheckpointConfigError. A read-only manager
never calls them (no TIER file, no tidying, no writer lock, no pins, no metrics file); this class
makes sure of it, so a forgotten write path fails loudly instead of changing the directory.

The TIER id of such a tier is the one in its TIER file; a directory without one (never opened by a
writing manager, or a copy of a remote tier) gets none (`tierfile.ensure_tier_id` answers "" and
creates nothing) and is read like the remote tier: as holding every primary copy (the manager
reads it as its remote source; `checkpointing export`/`verify` treat a tier without an id the same).
"""

from __future__ import annotations

import os
from typing import NoReturn

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.format import naming
from checkpointing.options import ManagerOptions
from checkpointing.storage import FsspecStorage, LocalStorage, open_storage
from checkpointing.tier.tierfile import TIER_FILE


class ReadOnlyLocalStorage(LocalStorage):
    """A directory read through LocalStorage (no O_DIRECT: reads only), every write refused."""

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__(root, direct=False, fsync=False, create=False)

    def _refused(self, what: str, path: str) -> CheckpointConfigError:
        return CheckpointConfigError(
            f"{self.url} was opened read_only=True: refusing to {what} {path or '.'!r}; open it without read_only "
            "(one writing manager per directory) to change it"
        )

    def open_stream(self, path: str) -> NoReturn:
        raise self._refused("write", path)

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> NoReturn:
        raise self._refused("write", path)

    def makedirs(self, path: str) -> NoReturn:
        raise self._refused("create", path)

    def delete(self, path: str) -> NoReturn:
        raise self._refused("delete", path)

    def remove_dir(self, path: str) -> NoReturn:
        raise self._refused("delete", path)


def open_local_tier(local_dir: str | os.PathLike, *, read_only: bool, direct: bool, fsync: bool, remote: bool) -> LocalStorage:
    """The manager's local tier at `local_dir`; CheckpointConfigError when it cannot be used. Read-only:
    the directory must exist, unless a remote tier (`remote`) can serve every step."""
    local_dir = os.path.expanduser(local_dir)  # "~/ckpt": the home directory's
    if "://" in os.fspath(local_dir):
        raise CheckpointConfigError(f"local_dir={os.fspath(local_dir)!r} is a URL: the local tier is a directory on this machine "
                                    "(node-local NVMe); pass object storage as remote=..., e.g. CheckpointManager('/nvme/ckpt', remote='s3://bucket/run')")
    if os.path.exists(local_dir) and not os.path.isdir(local_dir):
        raise CheckpointConfigError(f"{local_dir!s} is a file, not a directory: pass the checkpoint directory (or a new path); "
                                    f"a torch.save file comes in as a step with `checkpointing import {local_dir!s} NEW_DIR`")
    refuse_foreign(local_dir)
    if not read_only:
        try:
            return LocalStorage(local_dir, direct=direct, fsync=fsync)
        except OSError as exc:
            raise CheckpointConfigError(f"cannot use {local_dir!s} as the checkpoint directory: {exc}") from exc
    storage = ReadOnlyLocalStorage(local_dir)
    if not remote and not storage.root.is_dir():
        raise CheckpointConfigError(
            f"{storage.root} is not a directory: nothing to read (a manager opened read_only=True never creates it); "
            "check the path, or pass remote=URL to read a remote tier"
        )
    return storage


def refuse_foreign(directory: str | os.PathLike, error: type[CheckpointError] = CheckpointConfigError) -> None:
    """`error` when `directory` holds another library's checkpoint (torch.distributed.checkpoint's `.metadata`, at its
    root or in a folder of it, as torchtitan's step-N) and nothing of ours: a manager would start afresh beside it."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    if any(name == TIER_FILE or naming.parse_step_dir(name) is not None for name in names):
        return
    found = [os.path.join(os.fspath(directory), *where) for where in [()] + [(n,) for n in sorted(names)[-256:]]
             if os.path.isfile(os.path.join(directory, *where, ".metadata"))]
    if found:
        raise error(f"{os.fspath(directory)} holds a torch.distributed.checkpoint (DCP) checkpoint ({found[-1]}/.metadata), not one "
                    f"of checkpointing's: bring it in as a step with `checkpointing import {found[-1]} NEW_DIR` "
                    "(checkpointing.interop.import_checkpoint) and use NEW_DIR; for a new run pass another directory")


def open_remote_tier(options: ManagerOptions, local_dir: str | os.PathLike) -> FsspecStorage | None:
    """The remote tier's storage, or None. Credentials stay inside it: never in messages, logs or files."""
    if options.remote is None:
        return None
    opened = open_storage(options.remote, options.storage_options, max_concurrency=options.upload_concurrency,
                          part_bytes=options.upload_part_bytes, max_bytes_per_s=options.upload_bytes_per_s,
                          own_loop=True)  # its threads may follow the uploads' priority (save/uploader.py)
    assert isinstance(opened, FsspecStorage)
    try:
        _check_apart(local_dir, opened)
    except CheckpointConfigError:
        opened.close()
        raise
    return opened


def _check_apart(local_dir: str | os.PathLike, remote: FsspecStorage) -> None:
    """CheckpointConfigError when a file:// remote tier is a file, is the local directory, or one lies inside the
    other: each tier's retention and tidying would remove the other's steps, and a copy on the same
    disk survives nothing the local one does not."""
    if remote.protocol not in ("file", "local"):
        return
    above = remote.root  # the remote tier, or the nearest path above it that exists: a directory, not a file
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.exists(above) and not os.path.isdir(above):
        where = "is a file" if above == remote.root else f"lies below the file {above}"
        raise CheckpointConfigError(f"the remote tier {remote.url} {where}, not a directory: pass a directory (or a new path) as remote=")
    a, b = os.path.realpath(os.path.expanduser(local_dir)), os.path.realpath(remote.root)
    if a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep):
        how = "is" if a == b else ("lies inside" if b.startswith(a + os.sep) else "contains")
        raise CheckpointConfigError(
            f"the remote tier {remote.url} {how} the local directory {local_dir}: the tiers must be separate directories "
            "(the remote one on other storage: a shared filesystem, s3://...); pass another remote=, or none"
        )
