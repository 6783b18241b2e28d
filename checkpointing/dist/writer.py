"""Who writes a local tier: its leader rank takes the tier's writer lock, every rank learns the outcome.

Layer: dist. At a manager's start the leader rank of each local tier (the lowest rank using it) takes
the tier's lock (tier/lock.py) and, holding it, tidies the tier (removes what crashed saves left);
then every rank meets at the "started" barrier, which carries the leaders' errors: when one leader
cannot take its lock, every rank of the job raises the same DirectoryLockedError naming the holder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from checkpointing.dist.types import Coordinator
from checkpointing.tier import lock
from checkpointing.tier.lock import WriterLock


def start_writing(coord: Coordinator, root: Path, tidy: Callable[[], None]) -> WriterLock | lock.NotHeld:
    """The writer lock this rank holds (NotHeld: another rank of its tier holds it for it)."""
    held: WriterLock | None = None
    error: Exception | None = None
    if coord.leader:
        try:
            held = lock.acquire(root)
            if held.first:  # a second manager of this process on the directory does not tidy under the first
                tidy()
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it at the barrier, not wait for it
            error = exc
    try:
        coord.barrier("started", error=None if error is None else str(error))
    except BaseException:
        coord.close()  # leave together: rank 0 may host the store the others still read the verdict from
        if held is not None:
            held.release()
        if error is not None:
            raise error from None
        raise
    return lock.NotHeld() if held is None else held
