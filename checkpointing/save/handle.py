"""SaveHandle: what save() returns, a save in flight as the user sees it (orchestration).

The handle holds its job (save/job.py) and the one thing it needs from around it: `stall`, where
the time wait_staged() blocks the training thread is accounted (SaveAccounting.stall).
"""

from __future__ import annotations

import time

from checkpointing.errors import CheckpointError
from checkpointing.observe.metrics import SaveStats
from checkpointing.save.job import SaveJob, Stall


class SaveHandle:
    """A save in flight. `wait()` returns its SaveStats once committed, or raises its error."""

    def __init__(self, job: SaveJob, *, stall: Stall) -> None:
        self._job = job
        self._stall = stall
        self.step = job.step

    def done(self) -> bool:
        """Durable on every configured tier (or failed)."""
        upload = self._job.upload
        return self._job.outcome.done.is_set() and (upload is None or upload.done.is_set())

    def local_done(self) -> bool:
        """Committed on the local tier (or failed); with a remote tier the upload may still run."""
        return self._job.outcome.done.is_set()

    def wait_staged(self) -> None:
        """Block until the snapshot no longer reads live tensors (then they may be mutated)."""
        self._job.wait_staged(self._stall)

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the step is durable on every configured tier; return its SaveStats or raise its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._job.outcome.done.wait(timeout):
            raise CheckpointError(f"step {self.step} is not durable after {timeout} s; call wait() again or raise the timeout")
        self._job.raise_error()
        upload = self._job.upload
        if upload is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not upload.done.wait(left):
                raise CheckpointError(f"step {self.step} is committed locally but not yet on the remote tier after {timeout} s; "
                                      "call wait() again or raise the timeout")
            upload.raise_error()
        return self._job_stats()

    def _job_stats(self) -> SaveStats:
        assert self._job.outcome.stats is not None
        return self._job.outcome.stats

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"
