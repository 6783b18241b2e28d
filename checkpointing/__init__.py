"""checkpointing: sharded, asynchronous, verified checkpoints for PyTorch training.

    from checkpointing import CheckpointManager
    with CheckpointManager("/nvme/ckpt/run1", keep_local=2) as mgr:
        last = mgr.restore(state)               # None: nothing saved yet
        start = 0 if last is None else last + 1
        for step in range(start, steps):
            train_step()
            if step % 100 == 0:
                mgr.save(step, state)   # returns after a memory copy; durable in the background
"""

from checkpointing.state.codecs import Codec, PickleCodec
from checkpointing.errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    CheckpointPeerError,
    CheckpointUploadError,
    ManifestError,
    StateError,
)
from checkpointing.manager import CheckpointManager, SaveHandle
from checkpointing.observe.metrics import SaveStats
from checkpointing.plan.retention import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepSteps, RetentionPolicy
from checkpointing.restore.load import load
from checkpointing.state.rng import RNGState

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "load",
    "KeepLatest",
    "KeepEvery",
    "KeepBest",
    "KeepSteps",
    "KeepAny",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "RNGState",
    "Codec",
    "PickleCodec",
    "CheckpointError",
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "CheckpointPeerError",
    "CheckpointUploadError",
    "ManifestError",
    "StateError",
]
