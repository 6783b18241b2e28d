"""A framework's save goes on past an earlier step's failed upload (layer: integrations; no framework import here).

CheckpointManager.save() raises the CheckpointUploadError of the upload before last when it waits for
it, and saves nothing then (the core's contract: a loop of its own decides). A framework's trainer has no
place to decide: the failure is logged (the manager logged it too), the local step stays committed, and
the save is made; the error is not raised again.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from checkpointing.errors import CheckpointUploadError
from checkpointing.manager import CheckpointManager, SaveHandle

log = logging.getLogger("checkpointing")


def save_past_upload_errors(mgr: CheckpointManager, step: int, tree: Mapping[str, Any], **options: Any) -> SaveHandle:
    """mgr.save(step, tree, **options), made even when an earlier step's upload failed."""
    try:
        return mgr.save(step, tree, **options)
    except CheckpointUploadError as exc:
        log.warning("checkpointing: saving step %d although %s", step, exc)
        return mgr.save(step, tree, **options)
