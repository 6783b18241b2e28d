"""A step read whole by the integrations, from the manager's directory or else its remote tier.

Both the Lightning plugin (a pointer's step) and the Hugging Face mixin (a checkpoint folder rebuilt
from its step's record) read one step of their manager outside a restore (checkpointing.load: no
other rank takes part). A replaced node's directory lacks the step: then it is read from the remote
tier the manager uploads to.
"""

from __future__ import annotations

from typing import Any

import checkpointing
from checkpointing.errors import CheckpointNotFoundError


def load_any_tier(directory: str, step: int, remote: str | None, storage_options: Any, **load_args: Any) -> dict[str, Any]:
    """checkpointing.load(directory, step, **load_args), or of `remote` (with `storage_options`) where the
    directory lacks the step; CheckpointNotFoundError (the last tier's) when neither has it."""
    tiers = [(directory, None)] + ([(remote, storage_options)] if remote else [])
    missing: CheckpointNotFoundError | None = None
    for where, options in tiers:
        try:
            return checkpointing.load(where, step, options, **load_args)
        except CheckpointNotFoundError as exc:
            missing = exc
    assert missing is not None
    raise missing
