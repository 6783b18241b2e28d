"""The storage protocol every tier implements.

Why so small: the orchestration layer needs exactly these operations, and every backend (local
disk, fsspec remote, fault-injecting wrappers) must implement them with the same semantics, checked
by one contract test suite (tests/test_storage_contract.py).

Paths are relative, '/'-separated, validated by `layout.check_relpath` before they reach a backend.
Call order for a save: `open_stream` (pack data) -> `put` (manifest) -> `put(exclusive=True)`
(commit marker). A backend must make every completed `put`/`StreamWriter.close` durable before it
returns, and must never expose a partially written object under its final name.
Errors: missing objects raise FileNotFoundError; an exclusive put of an existing object raises
FileExistsError; everything else raises OSError. Callers translate those into CheckpointError once.
"""

from __future__ import annotations

from typing import Protocol


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

    def get(self, path: str) -> bytes: ...

    def read_into(self, path: str, offset: int, buf: memoryview) -> None: ...

    def size(self, path: str) -> int: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, path: str) -> None: ...

    def remove_dir(self, path: str) -> None:
        """Remove `path` if it is an empty directory (a plain object of that name goes too); leave a
        directory with anything in it. A no-op where there are no directories (object stores)."""
        ...
