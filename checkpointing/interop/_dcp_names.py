"""A manifest's values under the names torch.distributed.checkpoint (DCP) gives them (pure; layer: interop).

DCP's default planner flattens the user's nested state dict into "."-joined paths
(torch/distributed/checkpoint/_traverse.py, `traverse_state_dict`): a mapping is always entered
(its keys as `str`); a list is entered, by index, only when it holds a tensor, a mapping or a list
that is entered; anything else (a tuple, a list of plain values, a number, a string, a numpy
array) is one value. Our tree keeps the nesting the user saved, and an object saved through
`state_dict()` is its state dict nested under its key, so the same walk over the tree yields the
names DCP gives the same state: `{"model": model}` saved here is `{"model": model.state_dict()}`
to DCP, `model/0.weight` is `model.0.weight`, `optim/state/0/exp_avg` is `optim.state.0.exp_avg`.

An optimizer saved through `optimizer.state_dict()` keys its state by parameter id (0, 1, ...);
DCP's `get_state_dict` keys it by parameter name. `rename_optimizer` rewrites the ids of one saved
optimizer to names given by the caller, so such a checkpoint loads into either form.

Several ranks may have saved different trees (per-rank values). Each name records the node every
distinct tree gives it; the reader serves the shared one, or the reading rank's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.format.manifest import Manifest
from checkpointing.state.tree import join_key

DcpPath = tuple[Any, ...]  # DCP's OBJ_PATH: str for a mapping key, int for a list index


@dataclasses.dataclass(frozen=True)
class DcpName:
    """One value DCP can ask for: its path, our key (for messages) and each tree's node for it."""

    path: DcpPath
    key: str  # our key, segments joined by "/" as the manifest names it
    nodes: dict[int, dict[str, Any]]  # index into manifest.trees -> the node that tree holds here

    @property
    def shared(self) -> dict[str, Any] | None:
        """The node, when every tree that holds the name holds the same one; None when it is per rank."""
        first = next(iter(self.nodes.values()))
        return first if all(n == first for n in self.nodes.values()) else None

    def node_for(self, tree: int | None) -> dict[str, Any] | None:
        """The node a rank reading tree `tree` (None: no tree of its own) gets; None: per rank, not its own."""
        shared = self.shared
        if shared is not None:
            return shared
        return self.nodes.get(tree) if tree is not None else None

    @property
    def is_tensor(self) -> bool:
        return "tensor" in next(iter(self.nodes.values()))


def dcp_names(manifest: Manifest, param_names: Mapping[str, Sequence[str]] | None = None) -> dict[str, DcpName]:
    """Every value of the step under its DCP name ("."-joined path), in the order the trees hold them."""
    out: dict[str, DcpName] = {}
    indices = sorted(set(manifest.rank_trees), key=manifest.rank_trees.index)
    trees = {i: manifest.trees[i] for i in indices}
    for key, names in (param_names or {}).items():
        renamed = {i: rename_optimizer(t, key, names, manifest.step) for i, t in trees.items()}
        if all(t is None for t in renamed.values()):
            raise CheckpointConfigError(
                f"param_names names {key!r}, which step {manifest.step} does not hold: name the key the optimizer "
                "was saved under (segments joined by '/')"
            )
        trees = {i: t if renamed[i] is None else renamed[i] for i, t in trees.items()}
    for index, tree in trees.items():
        for path, key, node in _leaves(tree):
            fqn = ".".join(map(str, path))
            known = out.get(fqn)
            if known is None:
                out[fqn] = DcpName(path, key, {index: node})
            elif known.key != key:
                raise CheckpointError(
                    f"step {manifest.step}: the keys {known.key!r} and {key!r} both become {fqn!r} under DCP's "
                    "'.'-joined names, so DCP cannot tell them apart; load this step with checkpointing.load() instead"
                )
            else:
                known.nodes[index] = node
    return out


def _leaves(tree: dict[str, Any]) -> list[tuple[DcpPath, str, dict[str, Any]]]:
    out: list[tuple[DcpPath, str, dict[str, Any]]] = []

    def walk(node: dict[str, Any], path: DcpPath, ours: tuple) -> None:
        if "stateful" in node:
            walk(node["stateful"], path, ours)
        elif "dict" in node:
            for k, child in node["dict"]:
                walk(child, path + (str(k),), ours + (k,))
        elif "list" in node and not _is_terminal(node):
            for i, child in enumerate(node["list"]):
                walk(child, path + (i,), ours + (i,))
        else:
            out.append((path, join_key(ours), node))

    walk(tree, (), ())
    return out


