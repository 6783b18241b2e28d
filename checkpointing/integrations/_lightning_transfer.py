"""The weights Lightning's process launchers hand from a worker to the main process (layer: integrations).

Under `strategy="ddp_spawn"` or `"ddp_fork"` the trained module lives in worker processes; at the end
of `fit` rank 0's worker saves the module's bare `state_dict()` (no `global_step`: not a training
checkpoint) through the strategy's CheckpointIO to a temporary file, and the main process loads it
and removes the file. That file is no step of the manager: it is written with `torch.save` under a
mark of ours, and read back only with `torch.load(weights_only=True)`, which executes no pickled code.
"""

from __future__ import annotations

import os
import pickle
import secrets
from typing import Any

import torch

MARK = "_lightning_checkpoint_io_weights"


def is_weights(checkpoint: dict[str, Any]) -> bool:
    """A module's bare state_dict (tensors by name), not a Trainer checkpoint."""
    return "global_step" not in checkpoint and bool(checkpoint) and all(isinstance(v, torch.Tensor) for v in checkpoint.values())


def save(checkpoint: dict[str, Any], target: str) -> None:
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = f"{target}.{secrets.token_hex(6)}.tmp"
    try:
        torch.save({MARK: 1, "state_dict": checkpoint}, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def load(target: str, map_location: Any) -> dict[str, Any] | None:
    """The state_dict save() wrote at `target`; None when the file is not such a file."""
    try:
        with open(target, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # a torch.save zip file: what else is read here is never unpickled
                return None
        obj = torch.load(target, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, ImportError, AttributeError, pickle.UnpicklingError):
        return None  # not ours: a type weights_only refuses (a Lightning checkpoint's hyper-parameters), or damaged
    return obj["state_dict"] if isinstance(obj, dict) and obj.get(MARK) == 1 else None
