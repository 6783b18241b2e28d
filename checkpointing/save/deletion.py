"""mgr.delete(step): one committed step off every tier of a manager, reference-safe (orchestration).

Deleting a step is retention's deletion for one named step (tier/collect.py, `delete_committed`):
its COMMIT goes first (from then on no reader restores it), then every file that no committed step
and no save in flight references. Files of the deleted step that later steps borrow chunks from
(incremental saves) stay until the last step that uses them goes (`checkpointing ls`: "retired").

Order. This manager's save and uploads in flight finish first (a save takes its chunks from the
newest step; an upload reads the local files and may send earlier steps' files to the remote tier),
so nothing of this process writes to a tier while it is collected; writers of other processes are
covered by the pins (tier/pins.py). Then the local tier (by its leader rank, which holds the writer
lock), then the remote tier (by rank 0): when the remote tier fails, the step is left there only
and delete(step) again finishes it (the other order could let a restart upload the step again).
Last, every rank drops the next save's reuse base if it was the deleted step (the save then writes
every chunk); a base of another step keeps what it borrows from alive, as its manifest references it.

The newest committed step is deleted only with allow_latest=True: deleting it by mistake loses the
latest progress. A rewind is restore(step=k), then delete the newer steps, then save k+1 on.

Across ranks delete() is a collective call, like restore(): every rank calls it with the same step.
The ranks meet twice through the store: before anything is deleted (each rank's check; a step one
rank cannot see, or a refusal, stops it on every rank with the same error; with missing_ok a rank
that does not see it takes part without deleting anything: a step some nodes lost, which the ranks
that hold it delete) and after (each tier's outcome). A rank that does not call it is named, once timeout_s has passed, in the error the others
get, instead of their waiting for ever.
"""

from __future__ import annotations

import logging

from checkpointing.dist.types import Coordinator
from checkpointing.errors import CheckpointError, CheckpointNotFoundError, group_by_cause
from checkpointing.format import naming
from checkpointing.save.inflight import InFlight
from checkpointing.save.uploader import Uploader
from checkpointing.save.worker import SaveWorker
from checkpointing.storage import Storage
from checkpointing.tier import catalog, collect

log = logging.getLogger("checkpointing")


