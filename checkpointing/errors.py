"""One error hierarchy, rooted at CheckpointError. Every message says what went wrong, where, and how to fix it.

Layer: the bottom of the package; imports nothing of it. The storage backends keep their
translation of service errors (storage/retry.py: RemoteStorageError, itself a CheckpointError).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error this library raises."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An option or argument is invalid."""


class CheckpointSaveError(CheckpointError):
    """A save failed (in the background or while snapshotting). Nothing was committed for it."""

    def __init__(self, step: int, cause: BaseException | str) -> None:
        self.step = step
        self.cause = cause
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"save of step {step} failed: {reason}. Nothing was committed for step {step}; "
            "earlier committed steps are intact. Fix the cause and save again."
        )


class CheckpointUploadError(CheckpointSaveError):
    """A step committed on the local tier could not be made durable on the remote tier.

    A CheckpointSaveError, so code that handles failed saves handles it too; unlike other save
    errors the step IS committed (locally) and restorable.
    """

    def __init__(self, step: int, remote: str, cause: BaseException | str) -> None:
        self.step = step
        self.cause = cause
        self.remote = remote
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        CheckpointError.__init__(
            self,
            f"upload of step {step} to the remote tier {remote} failed: {reason}. Step {step} is committed on the "
            "local tier and restorable from there; the next save uploads its own step again, and a manager started "
            "on this directory resumes the upload of newer local steps.",
        )


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A wait for a save (handle.wait/result/exception, mgr.wait) ran out of its timeout; the save goes on."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes do not match what the manifest promises (bit rot, truncation, tampering)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the target state: every problem is listed at once."""

    def __init__(self, step: int, problems: list[str]) -> None:
        self.step = step
        self.problems = list(problems)
        lines = "\n  - ".join(self.problems)
        super().__init__(
            f"checkpoint step {step} does not match the state passed to restore "
            f"({len(self.problems)} problem(s)):\n  - {lines}\n"
            "Pass the same kinds of objects that were saved, or restore(..., strict=False) to "
            "skip keys that exist on only one side."
        )


class CheckpointNotFoundError(CheckpointError, LookupError):
    """A requested step is not committed in the checkpoint directory."""


class ManifestError(CheckpointCorruptError):
    """A manifest or commit marker is malformed, of an unknown version, or unsafe."""


class StateError(CheckpointError, TypeError):
    """The state passed to save() holds something that cannot be checkpointed."""


class RanksFailedError(CheckpointError):
    """A step failed on some ranks; `failures` maps each failing rank to its cause."""

    def __init__(self, step: int, failures: dict[int, str]) -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        causes = "; ".join(f"rank {r}: {c}" for r, c in self.failures.items())
        super().__init__(f"step {step} failed on {len(self.failures)} rank(s): {causes}")


class CoordinationTimeout(CheckpointError):
    """A rank did not answer in time: it died, hangs, or is far slower than the others."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks or []  # the ranks that did not answer


class CoordinationLost(CheckpointError):
    """The torch.distributed store is unreachable (its host process is gone)."""


class PeerFailed(CheckpointError):
    """Another rank reported that its part of the step failed (this rank stops waiting for it)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} failed")
        self.peer = rank


class UploadRanksFailed(CheckpointError):
    """The remote commit of a step was refused because some ranks failed; `failures` maps rank -> cause."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        super().__init__(f"{len(self.failures)} rank(s) failed: " + "; ".join(f"rank {r}: {c}" for r, c in self.failures.items()))


class MergeError(CheckpointError):
    """The ranks' reports of one save do not form one consistent manifest; `problems` lists why."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else ""))


class CommitConflictError(CheckpointError):
    """Another writer committed the same step on a tier first (its COMMIT names another manifest)."""


class DirectoryLockedError(CheckpointError):
    """Another process holds the writer lock of a local checkpoint directory (tier/lock.py)."""
