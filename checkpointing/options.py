"""Typed, validated options. Errors say which option is wrong and how to fix it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from .codecs import Codec
from .errors import CheckpointConfigError

SnapshotMode = Literal["async", "eager"]

MIN_CHUNK_BYTES = 4096
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """Everything `CheckpointManager` accepts besides the directory.

    keep_local: committed steps kept on the local tier (None keeps all).
    snapshot: "async" lets the copy into staging overlap the next forward/backward and guards the
        next optimizer.step(); "eager" copies everything before save() returns.
    staging_budget_bytes: upper bound of the staging pool (None: one full copy of the state).
        A smaller budget streams the state through a ring and the guard waits for the writer.
    chunk_bytes: largest chunk; every chunk carries its own digest.
    write_block_bytes: size of one write syscall to the pack file.
    direct_io: use O_DIRECT for pack writes where the filesystem supports it.
    fsync: make every write durable before the commit marker (turn off only for tests).
    timeout_s: longest wait for another rank (its report, rank 0's verdict, a restore agreement)
        before the save or restore fails with an error naming the ranks that did not answer.
    """

    keep_local: int | None = 2
    keep_remote: int | None = None
    snapshot: SnapshotMode = "async"
    staging_budget_bytes: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    write_block_bytes: int = 32 << 20
    direct_io: bool = True
    fsync: bool = True
    incremental: bool = True
    remote: str | None = None
    storage_options: Mapping[str, Any] | None = None
    codecs: tuple[Codec, ...] = ()
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("keep_local", "keep_remote"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise CheckpointConfigError(
                    f"{name}={value!r} is invalid: pass a whole number >= 1, or None to keep every step"
                )
        if self.snapshot not in ("async", "eager"):
            raise CheckpointConfigError(
                f"snapshot={self.snapshot!r} is invalid: use 'async' (copy overlaps compute, guarded "
                "before optimizer.step) or 'eager' (copy before save returns)"
            )
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < MIN_CHUNK_BYTES:
            raise CheckpointConfigError(
                f"chunk_bytes={self.chunk_bytes!r} is invalid: pass an int >= {MIN_CHUNK_BYTES}"
            )
        if not isinstance(self.write_block_bytes, int) or self.write_block_bytes < (1 << 20) or self.write_block_bytes % 4096:
            raise CheckpointConfigError(
                f"write_block_bytes={self.write_block_bytes!r} is invalid: pass a multiple of 4096 >= 1 MiB"
            )
        budget = self.staging_budget_bytes
        if budget is not None and (not isinstance(budget, int) or budget < 2 * self.chunk_bytes):
            raise CheckpointConfigError(
                f"staging_budget_bytes={budget!r} is too small: it must hold at least two chunks "
                f"(2 * chunk_bytes = {2 * self.chunk_bytes}); raise it or lower chunk_bytes"
            )
        if self.remote is not None:
            raise CheckpointConfigError(
                f"remote={self.remote!r}: the remote tier is not available in this version; "
                "pass remote=None and copy the local directory yourself"
            )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise CheckpointConfigError(f"timeout_s={self.timeout_s!r} is invalid: pass a number of seconds > 0")
        names = [c.name for c in self.codecs]
        if len(set(names)) != len(names):
            raise CheckpointConfigError(f"codecs have duplicate names {names}: give each codec a unique name")
