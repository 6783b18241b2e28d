"""Which saved keys a restore or a load takes, and how saved names meet the target's (pure; layer: restore).

A selection is glob patterns over a value's key, the path joined with "/" as the manifest names
it (`model/layers.0.weight`, `optim/state/3/exp_avg`): `only` keeps what a pattern matches (a
match on a key takes everything under it: `model` keeps the whole model), `exclude` then drops
what its patterns match. Keys outside the selection are neither read nor checked, and the target
keeps its values there. `strict` still applies inside the selection: a selected key on one side
only is a problem, never skipped in silence.

Names: `torch.compile` (`_orig_mod.`) and activation checkpointing (`_checkpoint_wrapped_module.`)
insert a wrapper's name into every parameter name; a saved name and a target name that differ
only by those wrappers are the same parameter, as torch.distributed.checkpoint's
get_model_state_dict treats them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Iterable

_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
_WILD = re.compile(r"[*?\[]")


def plain_name(key: object) -> object:
    """A parameter name without wrapper segments (`_orig_mod.layer.weight` -> `layer.weight`)."""
    return _WRAPPERS.sub("", key) if isinstance(key, str) else key


@dataclasses.dataclass(frozen=True)
class Selection:
    strict: bool = True
    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    take_all: bool = False  # load(): the target is empty and takes every (selected) saved key

    @classmethod
    def of(cls, strict: bool = True, only: str | Iterable[str] | None = None, exclude: str | Iterable[str] | None = None,
           take_all: bool = False) -> "Selection":
        return cls(bool(strict), _patterns(only, "only"), _patterns(exclude, "exclude"), take_all)

    def wants(self, key: str) -> bool:
        """The value at `key` is restored (it, or a key above it, is selected and not excluded)."""
        keys = _self_and_above(key)
        if self.exclude and any(fnmatch.fnmatchcase(k, p) for k in keys for p in self.exclude):
            return False
        return not self.only or any(fnmatch.fnmatchcase(k, p) for k in keys for p in self.only)

    def reaches(self, key: str) -> bool:
        """Something at or below `key` may be restored (so the walk goes on into it)."""
        if self.wants(key):
            return True
        keys = _self_and_above(key)
        if self.exclude and any(fnmatch.fnmatchcase(k, p) for k in keys for p in self.exclude):
            return False
        return any(_could_be_below(key, p) for p in self.only)


def _patterns(value: str | Iterable[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    try:
        patterns = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        patterns = (value,)  # not iterable: refused below
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise TypeError(f"{name}= takes glob patterns over keys such as 'model/*' or 'optim' (a str or a list of them), got {p!r}")
    return patterns


def _self_and_above(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _could_be_below(key: str, pattern: str) -> bool:
    """A key below `key` could match `pattern`: its literal start agrees with `key/`."""
    wild = _WILD.search(pattern)
    literal = pattern[: wild.start()] if wild else pattern
    below = key + "/"
    return literal.startswith(below) or below.startswith(literal) if wild else literal.startswith(below)


def unmatched(select: Selection, keys: Iterable[str]) -> list[str]:
    """The patterns of `select` that match none of `keys` (a typo would otherwise select nothing, silently)."""
    names = set()
    for key in keys:
        names.add(key)
        names.add("/".join(str(plain_name(part)) for part in key.split("/")))
    return [p for p in select.only + select.exclude if not any(fnmatch.fnmatchcase(k, p) for k in names)]


def tree_keys(node: object, prefix: str = "") -> Iterable[str]:
    """Every key of a manifest tree (dicts' keys and list positions, joined with "/" as join_key does)."""
    if not isinstance(node, dict):
        return
    for kind in ("stateful", "optional"):
        if kind in node:
            yield from tree_keys(node[kind], prefix)
            return
    if "dict" in node:
        children = [(str(k).replace("%", "%25").replace("/", "%2F"), v) for k, v in node["dict"]]
    elif "list" in node or "tuple" in node:
        children = [(str(i), v) for i, v in enumerate(node.get("list", node.get("tuple")))]
    else:
        return
    for name, child in children:
        key = f"{prefix}/{name}" if prefix else name
        yield key
        yield from tree_keys(child, key)
