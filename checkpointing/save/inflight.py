"""The saves a manager issued and has not yet reported: the newest save, the uploads not yet waited for (orchestration).

The training thread owns this object: save() adds each job (SaveIssuer) after waiting here for the
one before it, wait(), restore() and delete() wait here, the optimizer step pre-hook guards the newest save.
The background threads only read `steps()` (local retention leaves a save in flight alone).

Saves run one at a time: a save requested while the previous one still writes waits for it
(reported as wait_prev_s), because both would share the one staging pool. With a remote tier at
most one step uploads while the next one is written: save() waits for every upload but the newest.
"""

from __future__ import annotations

import time

from checkpointing.errors import CheckpointError, CheckpointTimeoutError
from checkpointing.save.job import SaveJob, Stall, UploadJob


class InFlight:
    """The newest save (`current`) and the uploads not yet waited for and reported, in upload order.
    `stall` accounts the guard's waits (SaveAccounting.stall)."""

    def __init__(self, stall: Stall) -> None:
        self.current: SaveJob | None = None
        self.uploads: list[UploadJob] = []
        self._relaid: list[UploadJob] = []  # resumed uploads of steps saved at another world size (before_restore)
        self._stall = stall

    def resumed(self, uploads: list[UploadJob], world_size: int) -> None:
        """Uploads an earlier process left unfinished, resumed at start-up; those of steps saved at another
        world size are waited for before a restore (`before_restore`)."""
        self.uploads.extend(uploads)
        self._relaid = [u for u in uploads if u.committed is not None and u.committed.world_size != world_size]

    def before_restore(self) -> None:
        """restore() chooses its step across ranks: the newest save finished locally, and a resumed upload of a
        step saved at another world size finished too (a rank of this layout may read that step only from the
        remote tier, and would pass it over for an older one). Their errors stay as resumed uploads' do (logged)."""
        self.wait_local()
        relaid, self._relaid = self._relaid, []
        for up in relaid:
            up.wait()

    def add(self, job: SaveJob) -> None:
        """The save just issued (and its upload, if any)."""
        if job.upload is not None:
            self.uploads.append(job.upload)
        self.current = job

    def forked(self) -> None:
        """In a child forked from this process (save/live.py): the saves and uploads in flight run in the parent's
        threads, which are not here; each ends failed here, so that a wait in the child returns at once."""
        error = CheckpointError("this save runs in the process this one was forked from: it is waited for there")
        job = self.current
        if job is not None and not job.outcome.done.is_set():
            job.outcome.error, job.outcome.error_reported = error, True
            job.staging.release()
            job.outcome.done.set()
        for up in self.uploads:
            if not up.done.is_set():
                up.error, up.error_reported = error, True
                up.done.set()

    def steps(self) -> set[int]:
        """The step of a save still in flight (any thread)."""
        current = self.current
        return {current.step} if current is not None and not current.outcome.done.is_set() else set()

    def wait_previous(self) -> bool:
        """Before a save: wait for the previous save and every upload but the newest, raising their
        errors (each once); whether there was anything to wait for."""
        prev = self.current
        if prev is not None:
            prev.outcome.wait()
            prev.raise_error()
        older = self.uploads[:-1]  # every upload but the newest: done on every rank once waited for
        for up in older:
            up.wait()
        if older:
            self.uploads = self.uploads[-1:]
            for up in older:
                up.raise_error()
        return prev is not None or bool(older)

    def wait(self, timeout: float | None = None) -> None:
        """Every save durable on every configured tier; raise the error of a failed one (once)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.current
        if job is not None:
            if not job.outcome.wait(timeout):
                raise CheckpointTimeoutError(f"step {job.step} is not durable after {timeout} s; call wait() again or raise the timeout")
            job.raise_error()
        uploads = list(self.uploads)
        for up in uploads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not up.wait(left):
                raise CheckpointTimeoutError(f"step {up.step} is not on the remote tier after {timeout} s; call wait() again or raise the timeout")
        self.uploads = [u for u in self.uploads if u not in uploads]
        for up in uploads:
            up.raise_error()

    def settle(self) -> None:
        """The newest save has finished and so has every upload (delete(): nothing of this manager
        writes to a tier meanwhile); their errors stay for the next save()/wait()."""
        self.wait_local()
        for up in list(self.uploads):
            up.wait()

    def wait_local(self) -> None:
        """The newest save has finished on the local tier (its error stays for later)."""
        if self.current is not None:
            self.current.outcome.wait()

    def wait_staged(self) -> None:
        """The newest save no longer reads live tensors."""
        if self.current is not None:
            self.current.wait_staged(self._stall)

    def guard(self) -> None:
        """The optimizer step pre-hook: a save still in flight must have staged what it reads."""
        job = self.current
        if job is not None and not job.outcome.done.is_set():
            job.wait_staged(self._stall)
