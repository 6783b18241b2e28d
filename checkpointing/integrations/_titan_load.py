"""What a torchtitan step holds, and loading its model alone (layer: integrations; used by torchtitan.py).

Every step TieredCheckpointManager saves carries ``META`` = {"model_only": bool, "export_dtype":
str | None}: a full step (model, optimizer, schedulers, data, train state) or the model alone (the
last save with ``last_save_model_only``, or a seed checkpoint), whose floating-point tensors may be
in ``export_dtype``. `read_meta` reads it without reading any tensor; `restore_model` restores the
model of either kind into torchtitan's ModelWrapper, casting exported tensors back to the model's
dtypes; `open_initial` opens ``initial_load_path`` read-only, and refuses a checkpoint of another
format with the command that converts it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from typing import Any, Mapping

import torch
from torchtitan.components.checkpointer.base import MODEL, ModelWrapper

from checkpointing.errors import CheckpointConfigError, CheckpointMismatchError
from checkpointing.manager import CheckpointManager

META = "torchtitan"


@dataclasses.dataclass(frozen=True)
class StepMeta:
    model_only: bool
    export_dtype: str | None  # the floating-point tensors' dtype when the model was cast for export
    marked: bool = True  # False: the step was not saved by TieredCheckpointManager (no META)


def read_meta(mgr: CheckpointManager, step: int | None) -> tuple[int | None, StepMeta]:
    """The step `mgr.restore` takes for `step` (None: the newest; None when nothing is committed),
    and what it holds. Collective like restore; reads the manifest, no tensor."""
    target: dict[str, Any] = {META: {}}
    try:
        chosen = mgr.restore(target, step=step, only=META)
    except CheckpointMismatchError:  # saved by other means (checkpointing import, a CheckpointManager): no META
        latest = mgr.latest_step() if step is None else step
        return latest, StepMeta(model_only=latest == 0, export_dtype=None, marked=False)
    if chosen is None:
        return None, StepMeta(model_only=False, export_dtype=None, marked=False)
    meta = target[META]
    if not isinstance(meta, Mapping):
        raise CheckpointMismatchError(chosen, [f"{META}: saved as a {type(meta).__name__}, expected a dict"])
    dtype = meta.get("export_dtype")
    return chosen, StepMeta(bool(meta.get("model_only")), dtype if isinstance(dtype, str) else None)


def _cast(t: Any, dtype: torch.dtype) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype


def export_model(model: ModelWrapper, dtype: torch.dtype) -> tuple[Any, str | None]:
    """What a model-only save stores: the wrapper itself, or its state dict with floating-point
    tensors cast to `dtype` (fresh tensors) and that dtype's name."""
    sd = model.state_dict()
    if not any(_cast(v, dtype) for v in sd.values()):
        return model, None
    return {k: v.to(dtype) if _cast(v, dtype) else v for k, v in sd.items()}, str(dtype).removeprefix("torch.")


def restore_model(mgr: CheckpointManager, step: int, model: ModelWrapper, meta: StepMeta) -> None:
    """Restore only the model of `step` into `model` (in place, through its load_state_dict)."""
    sd = model.state_dict()
    saved = getattr(torch, meta.export_dtype, None) if meta.export_dtype else None
    if meta.export_dtype and not isinstance(saved, torch.dtype):
        raise CheckpointMismatchError(step, [f"{META}/export_dtype: {meta.export_dtype!r} is not a torch dtype"])
    if saved is None:
        target = dict(sd)
    else:  # read the exported tensors as saved, then let load_state_dict cast them into the model
        target = {k: torch.empty_like(v, dtype=saved) if _cast(v, saved) else v for k, v in sd.items()}
    mgr.restore({MODEL: target}, step=step, only=MODEL)
    model.load_state_dict(target)


def open_initial(path: str, storage_options: Mapping[str, Any] | None) -> CheckpointManager:
    """`initial_load_path` opened read-only: one of our checkpoint directories, or a tier URL."""
    if "://" in path:
        # read-only, the local tier need not exist: every step is read from the URL
        unused = os.path.join(tempfile.gettempdir(), f"checkpointing-initial-load-{uuid.uuid4().hex}")
        return CheckpointManager(unused, remote=path, storage_options=storage_options or None, read_only=True)
    foreign = _foreign_format(path)
    if foreign:
        raise CheckpointConfigError(
            f"checkpoint.initial_load_path={path!r} is a {foreign} checkpoint: convert it once with "
            f"`checkpointing import {path} DEST --step 0 --under {MODEL}` (--under {MODEL} for a model-only one) and "
            "set initial_load_path=DEST"
        )
    return CheckpointManager(path, read_only=True)


def _foreign_format(path: str) -> str | None:
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "torch.distributed.checkpoint (DCP)"
    if os.path.isdir(path) and any(name.endswith(".safetensors") or name == "model.safetensors.index.json" for name in os.listdir(path)):
        return "Hugging Face safetensors"
    return None