def _is_terminal(node: dict[str, Any]) -> bool:
    """A list DCP keeps as one value: it holds no tensor, no mapping, and no list DCP would enter."""
    for child in node["list"]:
        if "tensor" in child or "dict" in child or "stateful" in child:
            return False
        if "list" in child and not _is_terminal(child):
            return False
    return True


def rename_optimizer(tree: dict[str, Any], key: str, names: Sequence[str], step: int) -> dict[str, Any] | None:
    """`tree` with the optimizer state dict at `key` keyed by parameter name instead of id (pure);
    None when the tree holds nothing at `key` (another rank's tree may).

    `names[i]` is the name of parameter id `i`: for an optimizer built from `model.parameters()`,
    `[n for n, _ in model.named_parameters()]`, the names `get_state_dict(model, optim)` uses.
    """
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise CheckpointConfigError(f"param_names[{key!r}] must be a list of parameter names (str), in the optimizer's parameter order")
    segments = _split_key(key)

    def rename(node: dict[str, Any]) -> dict[str, Any]:
        if "stateful" in node:
            return {**node, "stateful": rename(node["stateful"])}
        items = dict(node.get("dict", ()))
        if "state" not in items or "param_groups" not in items:
            raise CheckpointConfigError(
                f"param_names[{key!r}]: step {step} holds no optimizer state dict there (a dict with 'state' and "
                "'param_groups'); name the key the optimizer was saved under"
            )
        return {"dict": [[k, _rename_state(v) if k == "state" else _rename_groups(v) if k == "param_groups" else v]
                         for k, v in node["dict"]]}

    def name_of(pid: Any) -> str:
        if isinstance(pid, str):
            raise CheckpointConfigError(
                f"param_names[{key!r}]: the optimizer saved in step {step} is keyed by parameter name already "
                f"({pid!r}): leave param_names out"
            )
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < len(names):
            raise CheckpointConfigError(
                f"param_names[{key!r}] gives {len(names)} names, but the optimizer saved in step {step} refers to "
                f"parameter {pid!r}: pass one name per parameter, in the optimizer's order"
            )
        return names[pid]

    def _rename_state(node: dict[str, Any]) -> dict[str, Any]:
        if "dict" not in node:
            return node
        return {"dict": [[name_of(k), v] for k, v in node["dict"]]}

    def _rename_groups(node: dict[str, Any]) -> dict[str, Any]:
        if "list" not in node:
            return node
        groups = []
        for group in node["list"]:
            items = group.get("dict")
            if items is None:
                groups.append(group)
                continue
            groups.append({"dict": [[k, _rename_ids(v) if k == "params" else v] for k, v in items]})
        return {"list": groups}

    def _rename_ids(node: dict[str, Any]) -> dict[str, Any]:
        if "list" not in node:
            return node
        return {"list": [{"value": name_of(n.get("value"))} for n in node["list"]]}

    return _replace_at(tree, segments, rename)


def _split_key(key: str) -> list[str]:
    return [s.replace("%2F", "/").replace("%25", "%") for s in key.split("/")] if key else []


def _replace_at(node: dict[str, Any], segments: list[str], fn: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any] | None:
    """`node` with fn applied to the node at `segments` below it; None when there is none."""
    if not segments:
        return fn(node)
    if "stateful" in node:
        inner = _replace_at(node["stateful"], segments, fn)
        return None if inner is None else {**node, "stateful": inner}
    head, rest = segments[0], segments[1:]
    if "dict" in node:
        for i, (k, child) in enumerate(node["dict"]):
            if str(k) == head:
                found = _replace_at(child, rest, fn)
                if found is None:
                    return None
                items = list(node["dict"])
                items[i] = [k, found]
                return {"dict": items}
    if "list" in node and head.isdigit() and int(head) < len(node["list"]):
        found = _replace_at(node["list"][int(head)], rest, fn)
        if found is None:
            return None
        items = list(node["list"])
        items[int(head)] = found
        return {"list": items}
    return None
