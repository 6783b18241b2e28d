"""Which tensor storages change only inside a guarded optimizer.step() (orchestration, training thread).

The manager's optimizer step pre-hook (the guard) sees every ``torch.optim.Optimizer.step()`` in the
process. The optimizers it has seen step, and those passed to save() as objects, are remembered
here (weakly: a dropped optimizer is forgotten). Their parameters and their per-parameter state
(Adam's moments, step counts) change only inside step(), which the guard holds until a save in
flight has copied them. So a tensor that shares memory with one of them may be copied after
save() returns, however it reached save(): the optimizer object, its ``state_dict()``, a module's
``state_dict()``, DCP's ``get_state_dict`` output or a framework's checkpoint dict. Buffers
(BatchNorm statistics) change in forward and stay eager; so does anything of an optimizer not seen
yet (the first save before any step is eager for plain tensors).

A tensor is matched by the address of its storage: live storages do not share addresses, and
views of a parameter share its storage. Empty storages (address 0) never match.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Mapping

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from checkpointing.state.tree import Owners, owners


class SteppedOptimizers:
    """The optimizers the guard watches, and the storages of their parameters and state."""

    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()

    def saw(self, optimizer: Optimizer) -> None:
        """The guard saw `optimizer` step (or it was passed to save())."""
        if optimizer not in self._optimizers:
            self._optimizers.add(optimizer)

    def saw_in(self, state: Mapping[str, Any]) -> None:
        """Remember the optimizers among the top-level values of a state passed to save()."""
        for value in state.values():
            if isinstance(value, Optimizer):
                self.saw(value)

    def storages(self) -> Owners:
        """The storages only optimizer.step() of a watched optimizer mutates, by address, with the tensors the
        optimizers hold there (state/tree.owners: a write to them after save() is checked on their counters too)."""
        out: dict[int, dict] = {}
        for opt in list(self._optimizers):
            params = [p for group in opt.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]
            state = [v for per_param in opt.state.values() if isinstance(per_param, Mapping)
                     for v in per_param.values() if isinstance(v, torch.Tensor)]
            for address, views in owners(params + state).items():
                for view, held in views.items():
                    out.setdefault(address, {}).setdefault(view, held)
        return out


def register_guard(hook: Callable[..., Any]) -> RemovableHandle:
    """`hook` as a global optimizer step pre-hook that runs before every other one: a pre-hook the user
    registered earlier (decoupled weight decay: p.mul_()) must not change parameters a snapshot still reads.
    Global pre-hooks run in the order of torch's registry, before each optimizer's own."""
    handle = register_optimizer_step_pre_hook(hook)
    registry = getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
    if isinstance(registry, collections.OrderedDict) and handle.id in registry:
        registry.move_to_end(handle.id, last=False)
    return handle
