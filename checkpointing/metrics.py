"""Per-save phase timings: a frozen record, JSON lines beside the checkpoints, one log line."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterator

log = logging.getLogger("checkpointing")


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one save cost. Times in seconds, sizes in bytes.

    wait_prev_s: save() waited for the previous save to finish writing.
    stall_s: the training thread was blocked by this save (inside save(), after wait_prev_s, plus
        guard_wait_s); the loop's total blocked time is wait_prev_s + stall_s.
    guard_wait_s: the part of stall_s spent in the guard before the next optimizer.step().
    snapshot_s: save() entry to the last byte staged. write_s: staged to pack data durable.
    commit_s: manifest + commit marker durable (with several ranks: reporting to rank 0, its merge,
        and every local tier's commit). total_s: save() entry to committed.
    """

    step: int
    ok: bool
    error: str | None
    wait_prev_s: float
    stall_s: float
    guard_wait_s: float
    snapshot_s: float
    write_s: float
    commit_s: float
    total_s: float
    bytes_total: int
    bytes_written: int
    bytes_reused: int
    write_bytes_per_s: float
    staging_bytes: int
    tier: str = "local"
    time: float = 0.0  # wall-clock time.time() when the save was requested
    rank: int = 0  # of the process group; ranks sharing a directory append to one metrics.jsonl
    world_size: int = 1

    def __getitem__(self, name: str) -> Any:
        if name not in _FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def keys(self) -> Iterator[str]:
        return iter(_FIELDS)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = tuple(f.name for f in dataclasses.fields(SaveStats))


def append_jsonl(path: os.PathLike | str, stats: SaveStats) -> None:
    line = json.dumps(stats.as_dict(), sort_keys=True) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_jsonl(path: os.PathLike | str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue  # a line torn by a crash
    except FileNotFoundError:
        pass
    return out


def log_save(stats: SaveStats, where: str) -> None:
    mb = stats.bytes_written / 1e6
    if stats.ok:
        log.info(
            "checkpointing: step %d committed in %.3f s (stall %.1f ms, wait_prev %.1f ms, %.1f MB at %.2f GB/s) -> %s",
            stats.step, stats.total_s, stats.stall_s * 1e3, stats.wait_prev_s * 1e3, mb, stats.write_bytes_per_s / 1e9, where,
        )
    else:
        log.error("checkpointing: step %d failed after %.3f s: %s", stats.step, stats.total_s, stats.error)
