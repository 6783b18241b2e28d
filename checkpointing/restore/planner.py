"""Restore a committed manifest into the user's objects, in place: plan, then read, then apply (layer: restore).

1. Plan: walk the target state beside the manifest's tree (this rank's tree at the same world
   size; at another world size the ranks' trees merged, per-rank values refused by name). Collect
   every problem (missing or unexpected keys, shape/dtype/type mismatches); raise them together
   before touching anything.
2. Read (reading.py): each target covers a box of its global tensor (a DTensor its local shard, a
   plain tensor all of it), filled from every saved shard overlapping it, verified.
3. Apply: load_state_dict() on stateful objects, assign primitives into the user's containers.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, MutableMapping

import numpy as np
import torch

from checkpointing.state.codecs import Codec
from checkpointing.format.dtypes import dtype_from_name
from checkpointing.errors import CheckpointMismatchError, StateError
from checkpointing.format.manifest import Manifest, TensorEntry
from checkpointing.restore.applying import assign, load_into
from checkpointing.restore.hooked_names import has_pre_hooks, hooked_names
from checkpointing.restore.optim_keys import fits_in_place, key_map, load_problem, optimizer_problems, partial_state
from checkpointing.restore.saved_form import in_extra_state, is_scheduler, numpy_target, other_torch_class, shared_elements, takes_saved_form
from checkpointing.restore.reading import READ_THREADS, ReadBox, Sources, overlapping, read_box
from checkpointing.restore.selection import NameMatch, Selection, key_types, tree_keys, unmatched
from checkpointing.restore.trees import BORROWED, OPTIONAL, PER_RANK, children, has_tensors, merge_trees, overlay
from checkpointing.state.sharding import dtensor_layout, is_dtensor
from checkpointing.state.tree import is_stateful, join_key

_MISSING = object()


def _lists_group_params(path: tuple) -> bool:
    """`path` is an optimizer param group's parameter list (ids, or names in DCP's keyed-by-name form)."""
    return len(path) >= 3 and path[-1] == "params" and path[-3] == "param_groups" and isinstance(path[-2], int)


def _under(path: tuple, prefixes: set[tuple]) -> bool:
    return any(path[:len(p)] == p for p in prefixes)


def _target_has_tensors(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(obj, dict):
        return any(_target_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_target_has_tensors(v) for v in obj)
    return is_stateful(obj)


class _Planner:
    def __init__(self, manifest: Manifest, codecs: tuple[Codec, ...], select: Selection, world_size: int, relaid: bool = False) -> None:
        self.manifest = manifest
        self.relaid = relaid  # planning from the ranks' merged trees because this rank's keys changed
        self.new_layout = False  # found: the target takes keys another rank saved, or drops ones only some ranks saved
        self.codecs = {c.name: c for c in codecs}
        self.select = select
        self.strict = select.strict
        self.world_size = world_size
        self.problems: list[str] = []
        self.reads: list[ReadBox] = []
        self.loads: list[Callable[[], None]] = []
        self.param_hints: dict[tuple, torch.Tensor] = {}  # optimizer state path -> its parameter
        self.rekeyed: dict[tuple, dict] = {}  # optimizer state dict path -> saved state key -> target's (optim_keys.py)
        self.target_keys: set[str] = set()  # the target's keys the walk met (exclude= may name one the step lacks)
        self.renamed_keys: set[str] = set()  # the target's names of saved keys it names otherwise (wrappers)
        self.replaced: set[tuple] = set()  # optimizers' state paths: replaced whole, as their load_state_dict() does
        self.taken: set[tuple] = set()  # paths of objects other than modules: their load_state_dict() takes saved values as they are

    def problem(self, path: tuple, text: str) -> None:
        self.problems.append(f"{join_key(path) or '<root>'}: {text}")

    def value(self, target: Any, node: dict, path: tuple) -> Any:
        """The restored value at `path`; tensors matching the target are read into it."""
        if OPTIONAL in node:
            self.new_layout |= bool(node.get(BORROWED))
            return self.value(target, node[OPTIONAL], path)
        if target is not _MISSING and self._in_replaced(path) and not fits_in_place(target, node, self.manifest.tensors):
            target = _MISSING  # an optimizer's state is replaced whole: a value of another kind or size is not read in place
        if target is not _MISSING and self._taken(path) and takes_saved_form(target, node, self.manifest.tensors):
            target = _MISSING  # a template its object's load_state_dict() replaces (saved_form.py)
        if (self.relaid or path[:-3] in self.rekeyed) and _lists_group_params(path) and isinstance(target, list):
            return target  # which parameters a group holds is the new layout's (its own), not saved state
        if PER_RANK in node:
            self.problem(path, self.per_rank_text())
            return target
        if "tensor" in node or "ndarray" in node:
            return self.tensor(target, node, path)
        if "stateful" in node:
            return self.stateful(target, node, path)
        if "dict" in node:
            return self.mapping(target, node, path)
        if "list" in node or "tuple" in node:
            return self.sequence(target, node, path)
        if _target_has_tensors(target) and target is not _MISSING:
            self.problem(path, f"saved as a plain value, the target holds a {type(target).__name__}")
            return target
        return self.leaf(node, path)

    def per_rank_text(self) -> str:
        saved = self.manifest.world_size
        if self.select.take_all:
            return (
                f"saved per rank (the {saved} saving ranks hold different values): load(..., rank=r) reads the value "
                "rank r saved, or leave it out with exclude="
            )
        if self.relaid and self.world_size != saved:
            return (
                f"saved per rank (the {saved} saving ranks hold different values), and {self.world_size} rank(s) restore "
                f"now, so no saved value is known to be this rank's; restore with {saved} ranks, read one rank's with "
                "checkpointing.load(..., rank=r), or leave it out of the state passed to restore"
            )
        if self.relaid:
            return (
                f"saved per rank (the {saved} saving ranks hold different values) and this rank's keys differ from the "
                "ones it saved (pipeline stages laid out anew?), so no saved value is known to be its own; key such "
                "state by name (optimizer state: torch.distributed.checkpoint.state_dict.get_state_dict), restore "
                "with the saved layout, or leave it out of the state passed to restore"
            )
        return (
            f"saved per rank (the {saved} saving ranks hold different values), so it cannot be mapped to "
            f"{self.world_size} ranks; restore with {saved} ranks, or leave it out of the state passed to restore"
        )

    def leaf(self, node: dict, path: tuple) -> Any:
        if "value" in node:
            return node["value"]
        if "float" in node:
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[node["float"]]
        if "bytes" in node:
            return base64.b64decode(node["bytes"])
        codec = self.codecs.get(node["codec"])
        if codec is None:
            self.problem(path, f"saved with codec {node['codec']!r}: pass that codec: CheckpointManager(codecs=[...]), or load(..., codecs=[...])")
            return None
        try:
            return codec.decode(node["data"])
        except Exception as exc:  # noqa: BLE001 - the user's codec: a problem like any other, on every rank
            self.problem(path, f"codec {node['codec']!r} could not decode the saved value ({type(exc).__name__}: {exc}): pass the codec "
                               "the step was saved with, or leave the key out with exclude=")
            return None

    def tensor(self, target: Any, node: dict, path: tuple) -> Any:
        entry = self.manifest.tensors[node.get("tensor", node.get("ndarray"))]
        dtype = dtype_from_name(entry.dtype)
        as_numpy = "ndarray" in node
        full = ((0,) * len(entry.shape), entry.shape)
        if isinstance(target, np.ndarray):
            dest, why = numpy_target(target)
            if dest is None or tuple(target.shape) != entry.shape or dest.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is numpy {target.dtype}{list(target.shape)}{why}")
                return target
            self.reads.append(ReadBox(entry, dest, *full))
            return target
        if isinstance(target, torch.Tensor):
            if isinstance(target, torch.nn.parameter.UninitializedTensorMixin) or target.device.type == "meta":
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, the target holds no memory ("
                             + ("an uninitialized lazy parameter: run one forward pass first" if not target.device.type == "meta" else
                                "on the meta device: materialize it first, e.g. model.to_empty(device='cpu')") + ")")
                return target
            if tuple(target.shape) != entry.shape or target.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is {str(target.dtype)[6:]}{list(target.shape)}")
                return target
            if (why := shared_elements(target)) is not None:
                self.problem(path, why)
                return target
            self.read_into(entry, target, path)
            return target
        if target is not _MISSING and target is not None:
            self.problem(path, f"saved as a tensor, the target holds a {type(target).__name__}")
            return target
        hint = self.param_hints.get(path[:-1])
        if hint is not None and is_dtensor(hint) and tuple(hint.shape) == entry.shape:
            fresh = torch.empty_like(hint, dtype=dtype)  # optimizer state sharded like its parameter
            self.read_into(entry, fresh, path)
            return fresh
        if self.world_size > 1 and len(entry.shards) > 1 and not self.select.take_all:  # load() reads it whole
            self.problem(
                path,
                "saved as a sharded DTensor and missing from the target: create it first (for optimizer state, "
                "torch.distributed.checkpoint.state_dict.get_state_dict does) so it can be read in its sharding",
            )
            return None
        try:
            fresh = torch.empty(entry.shape, dtype=dtype)
        except RuntimeError as exc:  # a manifest declaring more than this machine holds (damaged, or hostile)
            self.problem(path, f"saved as {entry.dtype}{list(entry.shape)}: {entry.nbytes} bytes cannot be allocated "
                               f"here ({str(exc).splitlines()[0][:120]}): leave it out (exclude=), or read it on a larger machine")
            return None
        self.reads.append(ReadBox(entry, fresh, *full))
        return fresh.numpy() if as_numpy else fresh

    def read_into(self, entry: TensorEntry, target: torch.Tensor, path: tuple) -> None:
        if is_dtensor(target):
            try:
                local, layout = dtensor_layout(target.detach(), join_key(path))
            except StateError as exc:
                self.problem(path, str(exc))
                return
            if layout.replicas:  # ranks outside the DTensor's mesh hold nothing of it
                self.reads.append(ReadBox(entry, local, layout.offsets, tuple(local.shape)))
            return
        if type(target) is not torch.Tensor and type(target.data) is not torch.Tensor:  # nn.Parameter(a subclass): no memory of its own to read into
            self.problem(path, f"the target is a {type(target).__module__}.{type(target).__qualname__}: a tensor subclass, "
                               "which restore() cannot read into; pass a plain tensor (or a DTensor) there")
            return
        self.reads.append(ReadBox(entry, target.detach(), (0,) * len(entry.shape), entry.shape))

    def stateful(self, target: Any, node: dict, path: tuple) -> Any:
        if target is _MISSING or (isinstance(target, MutableMapping) and not is_stateful(target)):  # state_dict() into a dict
            return self.mapping(target, node["stateful"], path)
        if not is_stateful(target):
            self.problem(path, f"saved from a {node['class']} (state_dict), the target is a {type(target).__name__}")
            return target
        if isinstance(target, torch.optim.Optimizer):
            for where, text in optimizer_problems(target, node, join_key(path), self.manifest.tensors):  # before any tensor is read into the model beside it
                if self.select.wants(join_key(path + where)):
                    self.problem(path + where, text)
            params = [p for group in target.param_groups for p in group["params"]]
            self.param_hints.update({path + ("state", i): p for i, p in enumerate(params)})
            self.replaced.add(path + ("state",))
        elif is_scheduler(target) and (text := other_torch_class(target, node, join_key(path))) is not None:
            self.problem(path, text)
            return target
        if not isinstance(target, torch.nn.Module):
            self.taken.add(path)
        own, saved = target.state_dict(), node["stateful"]
        if isinstance(target, torch.nn.Module) and has_pre_hooks(target) and {k for k, _ in saved["dict"]} != set(own):
            renamed = hooked_names(target, saved["dict"], own, self.manifest.tensors)  # its back-compat renames
            saved = {**saved, "dict": [[renamed.get(k, k), child] for k, child in saved["dict"]]} if renamed else saved
        before = len(self.problems)
        sd = self.mapping(own, saved, path)
        if isinstance(target, torch.optim.Optimizer) and (self.select.only or self.select.exclude):
            for where, text in partial_state(sd.get("state"), node, self.rekeyed.get(path, {})):
                self.problem(path + where, text)
        if isinstance(target, torch.optim.Optimizer) and len(self.problems) == before and (text := load_problem(target, sd, node, join_key(path))):
            self.problem(path, text)
        self.loads.append(functools.partial(load_into, target, sd, join_key(path), self.strict, getattr(own, "_metadata", None)))
        return target

    def mapping(self, target: Any, node: dict, path: tuple, *, top: bool = False) -> Any:
        items = node["dict"]
        if is_stateful(target) and not isinstance(target, MutableMapping):  # a saved state_dict into its object
            return self.stateful(target, {"stateful": node, "class": "dict"}, path)
        if isinstance(target, MutableMapping):
            wildcard = (len(target) == 0 and (not top or self.select.take_all)) or self._in_replaced(path)  # replaced: any keys
            keyed = key_map(target, node)  # an optimizer's state keyed by position on one side, by name on the other
            if keyed is not None:
                self.rekeyed[path] = keyed
            renamed = self.rekeyed.get(path[:-1], {}) if path[-1:] == ("state",) else {}
            items = [(renamed.get(k, k), child) for k, child in items]
            names = NameMatch(target, [k for k, _ in items])
            if self.select.exclude:  # only exclude= patterns may match the target's own keys
                self.target_keys.update(join_key(path + (k,)) for k in target)
            if not wildcard:
                for k, v in target.items():
                    if not names.saved(k) and (top or _target_has_tensors(v)) and self.strict and self.select.wants(join_key(path + (k,))):
                        self.problem(path + (k,), "missing from the checkpoint" + key_types(k, [s for s, _ in items]))
            out = {}
            for saved_key, child in items:
                k = names.target_key(saved_key)
                if k not in target and child.get(BORROWED):  # another rank's key, and this target does not want it
                    continue
                if saved_key != k:
                    self.renamed_keys.add(join_key(path + (k,)))
                if not self._selected(child, path + (k,), *([join_key(path + (saved_key,))] if saved_key != k else [])):
                    if k in target:
                        out[k] = target[k]  # outside the selection: the target keeps its value
                    continue
                if not wildcard and k not in target and (top or has_tensors(child)):
                    if OPTIONAL in child:  # another rank's key (a pipeline stage's module): not this target's
                        self.new_layout |= not child.get(BORROWED)
                        continue
                    if self.strict:
                        self.problem(path + (k,), "in the checkpoint but not in the target (unexpected key)")
                    continue
                out[k] = self.value(target.get(k, _MISSING), child, path + (k,))
            if self.select.only or self.select.exclude:  # a load_state_dict() sees every key it has
                out.update({k: v for k, v in target.items() if k not in out and not self.select.wants(join_key(path + (k,)))})
            return out
        if target is not _MISSING and _target_has_tensors(target):
            self.problem(path, f"saved as a dict, the target holds a {type(target).__name__}")
            return target
        return {k: self.value(_MISSING, child, path + (k,)) for k, child in items if self._selected(child, path + (k,))}

    def _taken(self, path: tuple) -> bool:
        return _under(path, self.taken) or in_extra_state(path)

    def _in_replaced(self, path: tuple) -> bool:
        return _under(path, self.replaced)

    def _selected(self, node: dict, path: tuple, *aliases: str) -> bool:
        key = join_key(path)
        return self.select.reaches(key, *aliases) if children(node) else self.select.wants(key, *aliases)

    def sequence(self, target: Any, node: dict, path: tuple) -> Any:
        items = node.get("list", node.get("tuple"))
        kind = tuple if "tuple" in node else list
        same = isinstance(target, (list, tuple)) and len(target) == len(items)
        kept = not same and target and (has_tensors(node) or _target_has_tensors(target)) and not self._in_replaced(path)
        if isinstance(target, (list, tuple)) and kept:
            self.problem(path, f"saved {len(items)} items, the target has {len(target)}")
            return target
        out = []
        for i, child in enumerate(items):
            if self._selected(child, path + (i,)):
                out.append(self.value(target[i] if same else _MISSING, child, path + (i,)))
            elif same or (target is _MISSING and self.select.take_all):  # the target keeps its item (load(): None holds the place)
                out.append(target[i] if same else None)
            else:
                held = f"a target of {len(target)}" if isinstance(target, (list, tuple)) else "no such list in the target"
                self.problem(path + (i,), f"outside the selection, in a list saved with {len(items)} items and {held}: select the "
                                          "whole list or none of it")
        return kind(out)


@dataclasses.dataclass
class RestorePlan:
    manifest: Manifest
    reads: list[ReadBox]
    loads: list[Callable[[], None]]
    values: dict

    def missing(self, sources: Sources) -> list[str]:
        """Every shard this rank needs and cannot reach, as 'key (file, written by rank r)'."""
        out = []
        for read in self.reads:
            for shard in overlapping(read):
                if sources.pick(shard) is None:
                    f = shard.chunks[0].file
                    out.append(f"{read.entry.key} ({f}, written by rank {sources.rank_of.get(f, '?')})")
        return out


def plan_restore(state: Any, manifest: Manifest, *, rank: int, world_size: int, codecs: tuple[Codec, ...], select: Selection | bool = True) -> RestorePlan:
    """Check `state` against the manifest; raise CheckpointMismatchError listing every problem."""
    if not isinstance(state, MutableMapping):
        raise StateError(f"restore() needs the dict of objects to restore into, such as {{'model': model, 'optim': optimizer}}; "
                         f"got {type(state).__name__}")
    union = merge_trees([manifest.trees[i] for i in sorted(set(manifest.rank_trees))])  # each distinct tree once
    select = select if isinstance(select, Selection) else Selection(strict=bool(select))
    planner = _Planner(manifest, codecs, select, world_size, relaid=world_size != manifest.world_size)
    values = planner.mapping(state, union if planner.relaid else overlay(manifest.tree_of(rank), union), (), top=True)
    if planner.new_layout and not planner.relaid:  # this rank's keys changed: its own values may not be its own now
        planner = _Planner(manifest, codecs, select, world_size, relaid=True)
        values = planner.mapping(state, union, (), top=True)
    for pattern in unmatched(select, [*tree_keys(union), *planner.renamed_keys], planner.target_keys):
        planner.problems.append(
            f"{pattern!r} (in only=/exclude=/keys=) matches no key of step {manifest.step}; its top-level keys are "
            f"{', '.join(repr(k) for k, _ in union['dict'][:12])}"
        )
    if planner.problems:
        raise CheckpointMismatchError(manifest.step, planner.problems)
    return RestorePlan(manifest, planner.reads, planner.loads, values)


def execute(plan: RestorePlan, state: MutableMapping, sources: Sources) -> None:
    """Read every planned tensor (verified), then apply the loads and values."""
    read_all(plan, sources)
    apply(plan, state)


def read_all(plan: RestorePlan, sources: Sources) -> None:
    """Read every planned tensor into its target, each chunk verified (CheckpointCorruptError when
    no copy of one reads clean: the targets read until then hold the step's bytes)."""
    reads = sorted(plan.reads, key=_read_order)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read") as pool:
        futures = [pool.submit(read_box, sources, plan.manifest.step, r) for r in reads]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()  # the reads not started yet: this step is not going to be restored
            raise


def apply(plan: RestorePlan, state: MutableMapping) -> None:
    """After read_all: load_state_dict() on stateful objects, the primitives into the user's containers."""
    for load in plan.loads:
        load()
    for key, value in plan.values.items():
        if key in state:
            assign(state, key, value)
        else:
            state[key] = value


def _read_order(read: ReadBox) -> tuple:
    first = next((s.chunks[0] for s in read.entry.shards if s.chunks), None)
    return (first.file, first.offset) if first else ("", 0)
