"""Retention policies and tier states (pure)."""

from __future__ import annotations

from typing import Collection

LOCAL, REMOTE, BOTH = "local", "remote", "local+remote"


def steps_to_delete(committed: list[int], keep: int, *, protect: int | Collection[int] | None = None) -> list[int]:
    """The committed steps to remove so that only the newest `keep` remain; never those in `protect`."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    kept = set() if protect is None else {protect} if isinstance(protect, int) else set(protect)
    ordered = sorted(committed)
    doomed = ordered[:-keep] if len(ordered) > keep else []
    return [s for s in doomed if s not in kept]


def tier_states(local: Collection[int], remote: Collection[int] | None) -> dict[int, str]:
    """Each committed step -> where it is durable: 'local', 'local+remote' or 'remote' (ascending steps)."""
    remote = remote or ()
    both = set(local) | set(remote)
    return {s: BOTH if s in local and s in remote else LOCAL if s in local else REMOTE for s in sorted(both)}
