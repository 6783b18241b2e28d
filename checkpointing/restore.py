"""Restore a committed manifest into the user's objects, in place (plan, then read, then apply).

1. Plan: walk the target state beside the manifest's tree (this rank's tree at the same world
   size; at another world size the ranks' trees merged, per-rank values refused by name). Collect
   every problem (missing or unexpected keys, shape/dtype/type mismatches); raise them together
   before touching anything.
2. Read: each target covers a box of its global tensor (a DTensor its local shard, a plain tensor
   all of it). Every saved shard overlapping the box is read from a copy this rank can reach (its
   local tier, else the remote one): whole chunks, each verified against its digest, straight into
   the target's memory when the box is exactly one saved shard (the usual same-world case).
3. Apply: load_state_dict() on stateful objects, assign primitives into the user's containers.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, MutableMapping

import numpy as np
import torch

from .codecs import Codec
from .dtypes import dtype_from_name
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, StateError
from .manifest import ChunkRef, Manifest, ShardEntry, TensorEntry, chunk_digest
from .sharding import dtensor_layout, intersect, is_dtensor, row_span
from .staging import tensor_view
from .storage import Storage
from .tree import is_stateful, join_key

log = logging.getLogger("checkpointing")

_MISSING = object()
READ_THREADS = 4


def _has_tensors(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if "tensor" in node or "ndarray" in node:
        return True
    return any(_has_tensors(v) for v in _children(node))


def _children(node: dict) -> list:
    if "dict" in node:
        return [v for _, v in node["dict"]]
    if "list" in node or "tuple" in node:
        return node.get("list", node.get("tuple"))
    if "stateful" in node:
        return [node["stateful"]]
    return []


def _target_has_tensors(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(obj, dict):
        return any(_target_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_target_has_tensors(v) for v in obj)
    return is_stateful(obj)


@dataclasses.dataclass(frozen=True)
class _Read:
    entry: TensorEntry
    dest: torch.Tensor  # local memory to fill (a DTensor's local shard)
    box_offsets: tuple[int, ...]  # the part of the global tensor `dest` holds
    box_shape: tuple[int, ...]


class _Planner:
    def __init__(self, manifest: Manifest, codecs: tuple[Codec, ...], strict: bool, world_size: int) -> None:
        self.manifest = manifest
        self.codecs = {c.name: c for c in codecs}
        self.strict = strict
        self.world_size = world_size
        self.problems: list[str] = []
        self.reads: list[_Read] = []
        self.loads: list[Callable[[], None]] = []
        self.param_hints: dict[tuple, torch.Tensor] = {}  # optimizer state path -> its parameter

    def problem(self, path: tuple, text: str) -> None:
        self.problems.append(f"{join_key(path) or '<root>'}: {text}")

    def value(self, target: Any, node: dict, path: tuple) -> Any:
        """The restored value at `path`; tensors matching the target are read into it."""
        if PER_RANK in node:
            self.problem(
                path,
                f"saved per rank (the {self.manifest.world_size} saving ranks hold different values), so it cannot be "
                f"mapped to {self.world_size} ranks; restore with {self.manifest.world_size} ranks, or leave it out of "
                "the state passed to restore",
            )
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

    def leaf(self, node: dict, path: tuple) -> Any:
        if "value" in node:
            return node["value"]
        if "float" in node:
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[node["float"]]
        if "bytes" in node:
            return base64.b64decode(node["bytes"])
        codec = self.codecs.get(node["codec"])
        if codec is None:
            self.problem(path, f"saved with codec {node['codec']!r}: pass CheckpointManager(codecs=[...]) with that codec")
            return None
        return codec.decode(node["data"])

    def tensor(self, target: Any, node: dict, path: tuple) -> Any:
        entry = self.manifest.tensors[node.get("tensor", node.get("ndarray"))]
        dtype = dtype_from_name(entry.dtype)
        as_numpy = "ndarray" in node
        full = ((0,) * len(entry.shape), entry.shape)
        if isinstance(target, np.ndarray):
            dest = torch.from_numpy(target) if target.flags.writeable and target.dtype.kind in "biufc" else None
            if dest is None or tuple(target.shape) != entry.shape or dest.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is numpy {target.dtype}{list(target.shape)}")
                return target
            self.reads.append(_Read(entry, dest, *full))
            return target
        if isinstance(target, torch.Tensor):
            if tuple(target.shape) != entry.shape or target.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is {str(target.dtype)[6:]}{list(target.shape)}")
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
        if self.world_size > 1 and len(entry.shards) > 1:
            self.problem(
                path,
                "saved as a sharded DTensor and missing from the target: create it first (for optimizer state, "
                "torch.distributed.checkpoint.state_dict.get_state_dict does) so it can be read in its sharding",
            )
            return None
        fresh = torch.empty(entry.shape, dtype=dtype)
        self.reads.append(_Read(entry, fresh, *full))
        return fresh.numpy() if as_numpy else fresh

    def read_into(self, entry: TensorEntry, target: torch.Tensor, path: tuple) -> None:
        if is_dtensor(target):
            try:
                local, layout = dtensor_layout(target.detach(), join_key(path))
            except StateError as exc:
                self.problem(path, str(exc))
                return
            if layout.replicas:  # ranks outside the DTensor's mesh hold nothing of it
                self.reads.append(_Read(entry, local, layout.offsets, tuple(local.shape)))
            return
        self.reads.append(_Read(entry, target.detach(), (0,) * len(entry.shape), entry.shape))

    def stateful(self, target: Any, node: dict, path: tuple) -> Any:
        if not is_stateful(target):
            self.problem(path, f"saved from a {node['class']} (state_dict), the target is a {type(target).__name__}")
            return target
        if isinstance(target, torch.optim.Optimizer):
            params = [p for group in target.param_groups for p in group["params"]]
            self.param_hints.update({path + ("state", i): p for i, p in enumerate(params)})
        sd = self.mapping(target.state_dict(), node["stateful"], path)
        if isinstance(target, torch.nn.Module):
            self.loads.append(lambda: target.load_state_dict(sd, strict=self.strict))
        else:
            self.loads.append(lambda: target.load_state_dict(sd))
        return target

    def mapping(self, target: Any, node: dict, path: tuple, *, top: bool = False) -> Any:
        items = node["dict"]
        if isinstance(target, MutableMapping):
            wildcard = len(target) == 0 and not top
            saved = {k for k, _ in items}
            if not wildcard:
                for k, v in target.items():
                    if k not in saved and (top or _target_has_tensors(v)) and self.strict:
                        self.problem(path + (k,), "missing from the checkpoint")
            out = {}
            for k, child in items:
                if not wildcard and k not in target and (top or _has_tensors(child)):
                    if self.strict:
                        self.problem(path + (k,), "in the checkpoint but not in the target (unexpected key)")
                    continue
                out[k] = self.value(target.get(k, _MISSING), child, path + (k,))
            return out
        if target is not _MISSING and _target_has_tensors(target):
            self.problem(path, f"saved as a dict, the target holds a {type(target).__name__}")
            return target
        return {k: self.value(_MISSING, child, path + (k,)) for k, child in items}

    def sequence(self, target: Any, node: dict, path: tuple) -> Any:
        items = node.get("list", node.get("tuple"))
        kind = tuple if "tuple" in node else list
        same = isinstance(target, (list, tuple)) and len(target) == len(items)
        if isinstance(target, (list, tuple)) and not same and target and (_has_tensors(node) or _target_has_tensors(target)):
            self.problem(path, f"saved {len(items)} items, the target has {len(target)}")
            return target
        return kind(self.value(target[i] if same else _MISSING, child, path + (i,)) for i, child in enumerate(items))


def _assign(container: Any, key: Any, value: Any) -> None:
    """Put `value` into container[key], updating nested dicts and lists in place."""
    current = container[key]
    if current is value:
        return
    if isinstance(current, MutableMapping) and isinstance(value, dict):
        for k, v in value.items():
            if k in current:
                _assign(current, k, v)
            else:
                current[k] = v
        return
    if isinstance(current, list) and isinstance(value, list) and len(current) == len(value):
        for i, v in enumerate(value):
            _assign(current, i, v)
        return
    container[key] = value


PER_RANK = "per_rank"  # marks a node whose value differs between the saving ranks (never written to disk)


def merge_trees(trees: list[Any]) -> Any:
    """One tree for a restore at another world size: equal subtrees kept, differing ones marked."""
    first = trees[0]
    if all(t == first for t in trees[1:]):
        return first
    if all(isinstance(t, dict) and "dict" in t for t in trees):
        keys = [[k for k, _ in t["dict"]] for t in trees]
        if all(k == keys[0] for k in keys[1:]):
            return {"dict": [[k, merge_trees([t["dict"][i][1] for t in trees])] for i, k in enumerate(keys[0])]}
    for kind in ("list", "tuple"):
        if isinstance(first, dict) and kind in first and all(isinstance(t, dict) and kind in t and len(t[kind]) == len(first[kind]) for t in trees):
            return {kind: [merge_trees([t[kind][i] for t in trees]) for i in range(len(first[kind]))]}
    if isinstance(first, dict) and "stateful" in first and all(isinstance(t, dict) and "stateful" in t and t["class"] == first["class"] for t in trees):
        return {"stateful": merge_trees([t["stateful"] for t in trees]), "class": first["class"]}
    return {PER_RANK: True}


class Sources:
    """Where this rank reads a step's data files from, in order of preference.

    The local tier holds the files the manifest places on its tier (a missing one there is damage,
    reported as such) when it holds the step at all (`local` is None when it does not: pruned, or a
    replaced node); a remote tier, when it holds the step, holds every primary copy. A shard whose
    local copy fails verification is read again from the remote tier (see read_box).
    """

    def __init__(self, manifest: Manifest, local: Storage | None, tier: str, remote: Storage | None = None, *, where: str = "") -> None:
        self.tier_of = {f.path: f.tier for f in manifest.files}
        self.rank_of = {f.path: f.rank for f in manifest.files}
        self.local = local
        self.tier = tier
        self.remote = remote
        self.where = where
        self._lock = threading.Lock()
        self.remote_bytes = 0  # bytes read from the remote tier (restore's log line)
        self.fallbacks: list[str] = []  # local copies that failed verification and were read remotely

    def pick(self, shard: ShardEntry) -> tuple[Storage, tuple[ChunkRef, ...]] | None:
        if self.local is not None:
            for copy in shard.copies():
                if not copy or self.tier_of.get(copy[0].file, "") in ("", self.tier):
                    return self.local, copy
        if self.remote is not None:
            return self.remote, shard.chunks
        return None

    def count_remote(self, nbytes: int) -> None:
        with self._lock:
            self.remote_bytes += nbytes

    def fell_back(self, note: str) -> None:
        with self._lock:
            self.fallbacks.append(note)


@dataclasses.dataclass
class RestorePlan:
    manifest: Manifest
    reads: list[_Read]
    loads: list[Callable[[], None]]
    values: dict

    def missing(self, sources: Sources) -> list[str]:
        """Every shard this rank needs and cannot reach, as 'key (file, written by rank r)'."""
        out = []
        for read in self.reads:
            for shard in _overlapping(read):
                if sources.pick(shard) is None:
                    f = shard.chunks[0].file
                    out.append(f"{read.entry.key} ({f}, written by rank {sources.rank_of.get(f, '?')})")
        return out


def plan_restore(state: Any, manifest: Manifest, *, rank: int, world_size: int, codecs: tuple[Codec, ...], strict: bool) -> RestorePlan:
    """Check `state` against the manifest; raise CheckpointMismatchError listing every problem."""
    if not isinstance(state, MutableMapping):
        raise TypeError(f"restore() needs the dict of objects to restore into, got {type(state).__name__}")
    if world_size == manifest.world_size:
        tree = manifest.tree_of(rank)
    else:
        tree = merge_trees([manifest.tree_of(r) for r in range(manifest.world_size)])
    planner = _Planner(manifest, codecs, strict, world_size)
    values = planner.mapping(state, tree, (), top=True)
    if planner.problems:
        raise CheckpointMismatchError(manifest.step, planner.problems)
    return RestorePlan(manifest, planner.reads, planner.loads, values)


def execute(plan: RestorePlan, state: MutableMapping, sources: Sources) -> None:
    """Read every planned tensor (verified), then apply the loads and values."""
    reads = sorted(plan.reads, key=_read_order)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read") as pool:
        for fut in [pool.submit(read_box, sources, plan.manifest.step, r) for r in reads]:
            fut.result()
    for load in plan.loads:
        load()
    for key, value in plan.values.items():
        if key in state:
            _assign(state, key, value)
        else:
            state[key] = value


def _read_order(read: _Read) -> tuple:
    first = next((s.chunks[0] for s in read.entry.shards if s.chunks), None)
    return (first.file, first.offset) if first else ("", 0)


def _overlapping(read: _Read) -> list[ShardEntry]:
    return [s for s in read.entry.shards if s.chunks and intersect(read.box_offsets, read.box_shape, s.offsets, s.shape)]


def read_box(sources: Sources, step: int, read: _Read) -> None:
    """Fill `read.dest` (its box of the global tensor) from every overlapping saved shard."""
    entry = read.entry
    if math.prod(read.box_shape) == 0:
        return
    for shard in _overlapping(read):
        found = sources.pick(shard)
        if found is None:
            raise CheckpointError(
                f"step {step}, tensor {entry.key!r}: the shard at {list(shard.offsets)} is in {shard.chunks[0].file}, which "
                f"this rank cannot reach{sources.where}"
            )
        storage, chunks = found
        try:
            _read_shard(storage, step, entry, shard, chunks, read, sources)
        except CheckpointCorruptError as exc:
            if storage is sources.remote or sources.remote is None:
                raise
            # the local copy is damaged or gone: the remote tier holds the step, read it from there
            log.warning("checkpointing: %s; reading this shard from the remote tier %s instead", exc, sources.remote.url)
            sources.fell_back(str(exc))
            _read_shard(sources.remote, step, entry, shard, shard.chunks, read, sources)


def _read_shard(storage: Storage, step: int, entry: TensorEntry, shard: ShardEntry, chunks: tuple[ChunkRef, ...], read: _Read, sources: Sources) -> None:
    dest = read.dest
    if storage is sources.remote:
        sources.count_remote(sum(c.length for c in chunks))
    whole = shard.offsets == read.box_offsets and shard.shape == read.box_shape
    if whole and dest.device.type == "cpu" and dest.is_contiguous():
        _read_chunks(storage, step, entry, chunks, tensor_view(dest), 0)  # straight into the target
        return
    box = intersect(read.box_offsets, read.box_shape, shard.offsets, shard.shape)
    assert box is not None
    _copy_box(storage, step, entry, shard, chunks, box, read)


def _copy_box(storage: Storage, step: int, entry: TensorEntry, shard: ShardEntry, chunks: tuple[ChunkRef, ...], box: tuple, read: _Read) -> None:
    """Read the whole chunks that hold `box`'s rows of `shard`, verify them, copy the box into dest."""
    dtype = dtype_from_name(entry.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    offsets, shape = box
    r0, r1 = row_span(offsets, shape, shard.offsets, shard.shape)
    row_bytes = math.prod(shard.shape[1:]) * size if shard.shape else size
    lo, hi = r0 * row_bytes, r1 * row_bytes
    starts = [0]
    for c in chunks:
        starts.append(starts[-1] + c.length)
    first = max(i for i in range(len(chunks)) if starts[i] <= lo)
    last = min(i for i in range(1, len(chunks) + 1) if starts[i] >= hi)
    buf = torch.empty(starts[last] - starts[first], dtype=torch.uint8)
    _read_chunks(storage, step, entry, chunks[first:last], tensor_view(buf), 0)
    rows = buf[lo - starts[first] : hi - starts[first]]
    if (lo - starts[first]) % size:
        rows = rows.clone()  # a chunk boundary that is not element-aligned
    if not shard.shape:
        read.dest.copy_(rows.view(dtype).reshape(()))
        return
    rows = rows.view(dtype).reshape((r1 - r0,) + tuple(shard.shape[1:]))
    src = rows[(slice(None),) + tuple(slice(o - s, o - s + n) for o, s, n in zip(offsets[1:], shard.offsets[1:], shape[1:]))]
    read.dest[tuple(slice(o - b, o - b + n) for o, b, n in zip(offsets, read.box_offsets, shape))].copy_(src)


def _read_chunks(storage: Storage, step: int, entry: TensorEntry, chunks: tuple[ChunkRef, ...], view: memoryview, pos: int) -> None:
    """Read `chunks` (coalescing neighbours in one file) into view[pos:], verifying each digest."""
    i = 0
    while i < len(chunks):
        j = i + 1
        while j < len(chunks) and chunks[j].file == chunks[i].file and chunks[j].offset == chunks[j - 1].offset + chunks[j - 1].length:
            j += 1
        length = sum(c.length for c in chunks[i:j])
        where = f"step {step}, tensor {entry.key!r}, file {storage.url}/{chunks[i].file}"
        try:
            storage.read_into(chunks[i].file, chunks[i].offset, view[pos : pos + length])
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: the data file is missing") from None
        except EOFError as exc:
            raise CheckpointCorruptError(f"{where}: truncated ({exc})") from None
        for c in chunks[i:j]:
            got = chunk_digest(view[pos : pos + c.length])
            if got != c.digest:
                raise CheckpointCorruptError(
                    f"{where}: bytes {c.offset}..{c.offset + c.length} are damaged ({got} != {c.digest}); "
                    "restore another step with restore(step=...), or run `checkpointing verify`"
                )
            pos += c.length
        i = j
