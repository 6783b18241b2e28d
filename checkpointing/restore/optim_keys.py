"""Optimizer state saved keyed by position restores into a target keyed by name, and back (pure; layer: restore).

`Optimizer.state_dict()` keys each parameter's state by its position (0, 1, ...) and lists those
positions in `param_groups[i]["params"]`; torch.distributed.checkpoint's `get_state_dict` /
`get_optimizer_state_dict` key it by parameter name ("layers.0.weight") and list the names there
instead. Both list the optimizer's parameters in the same order, so when a saved optimizer state
and its target are keyed the two different ways, and their groups list the same number of
parameters, position k of the flattened groups is the k-th name: the saved `state` keys map one to
one onto the target's. The target keeps its own `params` lists (its keying).

`optimizer_problems` is what an optimizer's own load_state_dict() would refuse only after the model
beside it was restored (other group sizes), or take without a word (another torch optimizer's state);
`partial_state` what it would fail on (a selection that restores part of a parameter's state into an
optimizer that holds none for it). An optimizer's `state` is replaced whole, as load_state_dict()
does: entries the step lacks are dropped, lists of another length (LBFGS's history) are taken.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch

from checkpointing.format.dtypes import dtype_from_name
from checkpointing.restore.saved_form import other_torch_class

# torch's optimizers whose per-parameter state tensors (all but a 0-d step) have their parameter's shape
_PARAM_SHAPED = {getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
                                                    "Adadelta", "Rprop", "ASGD", "SparseAdam") if hasattr(torch.optim, n)}
_TORCH_OPTIMIZERS = _PARAM_SHAPED | {getattr(torch.optim, n) for n in ("LBFGS", "Adafactor", "Muon") if hasattr(torch.optim, n)}


def key_map(target: Any, node: dict) -> dict[Any, Any] | None:
    """Saved state key -> target state key, when `target` (a dict) and the saved dict `node` are
    optimizer state dicts keyed the two different ways; None otherwise (the keys then meet as they are)."""
    if not isinstance(target, Mapping) or not isinstance(target.get("param_groups"), list):
        return None
    saved = dict(node.get("dict", ()))
    if "state" not in saved or "param_groups" not in saved:
        return None
    mine = _saved_params(saved["param_groups"])
    theirs = [g.get("params") if isinstance(g, Mapping) else None for g in target["param_groups"]]
    if mine is None or len(mine) != len(theirs) or any(not isinstance(t, list) or len(t) != len(m) for t, m in zip(theirs, mine)):
        return None
    flat_saved = [p for group in mine for p in group]
    flat_target = [p for group in theirs for p in group]  # type: ignore[union-attr]
    kinds = ({type(p) for p in flat_saved}, {type(p) for p in flat_target})
    if kinds not in (({int}, {str}), ({str}, {int})) or len(set(flat_saved)) != len(flat_saved) or len(set(flat_target)) != len(flat_target):
        return None
    return dict(zip(flat_saved, flat_target))


def optimizer_problems(target: Any, node: dict, key: str, tensors: Sequence[Any]) -> list[tuple[tuple, str]]:
    """(path below the optimizer, text) for each way the saved optimizer `node` does not fit the optimizer `target`."""
    if (text := other_torch_class(target, node, key)) is not None:
        return [((), text)]
    groups = dict(node["stateful"].get("dict", ())).get("param_groups")
    mine = _saved_params(groups) if isinstance(groups, dict) else None
    sizes, have = [len(g) for g in mine or ()], [len(g["params"]) for g in target.param_groups]
    if mine is None or sizes == have:
        return _shape_problems(target, node, tensors, key) if mine is not None else []
    return [(("param_groups",), f"saved with {len(sizes)} parameter group(s) of {sizes} parameters, the target optimizer has "
                                f"{len(have)} of {have}: build it over the same parameters in the same groups as when it was saved, "
                                f"or leave it out with exclude=[{key!r}] (state that must follow another layout, other pipeline "
                                "stages, is saved keyed by name: torch.distributed.checkpoint.state_dict.get_state_dict)")]


def load_problem(target: Any, sd: Mapping[str, Any], node: dict, key: str) -> str | None:
    """What `target.load_state_dict(sd)` raises, found on a copy of a torch optimizer (the target keeps its state): a state
    saved from an optimizer of the user's own (Lion) that a torch optimizer cannot take, named before the model is read."""
    hooked = getattr(target, "_optimizer_load_state_dict_pre_hooks", None) or getattr(target, "_optimizer_load_state_dict_post_hooks", None)
    if type(target) not in _TORCH_OPTIMIZERS or hooked:
        return None  # a subclass may load collectively; hooks (a migration) are not on a copy (Optimizer.__getstate__)
    try:
        copy.copy(target).load_state_dict(sd)
    except Exception as exc:  # noqa: BLE001 - torch's own load_state_dict on a copy: any failure is the one to report
        return (f"saved from a {node.get('class')}, which the target {type(target).__name__} cannot load (its load_state_dict() "
                f"raises {type(exc).__name__}: {str(exc)[:200]}): restore into the optimizer class it was saved from, or leave it "
                f"out with exclude=[{key!r}]")
    return None


