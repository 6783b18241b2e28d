"""Retention policies (pure)."""

from __future__ import annotations


def steps_to_delete(committed: list[int], keep: int, *, protect: int | None = None) -> list[int]:
    """The committed steps to remove so that only the newest `keep` remain; never `protect`."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    ordered = sorted(committed)
    doomed = ordered[:-keep] if len(ordered) > keep else []
    return [s for s in doomed if s != protect]
