"""The storage protocol every tier implements (layer: storage).

Why so small: the orchestration layer needs exactly these operations, and every backend (local
disk, fsspec remote, fault-injecting wrappers) must implement them with the same semantics, checked
by one contract test suite (tests/test_storage_contract.py).

Paths are relative, '/'-separated, validated by `format.naming.check_relpath` before they reach a backend.
Call order for a save: `open_stream` (pack data) -> `put` (manifest) -> `put(exclusive=True)`
(commit marker). A backend must make every completed `put`/`StreamWriter.close` durable before it
returns, and must never expose a partially written object under its final name.
Call order for a resumed upload: `exists_with_size` (is the object there whole already?) before
sending it again; for garbage collection: `list`, then `mtime` of what is listed (leave young files
to a writer that may not have pinned them), then `delete`/`remove_dir`.
Errors: missing objects raise FileNotFoundError; an exclusive put of an existing object raises
FileExistsError; everything else raises OSError. Callers translate those into CheckpointError once.
Retries of transient errors are not the caller's job: a remote backend runs every request under
its retry wrapper (retry.Retrying), so what comes out of a Storage method is final.
"""

from __future__ import annotations

from typing import Callable, Protocol

from checkpointing.errors import CheckpointCorruptError


class StreamWriter(Protocol):
    """Sequential writer of one large object (a pack file).

    `alignment`: every `write` but the last must pass a length that is a multiple of it, from an
    address aligned to it (O_DIRECT); the last write may have any length. `close()` makes the
    object durable; `abort()` removes it.
    """

    alignment: int

    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class Storage(Protocol):
    url: str

    def open_stream(self, path: str) -> StreamWriter: ...

    def put(self, path: str, data: bytes, *, exclusive: bool = False, durable: bool = True) -> None:
        """Store `data` whole under `path`. durable=False: visible to every process once it
        returns, but it may be lost in a power cut (a pin: it matters only while its writer runs)."""
        ...

    def get(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object. max_bytes: an object larger than that raises CheckpointCorruptError
        (see too_large) without being read whole: manifests and markers are read with a cap."""
        ...

    def read_into(self, path: str, offset: int, buf: memoryview) -> None: ...

    def size(self, path: str) -> int: ...

    def sizes(self, paths: list[str]) -> dict[str, int | None]:
        """The size of each object of `paths`, None where it is missing: `size` for each, or one
        listing per directory where that is cheaper (object stores: storage/sizes.py)."""
        ...

    def mtime(self, path: str) -> float:
        """Seconds since the epoch of the object's last change, as the store records it (object stores:
        to the second); 0.0 where the backend keeps no time. Missing: FileNotFoundError. Used to leave
        young files alone (gc's min_age_s, a pin's age) and to show when a step was committed."""
        ...

    def exists_with_size(self, path: str, nbytes: int) -> bool:
        """Whether the object `path` exists with exactly `nbytes`: an object a completed upload left
        (objects appear whole). False if it is missing or has another size; other errors raise.
        Backends without a cheaper way answer with the module's `exists_with_size(storage, ...)`."""
        ...

    def list(self, prefix: str = "") -> list[str]: ...

    def list_dirs(self, prefix: str = "", *, only: Callable[[str], bool] = lambda name: True) -> dict[str, list[str]]:
        """Each name in `prefix` that `only` takes -> `list` of it (a file: []): in one listing of every key
        where that is cheaper (object stores: storage/listing.py), else a listing each."""
        ...

    def delete(self, path: str) -> None: ...

    def remove_dir(self, path: str) -> None:
        """Remove `path` if it is an empty directory (a plain object of that name goes too); leave a
        directory with anything in it. A no-op where there are no directories (object stores)."""
        ...


def exists_with_size(storage: Storage, path: str, nbytes: int) -> bool:
    """Storage.exists_with_size from `size`: the one implementation the backends here share."""
    try:
        return storage.size(path) == nbytes
    except FileNotFoundError:
        return False


def too_large(where: object, size: int, max_bytes: int) -> CheckpointCorruptError:
    """The error of a capped get(): the object is larger than any of its kind may be."""
    return CheckpointCorruptError(f"{where} holds {size} bytes, more than the {max_bytes} such a file may have: "
                                  "not read (it is damaged or not a checkpoint file); remove that step or the file")
