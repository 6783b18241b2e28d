"""Which of a step's tensors an export writes, and under which names (pure; layer: interop).

Selection: `only` / `exclude` are glob patterns over keys as the manifest names them ("/"-joined
paths: "model", "model/*", "optim/state/*/exp_avg"), with checkpointing.load(keys=...)'s meaning:
a match on a key takes everything under it. A pattern that matches no key is refused (a typo would
otherwise export nothing, silently). Only tensors are written; plain values are left out.

Names: a tensor is named by its path below the *root*, the leading segments that every `only`
pattern spells out literally ("model" for `--only model` or `--only 'model/*'`; nothing without
`only`), and never shorter than its last segment. Wrapper segments (`_orig_mod.` of torch.compile,
activation checkpointing's, FSDP1's) are removed. The segments are joined
- "dotted" (safetensors): with ".", as nn.Module.state_dict() names nested modules, so `{"model":
  hf_model}` exported with only="model" gives the names `from_pretrained` loads
  ("transformer.h.0.attn.c_attn.weight"), and without it "model.transformer.h.0...";
- "keys" (the torch.save file): as the manifest joins keys ("/", a "/" or "%" inside a segment
  escaped as "%2F" / "%25"), so an export without options keeps the manifest's keys.
Then `strip_prefix` is removed from every name that starts with it (one that no name starts with
is refused).

One tensor at several selected paths (tied weights) is written once, under its first path in the
saved order: a state_dict() lists the embedding before the head that shares it, so, as with
save_pretrained, "transformer.wte.weight" is written and "lm_head.weight" is an alias, not written.
A key the saving ranks held different tensors under (per-rank state) is written once per distinct
tensor: name, name#2, name#3, ... in manifest order. Two different keys that come out as one name
are refused, naming both.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from checkpointing.errors import CheckpointConfigError
from checkpointing.format.manifest import Manifest, TensorEntry
from checkpointing.interop.types import Conversion
from checkpointing.restore.selection import Selection, plain_name, tree_keys, unmatched
from checkpointing.state.tree import join_key

Style = Literal["dotted", "keys"]
KeyPath = tuple[Any, ...]
_WILD = re.compile(r"[*?\[]")


@dataclasses.dataclass(frozen=True)
class Named:
    """One tensor to write: its name, its manifest entry, and the names that share it (not written)."""

    name: str
    entry: TensorEntry
    aliases: tuple[str, ...] = ()
    path: KeyPath = ()  # the manifest path it is written for
    dropped: int = 0  # of which the leading segments the name leaves out (the root every `only` pattern spells out)


def name_tensors(manifest: Manifest, conv: Conversion, style: Style) -> list[Named]:
    """The tensors of `manifest` that `conv` selects, named in `style`, in manifest order."""
    select = Selection.of(True, conv.only or None, conv.exclude or None, take_all=True)
    keys: set[str] = set()
    for tree in manifest.trees:
        keys.update(tree_keys(tree))
    bad = unmatched(select, keys)
    if bad:
        tops = sorted({k.split("/")[0] for k in keys})[:12]
        raise CheckpointConfigError(f"{bad[0]!r} (in only=/exclude=) matches no key of step {manifest.step}; its top-level keys are "
                                    f"{', '.join(map(repr, tops))}")
    paths = tensor_paths(manifest)
    chosen = [(entry, sel) for i, entry in enumerate(manifest.tensors)
              if (sel := [p for p in paths.get(i, ()) if select.wants(join_key(p))])]
    if not chosen:
        raise CheckpointConfigError(f"step {manifest.step}: the selection holds no tensor (only={list(conv.only)}, "
                                    f"exclude={list(conv.exclude)}); `checkpointing inspect` lists the keys")
    drop = _root_depth(conv.only, [p for _, sel in chosen for p in sel])
    strip = _Strip(conv.strip_prefix)
    out: list[Named] = []
    owner: dict[str, KeyPath] = {}  # a written name -> the path it was written for
    for entry, sel in chosen:
        names = [strip(_join(p[drop:], style)) for p in sel]
        name, n = names[0], 2
        while name in owner:
            if owner[name] != sel[0]:
                raise CheckpointConfigError(
                    f"{join_key(owner[name])!r} and {join_key(sel[0])!r} would both be written as {name!r}: "
                    "export them separately (only=/exclude=), or choose another strip_prefix"
                )
            name, n = f"{names[0]}#{n}", n + 1  # the ranks held different tensors under this key
        owner[name] = sel[0]
        out.append(Named(name, entry, tuple(a for a in dict.fromkeys(names[1:]) if a != names[0]), sel[0], drop))
    strip.check()
    return out


def tensor_paths(manifest: Manifest) -> dict[int, list[KeyPath]]:
    """Tensor-table index -> every path that refers to it, over every saved tree, in tree order."""
    found: list[tuple[KeyPath, int]] = []
    for tree in manifest.trees:
        _walk(tree, (), found)
    out: dict[int, list[KeyPath]] = {}
    for path, index in found:
        seen = out.setdefault(index, [])
        if path not in seen:
            seen.append(path)
    return out


def container_kinds(manifest: Manifest) -> dict[KeyPath, str]:
    """Path -> the kind of container saved there, where it is not a dict with str keys: "list", "tuple", or "int-keys"
    (a dict whose keys are ints, as an optimizer's "state"). Names joined with "/" lose these; an export keeps them."""
    out: dict[KeyPath, str] = {}

    def walk(node: Any, path: KeyPath) -> None:
        if not isinstance(node, dict):
            return
        if "stateful" in node:
            walk(node["stateful"], path)
        elif "dict" in node:
            if node["dict"] and all(isinstance(k, int) for k, _ in node["dict"]):
                out[path] = "int-keys"
            for key, child in node["dict"]:
                walk(child, path + (key,))
        elif "list" in node or "tuple" in node:
            out[path] = "list" if "list" in node else "tuple"
            for i, child in enumerate(node.get("list", node.get("tuple"))):
                walk(child, path + (i,))

    for tree in manifest.trees:
        walk(tree, ())
    return out


def _walk(node: Any, path: KeyPath, out: list[tuple[KeyPath, int]]) -> None:
    if not isinstance(node, dict):
        return
    for kind in ("tensor", "ndarray"):
        if kind in node:
            out.append((path, node[kind]))
            return
    if "stateful" in node:
        _walk(node["stateful"], path, out)
    elif "dict" in node:
        for key, child in node["dict"]:
            _walk(child, path + (key,), out)
    elif "list" in node or "tuple" in node:
        for i, child in enumerate(node.get("list", node.get("tuple"))):
            _walk(child, path + (i,), out)


def _root_depth(only: tuple[str, ...], paths: list[KeyPath]) -> int:
    """How many leading segments every name drops: those every `only` pattern spells out, above every tensor."""
    if not only:
        return 0
    spelled = [_literal_segments(p) for p in only]
    depth = 0
    while all(len(s) > depth and s[depth] == spelled[0][depth] for s in spelled):
        depth += 1
    return min([depth] + [len(p) - 1 for p in paths])


def _literal_segments(pattern: str) -> list[str]:
    out = []
    for segment in pattern.split("/"):
        if _WILD.search(segment):
            break
        out.append(segment)
    return out


def _join(rest: KeyPath, style: Style) -> str:
    plain = tuple(plain_name(s) for s in rest)
    return ".".join(map(str, plain)) if style == "dotted" else join_key(plain)


class _Strip:
    """Removes the prefix from names that start with it; check() refuses a prefix that no name started with."""

    def __init__(self, prefix: str | None) -> None:
        self.prefix = prefix
        self.used = False
        self.example = ""

    def __call__(self, name: str) -> str:
        self.example = self.example or name
        if not self.prefix or not name.startswith(self.prefix):
            return name
        if name == self.prefix:
            raise CheckpointConfigError(f"strip_prefix={self.prefix!r} is the whole name of a tensor: strip less of it")
        self.used = True
        return name[len(self.prefix):]

    def check(self) -> None:
        if self.prefix and not self.used:
            raise CheckpointConfigError(f"strip_prefix={self.prefix!r} starts no exported name (they look like {self.example!r})")
