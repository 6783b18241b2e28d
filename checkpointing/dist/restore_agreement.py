"""Which step every rank restores, from each rank's view of what it can read (pure; layer: dist).

Each rank lists the committed steps it can read (every shard it needs is on its local tier, or the
remote tier holds the step), with a note saying why not the others, or the error that stopped it.
The answer is the requested step when every rank can read it, else the newest step every rank can
read; when there is none, the error names each rank that cannot read the newest committed step
(ranks with the same reason once, as "ranks 0-3").
"""

from __future__ import annotations

import dataclasses

from checkpointing.errors import CheckpointError, cause_groups, group_by_cause, rank_ranges


@dataclasses.dataclass(frozen=True)
class RestoreView:
    """One rank's answer: the steps it can read, why it cannot read others, or its error."""

    readable: list[int]
    note: str
    error: str | None = None
    requested: int | None = None  # the step this rank asked for (every rank must ask for the same)


def agreed_step(views: list[RestoreView], requested: int | None) -> int | None:
    """The step to restore (None: nothing is committed anywhere); CheckpointError when ranks cannot agree."""
    failed = {r: v.error for r, v in enumerate(views) if v.error}
    if failed:
        raise CheckpointError("restore failed on " + group_by_cause(failed))
    common = set(views[0].readable).intersection(*(v.readable for v in views[1:]))
    asked = {v.requested for v in views}
    if len(asked) > 1:  # restore() is collective: one step for every rank
        by_step: dict[int, str] = {r: "step=None" if v.requested is None else f"step={v.requested}" for r, v in enumerate(views)}
        raise CheckpointError("the ranks asked restore() for different steps (" + group_by_cause(by_step)
                              + "): every rank must pass the same step, or step=None on every rank")
    if requested is not None:
        lacking = [r for r, v in enumerate(views) if requested not in v.readable]
        if lacking:
            raise CheckpointError(f"step {requested} cannot be restored: " + _who_cannot(lacking, views))
        return requested
    if common:
        return max(common)
    seen = set().union(*(v.readable for v in views))
    if not seen:
        return None
    newest = max(seen)
    lacking = [r for r, v in enumerate(views) if newest not in v.readable]
    raise CheckpointError(
        f"no step can be restored on every rank: step {newest} is committed but " + _who_cannot(lacking, views)
        + ". Restore on the ranks' original machines, or configure a remote tier (remote=...) that holds every rank's data"
    )


def _who_cannot(ranks: list[int], views: list[RestoreView]) -> str:
    return "; ".join(f"{rank_ranges(rs)} cannot read it ({note})" for rs, note in cause_groups({r: views[r].note for r in ranks}))
