"""Which saved tree a rank restores from: its own, or the saving ranks' trees merged (pure; layer: restore).

A rank restores from the tree it saved when the world size and its keys are unchanged. Otherwise
(another world size, or pipeline stages laid out anew so a rank now holds keys another rank saved)
it restores from the union of every saving rank's tree:

- a subtree every rank saved alike is kept; one that differs between ranks becomes PER_RANK (its
  value cannot be matched to a rank of another layout, and a restore that needs it says so);
- a dict key that only some ranks saved (a pipeline stage's modules, a rank's own experts) is kept
  and marked OPTIONAL: a target without it is not short of anything, another rank loads it.

These markers live in memory only; they never reach a manifest.
"""

from __future__ import annotations

from typing import Any

PER_RANK = "per_rank"  # a node whose value differs between the saving ranks
OPTIONAL = "optional"  # {"optional": node}: saved by some ranks only
BORROWED = "borrowed"  # set beside OPTIONAL on a key this rank did not save itself (another rank did)


def merge_trees(trees: list[Any]) -> Any:
    """One tree for every rank: equal subtrees kept, differing ones PER_RANK, partial keys OPTIONAL."""
    first = trees[0]
    if all(t == first for t in trees[1:]):
        return first
    if all(isinstance(t, dict) and "dict" in t for t in trees):
        return {"dict": _merge_dicts([dict(t["dict"]) for t in trees], [k for t in trees for k, _ in t["dict"]])}
    for kind in ("list", "tuple"):
        if isinstance(first, dict) and kind in first and all(isinstance(t, dict) and kind in t and len(t[kind]) == len(first[kind]) for t in trees):
            return {kind: [merge_trees([t[kind][i] for t in trees]) for i in range(len(first[kind]))]}
    if isinstance(first, dict) and "stateful" in first and all(isinstance(t, dict) and "stateful" in t and t["class"] == first["class"] for t in trees):
        return {"stateful": merge_trees([t["stateful"] for t in trees]), "class": first["class"]}
    return {PER_RANK: True}


def _merge_dicts(items: list[dict], keys_in_order: list) -> list:
    out, seen = [], set()
    for k in keys_in_order:
        if k in seen:
            continue
        seen.add(k)
        holders = [d[k] for d in items if k in d]
        merged = merge_trees(holders)
        out.append([k, merged if len(holders) == len(items) else {OPTIONAL: merged}])
    return out


def overlay(own: Any, union: Any) -> Any:
    """This rank's own tree, with the keys only other ranks saved added from `union` (marked BORROWED).

    Own values win (they are this rank's, per-rank ones included); own keys that not every rank saved
    keep their OPTIONAL mark, so a target that now lacks them is seen as laid out anew.
    """
    if isinstance(union, dict) and OPTIONAL in union:
        return {OPTIONAL: overlay(own, union[OPTIONAL])}
    if not (isinstance(own, dict) and isinstance(union, dict)):
        return own
    if "dict" in own and "dict" in union:
        mine = dict(own["dict"])
        theirs = dict(union["dict"])
        items = [[k, overlay(v, theirs[k]) if k in theirs else v] for k, v in own["dict"]]
        items += [[k, {**v, BORROWED: True}] for k, v in union["dict"] if k not in mine]
        return {"dict": items}
    if "stateful" in own and "stateful" in union and own["class"] == union["class"]:
        return {"stateful": overlay(own["stateful"], union["stateful"]), "class": own["class"]}
    for kind in ("list", "tuple"):
        if kind in own and kind in union and len(own[kind]) == len(union[kind]):
            return {kind: [overlay(a, b) for a, b in zip(own[kind], union[kind])]}
    return own


def has_tensors(node: Any) -> bool:
    """A saved tree node holds a tensor or an array somewhere."""
    if not isinstance(node, dict):
        return False
    if "tensor" in node or "ndarray" in node:
        return True
    return any(has_tensors(v) for v in children(node))


def children(node: dict) -> list:
    """A saved tree node's child nodes."""
    if "dict" in node:
        return [v for _, v in node["dict"]]
    if "list" in node or "tuple" in node:
        return node.get("list", node.get("tuple"))
    if "stateful" in node:
        return [node["stateful"]]
    if OPTIONAL in node:
        return [node[OPTIONAL]]
    return []
