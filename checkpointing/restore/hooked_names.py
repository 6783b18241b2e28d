"""A module's own renames of saved keys: its load_state_dict pre-hooks, run on stand-ins (layer: restore).

Model code that renames a submodule keeps old checkpoints loading with a load_state_dict pre-hook that
moves the old keys to the new names (`sd[prefix + "proj.weight"] = sd.pop(prefix + "lin.weight")`).
torch's load_state_dict() runs such hooks before it matches keys; restore matches keys before it reads
anything (in place, into the module's own tensors), so it asks the hooks first: it runs every pre-hook
of the module tree, in torch's order and with torch's per-module views of the state dict, on stand-ins
for the saved values (meta tensors of the saved shapes; an object for anything else), and follows each
stand-in to the name it ends under. Only where that maps saved keys one to one onto the module's own
names is the renaming used; a hook that makes new values (splits, converts) is not a renaming, and the
keys then meet as they are (the mismatch is reported as before).

The hooks run again, for real, in the load_state_dict() that applies the step, on the module's own
names: a pre-hook must accept what the module's state_dict() gives.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from checkpointing.format.dtypes import dtype_from_name

log = logging.getLogger("checkpointing")


def has_pre_hooks(module: torch.nn.Module) -> bool:
    return any(m._load_state_dict_pre_hooks for m in module.modules())


def hooked_names(module: torch.nn.Module, saved: list[tuple[Any, dict]], own: Mapping[str, Any], tensors: Any) -> dict[str, str] | None:
    """Saved key -> the module's own key, for the saved keys the module's pre-hooks rename onto its own
    names; None when they rename nothing one to one (or raise)."""
    if any(isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params() for m in module.modules()):
        return None  # its hook would materialize the parameters (and restore refuses it anyway: run a forward first)
    stand_ins: dict[int, str] = {}
    state: dict[str, Any] = {}
    for key, node in saved:
        if not isinstance(key, str):
            return None
        value = _stand_in(node, tensors)
        stand_ins[id(value)] = key
        state[key] = value
    landed: dict[str, str] = {}  # own key -> saved key whose stand-in ended under it

    def walk(m: torch.nn.Module, local: dict, prefix: str) -> None:
        for hook in m._load_state_dict_pre_hooks.values():  # no version metadata: the step's versions are not recorded, so
            hook(local, prefix, {}, True, [], [], [])  # a hook renaming only an old version's keys is followed too
        for key, value in local.items():
            if key in own and id(value) in stand_ins:
                landed[key] = stand_ins[id(value)]
        for name, child in m._modules.items():
            if child is not None:
                walk(child, {k: v for k, v in local.items() if k.startswith(prefix + name + ".")}, prefix + name + ".")

    try:
        walk(module, dict(state), "")
    except Exception as exc:  # noqa: BLE001 - the user's hooks on stand-ins: no renaming learnt, keys meet as they are
        log.debug("checkpointing: load_state_dict pre-hooks of %s on stand-ins raised %r", type(module).__name__, exc)
        return None
    renamed = {saved_key: key for key, saved_key in landed.items() if key != saved_key}
    if not renamed or len(set(landed.values())) != len(landed) or any(k in state and k not in renamed for k in renamed.values()):
        return None
    return renamed


def _stand_in(node: dict, tensors: Any) -> Any:
    if "tensor" in node:
        entry = tensors[node["tensor"]]
        return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
    return object()