class StepDeleter:
    """The delete() of one manager (training thread only); see the module docstring."""

    def __init__(self, local: Storage, remote: Storage | None, coord: Coordinator, *, inflight: InFlight,
                 worker: SaveWorker, uploader: Uploader | None) -> None:
        self._local, self._remote, self._coord = local, remote, coord
        self._inflight, self._worker, self._uploader = inflight, worker, uploader
        self._calls = 0  # the same on every rank: names this call's meeting points in the store
        self._restores = 0  # restore(step=None) calls: names their gathers
        self._passed: list[int] = []  # steps the last one passed over on some rank (save() deletes them)
        self._passed_from = 0  # the step it restored

    def delete(self, step: int, *, allow_latest: bool = False, missing_ok: bool = False) -> None:
        naming.check_step(step)
        self._passed = [s for s in self._passed if s != step]  # the same on every rank (a collective call)
        self._inflight.settle()
        self._worker.settle()  # local retention's files of retired steps are gone: one collector at a time
        n, self._calls = self._calls, self._calls + 1
        found, refused = self._check(step, allow_latest)
        if missing_ok and isinstance(refused, CheckpointNotFoundError):
            refused = None  # this rank's tiers do not hold it: the others delete it where they do
        self._meet(f"delete({step}) #{n}: a collective call, every rank calls delete() with the same step", refused)
        try:
            failed = self._delete(step, *found)
        finally:
            self._worker.forget(step)
            if self._uploader is not None:  # save() checks this view of the remote tier without a request
                self._uploader.saw_remote(removed={step})
                self._uploader.forget(step)
        self._meet(f"delete({step}) #{n}: done", failed)
        if any(found):
            log.info("checkpointing: rank %d: deleted step %d from %s", self._coord.rank, step, self._where())

    def retire_newer(self, chosen: int) -> None:
        """After restore(step=None) resumed from `chosen`: the newer committed steps it passed over
        (damaged on every copy, their data gone from every tier, or a lost node's part) go at the next
        save() (`passed_over`), so that the run saves those step numbers again (save() refuses a
        committed step). The ranks agree on them now (the union of what each sees); restoring alone,
        e.g. to evaluate, or one process reading one node's directory of a larger job, deletes nothing."""
        mine: set[int] = set()
        for storage in [self._local] + ([self._remote] if self._remote is not None else []):
            try:
                mine.update(s for s in catalog.list_steps(storage).committed if s > chosen)
            except (OSError, CheckpointError) as exc:
                log.warning("checkpointing: could not list %s for the steps newer than %d: %s", storage.url, chosen, exc)
        n, self._restores = self._restores, self._restores + 1
        seen = self._coord.gather(f"passed-over/{n}", {"steps": sorted(mine)})
        self._passed, self._passed_from = sorted(set().union(*(v["steps"] for v in seen))), chosen

    def passed_over(self) -> list[int]:
        """The steps the last restore(step=None) passed over on some rank, newest first, once (the same
        list on every rank): save() deletes them, collectively, before its step."""
        steps, self._passed = sorted(self._passed, reverse=True), []
        if steps and self._coord.rank == 0:
            log.warning("checkpointing: step(s) %s could not be restored%s (restore() resumed from step %d): training went on "
                        "from there, so they are deleted from every tier and saved again", _few(set(steps)),
                        " on every rank" if self._coord.world_size > 1 else "", self._passed_from)
        return steps

    def _where(self) -> str:
        return self._local.url + (f" and the remote tier {self._remote.url}" if self._remote is not None else "")

    def _check(self, step: int, allow_latest: bool) -> tuple[tuple[bool, bool], CheckpointError | None]:
        """Where `step` is committed (local tier, remote tier), or why it is not deleted."""
        where = self._local.url + (f" or on the remote tier {self._remote.url}" if self._remote is not None else "")
        try:
            local = set(catalog.list_steps(self._local).committed)
            remote = set(catalog.list_steps(self._remote).committed) if self._remote is not None else set()
        except (OSError, CheckpointError) as exc:
            return (False, False), CheckpointError(f"delete({step}): cannot list {where} ({exc}); nothing was deleted, try again")
        everywhere = local | remote
        if step not in everywhere:
            return (False, False), CheckpointNotFoundError(
                f"step {step} is not committed in {where}: nothing to delete (committed steps: {_few(everywhere)})")
        if step == max(everywhere) and not allow_latest:
            return (False, False), CheckpointError(
                f"step {step} is the newest committed step in {where}: delete it only on purpose, with "
                f"delete({step}, allow_latest=True) (a rewind: restore(step=k), delete the newer steps, then save k+1)")
        return (step in local, step in remote), None

    def _delete(self, step: int, on_local: bool, on_remote: bool) -> CheckpointError | None:
        """Each tier's part: its leader deletes on the local tier, rank 0 on the remote tier."""
        done = ""
        try:
            if on_local and self._coord.leader:
                collect.delete_committed(self._local, step)
                done = f" (it is deleted from the local tier {self._local.url} already)"
            if on_remote and self._coord.rank == 0 and self._remote is not None:
                collect.delete_committed(self._remote, step)
        except (OSError, CheckpointError) as exc:
            return CheckpointError(f"step {step} could not be deleted: {exc}{done}; call delete({step}) again to finish")
        return None

    def _meet(self, name: str, error: CheckpointError | None) -> None:
        """One rank: raise `error`. Several: wait for every rank at barrier `name`; every rank raises
        the errors any rank brought (CheckpointError naming the ranks), or CoordinationTimeout
        naming the ranks that did not come."""
        if self._coord.world_size == 1:
            if error is not None:
                raise error
            return
        tagged = None if error is None else (_NOT_FOUND if isinstance(error, CheckpointNotFoundError) else "") + str(error)
        failed = self._coord.errors_at(name, tagged)
        if failed:  # CheckpointNotFoundError when that is every rank's reason, as with one rank
            kind = CheckpointNotFoundError if all(t.startswith(_NOT_FOUND) for t in failed.values()) else CheckpointError
            raise kind(group_by_cause({r: t.removeprefix(_NOT_FOUND) for r, t in failed.items()}))


_NOT_FOUND = "<not found> "  # a rank's error at a delete barrier: the step is committed on none of its tiers


def _few(steps: set[int]) -> str:
    """Steps for a message: all of a few, else the first and the newest ones."""
    s = sorted(steps)
    if not s:
        return "none"
    return ", ".join(map(str, s)) if len(s) <= 8 else f"{s[0]}, ..., " + ", ".join(map(str, s[-5:]))
