"""One error hierarchy. Every message says what went wrong, where, and how to fix it."""

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
