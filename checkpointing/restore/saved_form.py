"""What an object restored through its own load_state_dict() takes as saved, and what it cannot take (pure; layer: restore).

Restore reads a step into the tensors a target's `state_dict()` returns, in place, and checks the two
against each other before anything is read. Objects other than modules (optimizers, LR schedulers, a
user's replay buffer) get the saved values as they are from their `load_state_dict()`, so where the
target's template cannot be what the step holds, the saved form is taken (`takes_saved_form`):
- a number saved as a 0-d tensor, or the other way round (Adafactor's `relative_step` learning rate
  is a tensor once it has stepped, a fresh Adafactor's a float);
- a tensor with no elements in the target (a fresh instance's empty buffer: a module's
  `get_extra_state()`, a replay buffer) where the step holds a filled one.
A module's `_extra_state` is such a value too (its `set_extra_state()` takes the saved one). A module's
parameters and buffers keep their check: another shape there is a changed model.

What such an object would refuse only once the model beside it was read (`other_torch_class`): a torch
LR scheduler or optimizer class saved, another torch class now (StepLR into LambdaLR, Adam into SGD);
other torch classes (GradScaler into ShardedGradScaler) share their states. And targets no step can be
read into in place (`numpy_target`, `shared_elements`), named before anything is read.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from checkpointing.format.dtypes import dtype_from_name

EXTRA_STATE = "_extra_state"  # torch's key suffix for a module's get_extra_state()


def in_extra_state(path: tuple) -> bool:
    """`path` lies in a module's extra state."""
    return any(isinstance(k, str) and (k == EXTRA_STATE or k.endswith("." + EXTRA_STATE)) for k in path)


def takes_saved_form(target: Any, node: dict, tensors: Sequence[Any]) -> bool:
    """`target` cannot hold the saved `node` and is a template its object replaces (see the module docstring)."""
    if "tensor" in node or "ndarray" in node:
        entry = tensors[node.get("tensor", node.get("ndarray"))]
        if type(target) in (int, float):
            return entry.shape == ()
        if isinstance(target, (torch.Tensor, np.ndarray)) and not isinstance(target, torch.nn.Parameter):
            if isinstance(target, torch.Tensor) and target.device.type == "meta":
                return False
            same = tuple(target.shape) == entry.shape and (not isinstance(target, torch.Tensor) or target.dtype == dtype_from_name(entry.dtype))
            return not same and (target.size == 0 if isinstance(target, np.ndarray) else target.numel() == 0)
        return False
    saved = node.get("value", 0.0 if "float" in node else None)
    return type(saved) in (int, float) and isinstance(target, torch.Tensor) and target.dim() == 0


def is_scheduler(obj: Any) -> bool:
    """An LR scheduler of torch's: its subclasses' states differ (StepLR into LambdaLR fails in load_state_dict)."""
    lr = torch.optim.lr_scheduler
    return isinstance(obj, tuple(c for c in (getattr(lr, "LRScheduler", None), getattr(lr, "ReduceLROnPlateau", None)) if c is not None))


def qualified(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def other_torch_class(target: Any, node: dict, key: str) -> str | None:
    """The problem when the step saved another torch class's state than the torch class of `target`."""
    saved, cls = str(node.get("class", "")), qualified(target)
    if saved == cls or not (saved.startswith("torch.") and cls.startswith("torch.")):
        return None
    return (f"saved from a {saved}, the target is a {cls}: its state does not fit (restore into the class it was saved "
            f"from, or leave it out with exclude=[{key!r}])")


def numpy_target(a: np.ndarray) -> tuple[torch.Tensor | None, str]:
    """A tensor writing into the numpy array `a` in place, else None and why not (a clause for an error)."""
    if not a.flags.writeable:
        return None, " (read-only: pass a writable array, e.g. a.copy())"
    if a.dtype.kind not in "biufc":
        return None, " (not numeric)"
    if not a.dtype.isnative:
        return None, " (not in native byte order: pass a.astype(a.dtype.newbyteorder('=')))"
    if any(stride < 0 for stride in a.strides):
        return None, " (a reversed view: torch cannot write through negative strides; pass np.ascontiguousarray(a))"
    try:
        return torch.from_numpy(a), ""
    except (ValueError, TypeError) as exc:  # a dtype torch lacks
        return None, f" (torch cannot write into it: {str(exc).splitlines()[0][:160]})"


def shared_elements(t: torch.Tensor) -> str | None:
    """Why the tensor `t` cannot take a step's values in place: elements sharing memory (an expand()ed view)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if any(stride == 0 and size > 1 for size, stride in zip(local.shape, local.stride())):
        return "the target is an expand()ed view, whose elements share memory: pass a tensor of its own (t.clone())"
    return None
