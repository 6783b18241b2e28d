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
from checkpointing.restore.selection import plain_name

log = logging.getLogger("checkpointing")


def has_pre_hooks(module: torch.nn.Module) -> bool:
    return any(m._load_state_dict_pre_hooks for m in module.modules())


def hooked_names(module: torch.nn.Module, saved: list[tuple[Any, dict]], own: Mapping[str, Any], tensors: Any) -> dict[str, str] | None:
    """Saved key -> the module's own key, for the saved keys the module's pre-hooks rename onto its own
    names; None when they rename nothing one to one (or raise). The hooks see names without wrapper segments
    (torch.compile's `_orig_mod.`): a step saved from a compiled module meets a plain one, and the reverse."""
    if any(isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params() for m in module.modules()):
        return None  # its hook would materialize the parameters (and restore refuses it anyway: run a forward first)
    if not all(isinstance(key, str) for key, _ in saved):
        return None
    plain_own = {plain_name(k): k for k in own}
    stand_ins: dict[int, str] = {}
    state: dict[str, Any] = {}
    for key, node in saved:
        value = _stand_in(node, tensors)
        stand_ins[id(value)] = key
        state[plain_name(key)] = value
    if len(state) != len(saved) or len(plain_own) != len(own):
        return None  # two names that differ only by wrappers: no one-to-one renaming to learn
    landed: dict[str, str] = {}  # own key -> saved key whose stand-in ended under it

    def walk(m: torch.nn.Module, local: dict, prefix: str) -> None:
        if not any(name in _WRAPPER_SEGMENTS for name in m._modules):  # a wrapper's own hooks add its segment
            for hook in m._load_state_dict_pre_hooks.values():  # no version metadata: the step's versions are not
                hook(local, prefix, {}, True, [], [], [])  # recorded, so a hook renaming only an old version's keys is followed too
        for key, value in local.items():
            if key in plain_own and id(value) in stand_ins:
                landed[plain_own[key]] = stand_ins[id(value)]
        for name, child in m._modules.items():
            if child is not None:
                inner = prefix if name in _WRAPPER_SEGMENTS else prefix + name + "."
                walk(child, {k: v for k, v in local.items() if k.startswith(inner)}, inner)

    try:
        walk(module, dict(state), "")
    except Exception as exc:  # noqa: BLE001 - the user's hooks on stand-ins: no renaming learnt, keys meet as they are
        log.debug("checkpointing: load_state_dict pre-hooks of %s on stand-ins raised %r", type(module).__name__, exc)
        return None
    renamed = {saved_key: key for key, saved_key in landed.items() if key != saved_key}
    kept = {key for key, _ in saved if key not in renamed}
    if not renamed or len(set(landed.values())) != len(landed) or any(k in kept for k in renamed.values()):
        return None
    return renamed


_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _stand_in(node: dict, tensors: Any) -> Any:
    if "tensor" in node:
        entry = tensors[node["tensor"]]
        return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
    return object()
