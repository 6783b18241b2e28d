"""Restore the newest step whose every byte reads clean (layer: restore; collective with several ranks).

Targets are filled in place, each chunk verified as it lands (reading.py). A chunk that fails
verification on every copy it has (local tier, peer copy, remote tier) is found only while reading,
when the targets read before it already hold the step's bytes and the damaged chunk's bytes lie in
its target. So the ranks compare notes after reading and before applying anything
(load_state_dict, the primitives); when any rank found damage, every rank:

- with a requested `step`: raises CheckpointCorruptError saying which targets were overwritten;
- else: restores the next older step every rank can read, which overwrites every target again
  (a warning names the damaged step), until one reads clean; when none is left it raises the
  damage, saying the targets were partly overwritten.

Any other error on a rank stops every rank (CheckpointError naming it): no rank applies a step
another rank could not read, and an error while applying (a user's load_state_dict()) reaches every
rank at once.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Callable, MutableMapping

from checkpointing.dist.types import Coordinator
from checkpointing.errors import CheckpointCorruptError, CheckpointError, group_by_cause
from checkpointing.restore.planner import RestorePlan, apply, read_all
from checkpointing.restore.reading import Sources

log = logging.getLogger("checkpointing")

Chooser = Callable[..., tuple[int | None, dict[int, tuple[RestorePlan, Sources]]]]  # choose(below=...) -> (step, plans)


def restore_clean(state: MutableMapping, step: int | None, choose: Chooser, coord: Coordinator, *, name: str,
                  before_read: Callable[[], None] = lambda: None) -> tuple[int | None, Sources | None]:
    """Restore into `state` the requested `step`, or the newest step every rank reads clean; the step
    and where its bytes came from ((None, None): nothing is committed). `choose(below)` picks the
    step among those older than `below` (None: any) with every rank; `name` is unique to this call
    on every rank (the ranks' notes are exchanged under it)."""
    below, damaged = None, None
    for attempt in itertools.count():
        try:
            chosen, plans = choose(below=below)
        except CheckpointError as exc:
            if damaged is None:
                raise
            raise _overwritten(damaged, f"No older step could be restored instead ({exc})") from None
        if chosen is None:
            if damaged is None:
                return None, None
            raise _overwritten(damaged, "No older step is committed")
        plan, sources = plans[chosen]
        before_read()
        error = _read(plan, sources, coord, f"{name}-{attempt}")
        if error is None:
            _apply(plan, state, coord, f"{name}-{attempt}-applied")
            return chosen, sources
        damaged = error
        if step is not None:
            raise _overwritten(damaged, f"Step {step} was requested by name (step=None restores the newest step that reads clean)")
        log.warning("checkpointing: rank %d cannot restore step %d, its data is damaged on every copy (%s); restoring an older step",
                    coord.rank, chosen, damaged)
        below = chosen
    raise AssertionError("itertools.count() ended")


def _read(plan: RestorePlan, sources: Sources, coord: Coordinator, name: str) -> CheckpointCorruptError | None:
    """read_all on every rank, then the ranks' notes compared: the damage any rank found, or None
    when every rank read clean; another error on any rank is raised on every rank."""
    mine: BaseException | None = None
    try:
        read_all(plan, sources)
    except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised here
        mine = exc
    note = None if mine is None else json.dumps({"damaged": isinstance(mine, CheckpointCorruptError), "error": f"{type(mine).__name__}: {mine}"})
    notes = {r: json.loads(n) for r, n in coord.errors_at(name, note).items()}
    if mine is not None and not isinstance(mine, CheckpointCorruptError):
        raise mine
    failed = {r: n["error"] for r, n in notes.items() if not n["damaged"]}
    if failed:
        raise CheckpointError(f"restoring step {plan.manifest.step} failed on " + group_by_cause(failed))
    if isinstance(mine, CheckpointCorruptError):
        return mine
    if notes:
        return CheckpointCorruptError(f"step {plan.manifest.step}: damaged data found on " + group_by_cause({r: n["error"] for r, n in notes.items()}))
    return None


def _apply(plan: RestorePlan, state: MutableMapping, coord: Coordinator, name: str) -> None:
    """apply() on every rank, then the ranks compare notes: what it raised on any rank (a user's load_state_dict())
    is raised on every rank, at once, rather than leaving the others to wait for it in their next collective call."""
    mine: BaseException | None = None
    try:
        apply(plan, state)
    except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised here
        mine = exc
    failed = coord.errors_at(name, None if mine is None else f"{type(mine).__name__}: {mine}")
    if mine is not None:
        raise mine
    if failed:
        raise CheckpointError(f"restoring step {plan.manifest.step} failed on " + group_by_cause(failed) + " (this rank's state "
                              "holds the step's values; the failing rank's holds part of them: restore again on every rank)")


def _overwritten(damage: CheckpointCorruptError, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{damage}. {why}. The tensors read before the damage was found were overwritten in place (some may hold damaged "
        "bytes); nothing else was applied: do not train on them, restore another step first"
    )