def _shape_problems(target: torch.optim.Optimizer, node: dict, tensors: Sequence[Any], key: str) -> list[tuple[tuple, str]]:
    """Saved state of a parameter, in an optimizer whose state has its parameter's shape, that does not fit the
    parameter at its position now (the parameter changed shape, or the groups list the parameters in another order):
    load_state_dict() would take it, and the next step() fail in torch."""
    if type(target) not in _PARAM_SHAPED:
        return []
    params = [p for group in target.param_groups for p in group["params"]]
    out = []
    for pos, child in dict(node["stateful"].get("dict", ())).get("state", {}).get("dict", ()):
        if not isinstance(pos, int) or not 0 <= pos < len(params) or not isinstance(child, dict):
            continue
        for name, leaf in child.get("dict", ()):
            shape = tensors[leaf["tensor"]].shape if isinstance(leaf, dict) and "tensor" in leaf else ()
            if shape != () and not isinstance(params[pos], torch.nn.parameter.UninitializedParameter) and shape != tuple(params[pos].shape):
                out.append((("state", pos, name), f"saved {list(shape)}, the parameter at position {pos} of the optimizer's groups is "
                                                  f"{list(params[pos].shape)} now (it changed shape, or the groups list the parameters in "
                                                  f"another order): leave its state out with exclude=['{key}/state/{pos}'], or build the "
                                                  "optimizer over the parameters in the order it was saved with"))
    return out


def _saved_params(groups: dict) -> list[list[Any]] | None:
    """Each saved param group's `params` list of plain values, from the saved tree."""
    out = []
    for group in groups.get("list", ()):
        params = dict(group.get("dict", ())).get("params") if isinstance(group, dict) else None
        if not isinstance(params, dict) or "list" not in params or not all("value" in p for p in params["list"]):
            return None
        out.append([p["value"] for p in params["list"]])
    return out or None


def partial_state(state: Any, node: dict, renamed: Mapping[Any, Any]) -> list[tuple[tuple, str]]:
    """(path below the optimizer, text) for each parameter whose state a selection restores in part, the rest
    held neither by the target optimizer: `state` is what its load_state_dict() would get, `node` the saved optimizer."""
    saved = dict(node["stateful"].get("dict", ())).get("state")
    if not isinstance(state, Mapping) or not isinstance(saved, dict):
        return []
    out = []
    for key, child in saved.get("dict", ()):
        key = renamed.get(key, key)
        entry = state.get(key)
        want = {name for name, _ in child.get("dict", ())} if isinstance(child, dict) else set()
        if isinstance(entry, Mapping) and want - set(entry):
            out.append((("state", key), f"the selection restores {sorted(set(entry) & want)} of this parameter's state, not "
                                        f"{sorted(want - set(entry))}, and the target optimizer holds no state to complete it (it has "
                                        "not stepped): select its whole 'state/*' entries, or restore into an optimizer that has stepped"))
    return out


def fits_in_place(target: Any, node: dict, tensors: Sequence[Any]) -> bool:
    """`target` (a value in an optimizer's state) can take the saved `node` in place: a tensor of its shape and dtype
    (`tensors`: the manifest's table), a container for a container, a plain value for a plain value."""
    if "tensor" in node:
        entry = tensors[node["tensor"]]
        return isinstance(target, torch.Tensor) and tuple(target.shape) == entry.shape and target.dtype == dtype_from_name(entry.dtype)
    if "dict" in node or "list" in node or "tuple" in node:
        return isinstance(target, (Mapping, list, tuple))
    return "ndarray" not in node and not isinstance(target, (torch.Tensor, Mapping, list, tuple))
