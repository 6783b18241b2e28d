"""A framework's saves go on past a failed upload (layer: integrations; no framework import here).

CheckpointManager.save() raises the CheckpointUploadError of the upload before last when it waits for
it, and saves nothing then, and wait() raises it too (the core's contract: a loop of its own decides). A
framework's trainer has no place to decide: the failure is logged (the manager logged it too), the local
step stays committed, the save is made, and the end of training does not fail for it (README, "Training
frameworks").
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from checkpointing.errors import CheckpointSaveError, CheckpointUploadError
from checkpointing.manager import CheckpointManager, SaveHandle

log = logging.getLogger("checkpointing")


def save_past_upload_errors(mgr: CheckpointManager, step: int, tree: Mapping[str, Any], **options: Any) -> SaveHandle:
    """mgr.save(step, tree, **options), made even when an earlier step's upload failed."""
    try:
        return mgr.save(step, tree, **options)
    except CheckpointUploadError as exc:
        log.warning("checkpointing: saving step %d although %s", step, exc)
        return mgr.save(step, tree, **options)


def wait_past_upload_errors(mgr: CheckpointManager, who: str) -> CheckpointSaveError | None:
    """mgr.wait(), past failed uploads (each logged once: its step is committed locally); the first error of a save
    that did not commit locally, returned (the manager raises each error once)."""
    for _ in range(10_000):  # each failed upload is raised once: this ends
        try:
            mgr.wait()
            return None
        except CheckpointUploadError as exc:
            log.warning("checkpointing: %s: %s (the step is committed locally; training was not stopped for it)", who, exc)
        except CheckpointSaveError as exc:
            return exc
    return None
