"""Rank 0's metrics.jsonl and its copy on the remote tier (orchestration).

The copy (`mirror`): after each upload of this process and at close(), rank 0 puts its local tier's
metrics.jsonl on the remote tier, so that `checkpointing report URL` works after the node is gone.

At start-up (`adopt`, rank 0 of a writing manager with a remote tier, before any record of this
process): the records of the copy that the local file lacks are merged into it, in time order. A
replacement node (an empty local directory) or a node coming back after another ran the job would
otherwise put its own, shorter file over the copy at its first upload, and the run's history would
be gone from both tiers. Records are told apart by their bytes: a record is one JSON line, and
nothing rewrites one. The merged file replaces the local one in one rename (storage/local.py put);
other ranks sharing the directory append nothing before the collective start-up call that follows.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Iterable

from checkpointing.errors import CheckpointError
from checkpointing.format import naming
from checkpointing.observe.metrics import MAX_METRICS_BYTES, metrics_bytes
from checkpointing.observe.summary import stands_in
from checkpointing.storage import FsspecStorage, LocalStorage

log = logging.getLogger("checkpointing")

__all__ = ["adopt", "merged", "mirror"]


def mirror(local: LocalStorage, remote: FsspecStorage) -> None:
    """The local tier's metrics.jsonl to the remote tier (best effort: a warning when it cannot be put)."""
    data = metrics_bytes(Path(local.root, naming.METRICS_NAME))
    if not data:
        return
    try:
        remote.put(naming.METRICS_NAME, data)
    except (OSError, CheckpointError) as exc:
        log.warning("checkpointing: could not copy %s to %s: %s", naming.METRICS_NAME, remote.url, exc)


def adopt(local: LocalStorage, remote: FsspecStorage) -> int:
    """Merge the remote copy's records that the local metrics.jsonl lacks into it; how many (0 when there is no
    copy, nothing to add, or the local file is not a regular file: a link or a directory is left alone)."""
    path = Path(local.root, naming.METRICS_NAME)
    here = metrics_bytes(path)
    if here is None and (path.exists() or path.is_symlink()):
        return 0  # not a regular file, or too large: never replaced
    try:
        there = remote.get(naming.METRICS_NAME, max_bytes=MAX_METRICS_BYTES)
    except FileNotFoundError:
        return 0
    except (OSError, CheckpointError) as exc:
        log.warning("checkpointing: could not read the copy of %s on %s (the local file goes on without its records): %s",
                    naming.METRICS_NAME, remote.url, exc)
        return 0
    data, added = merged(here or b"", there)
    if not added:
        return 0
    try:
        local.put(naming.METRICS_NAME, data)
    except OSError as exc:
        log.warning("checkpointing: could not add the records of %s's copy of %s here: %s", remote.url, naming.METRICS_NAME, exc)
        return 0
    log.info("checkpointing: %d records of earlier saves taken from the copy of %s on %s", added, naming.METRICS_NAME, remote.url)
    return added


def merged(local: bytes, remote: bytes) -> tuple[bytes, int]:
    """The local file's lines with the remote copy's lines it lacks, ordered by each record's `time` (stable: a
    line without one keeps the time of the line before it); and how many were added."""
    ours = _parsed(line for line in (raw.strip() for raw in local.splitlines()) if line)
    have = {line for line, _ in ours}
    known = [rec for _, rec in ours if rec is not None]
    extra = [(line, rec) for line, rec in _parsed(dict.fromkeys(
        line for line in (raw.strip() for raw in remote.splitlines()) if line and line not in have))
        if rec is None or not stands_in(rec, known)]  # (a stand-in: another node's recovered record of a save recorded here)
    if not extra:
        return local, 0
    entries = _times(extra) + _times(ours)  # the copy's first: of records of one time, those are the older
    order = sorted(range(len(entries)), key=lambda i: (entries[i][1], i))
    return b"".join(entries[i][0] + b"\n" for i in order), len(extra)


def _parsed(lines: Iterable[bytes]) -> list[tuple[bytes, dict | None]]:
    """Each line with its record (None: not a JSON object)."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        out.append((line, rec if isinstance(rec, dict) else None))
    return out


def _times(entries: list[tuple[bytes, dict | None]]) -> list[tuple[bytes, float]]:
    """Each line with its record's time (carried forward from the line before when it has none)."""
    out, t = [], -math.inf
    for line, rec in entries:
        v = rec.get("time") if rec is not None else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            t = float(v)
        out.append((line, t))
    return out
