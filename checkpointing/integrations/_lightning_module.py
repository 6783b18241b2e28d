"""A LightningModule built from a checkpoint LightningCheckpointIO saved, for inference (layer: integrations).

Lightning's `MyModule.load_from_checkpoint("ckpts/last.ckpt")` reads the file with torch.load, and
at that path LightningCheckpointIO keeps a JSON pointer file, not a pickle: it fails. Instead:

    io = LightningCheckpointIO("/nvme/ckpt/run1")
    model = io.load_module(MyModule, "ckpts/last.ckpt", map_location="cpu")   # kwargs as load_from_checkpoint's

loads the checkpoint the pointer names (every chunk verified, nothing unpickled from disk) and hands
it to Lightning's own `load_from_checkpoint` through an in-memory torch.save of it, so that
hyper-parameters, `on_load_checkpoint`, `strict` and `map_location` behave as Lightning defines
them. The in-memory copy is unpickled with weights_only=False: its bytes were made in this process,
from values our decoder and the codecs built; nothing of it came from a pickle on disk. It holds the
checkpoint twice in memory while the module is built.
"""

from __future__ import annotations

import io
from typing import Any

import torch


def module_from(cls: type, checkpoint: dict[str, Any], **kwargs: Any) -> Any:
    """`cls.load_from_checkpoint` of the checkpoint dict LightningCheckpointIO.load_checkpoint returned."""
    if not (isinstance(cls, type) and callable(getattr(cls, "load_from_checkpoint", None))):
        raise TypeError(f"load_module(cls, path): cls must be a LightningModule or LightningDataModule class, got {cls!r}")
    kwargs.pop("weights_only", None)  # the bytes below are ours (see the module docstring)
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    buf.seek(0)
    return cls.load_from_checkpoint(buf, weights_only=False, **kwargs)
