"""Restore a committed manifest into the user's objects, in place (plan, then read, then apply).

1. Plan: walk the target state beside the manifest's tree. Collect every problem (missing or
   unexpected keys, shape/dtype/type mismatches); raise them together before touching anything.
2. Read: fill each tensor from its chunks (in place into the target's memory when it is a
   contiguous CPU tensor), verifying every chunk's digest.
3. Apply: load_state_dict() on stateful objects, assign primitives into the user's containers.
"""

from __future__ import annotations

import base64
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, MutableMapping

import numpy as np
import torch

from .codecs import Codec
from .dtypes import dtype_from_name
from .errors import CheckpointCorruptError, CheckpointMismatchError
from .manifest import Manifest, TensorEntry, chunk_digest
from .staging import tensor_view
from .storage import Storage
from .tree import is_stateful, join_key

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


class _Planner:
    def __init__(self, manifest: Manifest, codecs: tuple[Codec, ...], strict: bool) -> None:
        self.manifest = manifest
        self.codecs = {c.name: c for c in codecs}
        self.strict = strict
        self.problems: list[str] = []
        self.reads: list[tuple[TensorEntry, torch.Tensor]] = []
        self.loads: list[Callable[[], None]] = []

    def problem(self, path: tuple, text: str) -> None:
        self.problems.append(f"{join_key(path) or '<root>'}: {text}")

    def value(self, target: Any, node: dict, path: tuple) -> Any:
        """The restored value at `path`; tensors matching the target are read into it."""
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
        if isinstance(target, np.ndarray):
            dest = torch.from_numpy(target) if target.flags.writeable and target.dtype.kind in "biufc" else None
            if dest is None or tuple(target.shape) != entry.shape or dest.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is numpy {target.dtype}{list(target.shape)}")
                return target
            self.reads.append((entry, dest))
            return target
        if isinstance(target, torch.Tensor):
            if tuple(target.shape) != entry.shape or target.dtype != dtype:
                self.problem(path, f"saved {entry.dtype}{list(entry.shape)}, target is {str(target.dtype)[6:]}{list(target.shape)}")
                return target
            self.reads.append((entry, target.detach()))
            return target
        if target is not _MISSING and target is not None:
            self.problem(path, f"saved as a tensor, the target holds a {type(target).__name__}")
            return target
        fresh = torch.empty(entry.shape, dtype=dtype)
        self.reads.append((entry, fresh))
        return fresh.numpy() if as_numpy else fresh

    def stateful(self, target: Any, node: dict, path: tuple) -> Any:
        if not is_stateful(target):
            self.problem(path, f"saved from a {node['class']} (state_dict), the target is a {type(target).__name__}")
            return target
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


def read_tensor(storage: Storage, step: int, entry: TensorEntry, dest: torch.Tensor) -> None:
    """Fill `dest` from the entry's chunks, verifying every chunk; in place when possible."""
    if not entry.shards or math.prod(entry.shape) == 0:
        return
    direct = dest.device.type == "cpu" and dest.is_contiguous()
    host = dest if direct else torch.empty(entry.shape, dtype=dest.dtype)
    view = tensor_view(host)
    chunks = entry.shards[0].chunks  # one rank: one shard covering the whole tensor
    pos = 0
    i = 0
    while i < len(chunks):
        j = i + 1  # coalesce chunks that are adjacent in the same file into one read
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
    if not direct:
        dest.copy_(host)


def restore_into(state: Any, manifest: Manifest, storage: Storage, *, codecs: tuple[Codec, ...], strict: bool) -> None:
    if not isinstance(state, MutableMapping):
        raise TypeError(f"restore() needs the dict of objects to restore into, got {type(state).__name__}")
    planner = _Planner(manifest, codecs, strict)
    values = planner.mapping(state, manifest.tree, (), top=True)
    if planner.problems:
        raise CheckpointMismatchError(manifest.step, planner.problems)
    reads = sorted(planner.reads, key=lambda r: (r[0].shards[0].chunks[0].file, r[0].shards[0].chunks[0].offset) if r[0].shards[0].chunks else ("", 0))
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ckpt-read") as pool:
        for fut in [pool.submit(read_tensor, storage, manifest.step, e, d) for e, d in reads]:
            fut.result()
    for load in planner.loads:
        load()
    for key, value in values.items():
        if key in state:
            _assign(state, key, value)
        else:
            state[key] = value

