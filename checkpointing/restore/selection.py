"""Which saved keys a restore or a load takes, and how saved names meet the target's (pure; layer: restore).

A selection is glob patterns over a value's key, the path joined with "/" as the manifest names
it (`model/layers.0.weight`, `optim/state/3/exp_avg`): `only` keeps what a pattern matches (a
match on a key takes everything under it: `model` keeps the whole model), `exclude` then drops
what its patterns match. Keys outside the selection are neither read nor checked, and the target
keeps its values there. `strict` still applies inside the selection: a selected key on one side
only is a problem, never skipped in silence.

Names: `torch.compile` (`_orig_mod.`), activation checkpointing (`_checkpoint_wrapped_module.`)
and FSDP1 insert a wrapper's name into every parameter name, DistributedDataParallel a leading
`module.` (taken as a wrapper where every key of one side has it and none of the other's does: a
submodule may be called `module`); a saved name and a target name that differ only by those
wrappers are the same parameter, as torch.distributed.checkpoint's get_model_state_dict treats
them. Patterns see both namings: `model/0.*` selects `model/_orig_mod.0.weight`, and
`model/module.0.*` a plain save's `model/0.weight` restored into a DDP module.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import Any, Iterable, MutableMapping

_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")
_DDP = "module."  # DistributedDataParallel's attribute: a leading segment only (a submodule may be called so)
_WILD = re.compile(r"[*?\[]")


def plain_name(key: object) -> object:
    """A parameter name without inserted wrapper segments (`_orig_mod.layer.weight` -> `layer.weight`)."""
    return _WRAPPERS.sub("", key) if isinstance(key, str) else key


def _ddp_stripped(keys: Iterable[object]) -> bool:
    """Every key of a module's state dict starts with DDP's `module.` (as DCP tells a DDP-wrapped module's;
    one submodule called `module` beside other entries is not a wrapper)."""
    names = [plain_name(k) for k in keys]
    return bool(names) and all(isinstance(k, str) and k.startswith(_DDP) for k in names)


def plain_key(key: str) -> str:
    """A "/"-joined key with every segment's wrappers removed (`model/_orig_mod.0.weight` -> `model/0.weight`)."""
    return "/".join(str(plain_name(part)) for part in key.split("/"))


def _forms(key: str, aliases: tuple[str, ...] = ()) -> list[str]:
    """`key`, its aliases and the keys above them, as named and without wrappers."""
    names = dict.fromkeys(name for k in (key, *aliases) for name in (k, plain_key(k)))
    return [above for name in names for above in _self_and_above(name)]


def _any_match(keys: list[str], patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(k, p) for k in keys for p in patterns)


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

    def wants(self, key: str, *aliases: str) -> bool:
        """The value at `key` is restored (it, or a key above it, is selected and not excluded); `aliases`:
        the same value's other names (its saved name where the target's differs by wrappers)."""
        keys = _forms(key, aliases)
        if self.exclude and _any_match(keys, _with_plain(self.exclude)):
            return False
        return not self.only or _any_match(keys, _with_plain(self.only))

    def reaches(self, key: str, *aliases: str) -> bool:
        """Something at or below `key` may be restored (so the walk goes on into it)."""
        if self.wants(key, *aliases):
            return True
        if self.exclude and _any_match(_forms(key, aliases), _with_plain(self.exclude)):
            return False
        return any(_could_be_below(k, p) for k in {key, *aliases, plain_key(key)} for p in _with_plain(self.only))


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


@functools.lru_cache(maxsize=256)
def _with_plain(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """The patterns, each followed by its form without inserted wrapper segments (`_orig_mod.`...) where that differs
    (not without a leading `module.`: in a pattern that may name a submodule, AveragedModel's among them)."""
    return tuple(dict.fromkeys(q for p in patterns for q in (p, "/".join(_WRAPPERS.sub("", part) for part in p.split("/")))))


def _self_and_above(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _could_be_below(key: str, pattern: str) -> bool:
    """A key below `key` could match `pattern`: its literal start agrees with `key/`."""
    wild = _WILD.search(pattern)
    literal = pattern[: wild.start()] if wild else pattern
    below = key + "/"
    return literal.startswith(below) or below.startswith(literal) if wild else literal.startswith(below)


def unmatched(select: Selection, keys: Iterable[str], target_keys: Iterable[str] = ()) -> list[str]:
    """The patterns of `select` that match none of `keys` (a typo would otherwise select nothing, silently);
    an exclude pattern may match `target_keys` instead (a key the target has and the step lacks, left out).
    A pattern counts as matched when it or its form without wrapper segments does."""
    saved = {form for key in keys for form in (key, plain_key(key))}
    either = saved | {form for key in target_keys for form in (key, plain_key(key))}
    return [p for patterns, names in ((select.only, saved), (select.exclude, either)) for p in patterns
            if not any(fnmatch.fnmatchcase(k, q) for k in names for q in _with_plain((p,)))]


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


class NameMatch:
    """Saved keys against a target dict's (the planner's): equal, or equal once wrapper segments are gone
    (`_orig_mod.` anywhere; DDP's `module.` where every key of that side starts with it)."""

    def __init__(self, target: MutableMapping, saved: list) -> None:
        self._target = target
        self._saved = set(saved)
        self._ddp = (_ddp_stripped(saved), _ddp_stripped(target))  # (saved side, target side)
        self._saved_plain = {self._plain(k, 0) for k in saved}
        self._target_plain: dict = {}
        for k in target:
            self._target_plain.setdefault(self._plain(k, 1), k)

    def _plain(self, key: Any, side: int) -> Any:
        plain = plain_name(key)
        return plain[len(_DDP):] if self._ddp[side] and self._ddp[0] != self._ddp[1] else plain

    def target_key(self, saved_key: Any) -> Any:
        if saved_key in self._target:
            return saved_key
        return self._target_plain.get(self._plain(saved_key, 0), saved_key)

    def saved(self, target_key: Any) -> bool:
        return target_key in self._saved or self._plain(target_key, 1) in self._saved_plain


def key_types(key: Any, saved: list) -> str:
    """A note when the step holds `key` under a key of another type (1 against "1": dict keys keep their types)."""
    other = next((k for k in saved if str(k) == str(key) and type(k) is not type(key)), None)
    return "" if other is None else (f" (the step has the {type(other).__name__} key {other!r}, the target the "
                                     f"{type(key).__name__} key {key!r}: dict keys keep their types)")
