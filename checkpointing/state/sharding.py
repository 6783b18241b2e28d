"""Where a tensor's local data sits in its global tensor, and box arithmetic on shards.

A DTensor's local shard is a box (offsets, shape) in the global tensor; the ranks whose mesh
coordinates agree on every sharded mesh dimension hold the same box (its replicas). Plain tensors
are not sharded: every rank has its own full value, equal or not (the merge finds out by digest).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from typing import Any

import torch

from checkpointing.errors import StateError


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # where the local shard starts in the global tensor
    replicas: tuple[int, ...]  # global ranks holding this very shard (this rank included), ascending
    mesh_ranks: tuple[int, ...] = ()  # every global rank of the DTensor's mesh, ascending: which tensor this is a shard of


def is_dtensor(obj: Any) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(obj, dtensor)


def _dtensor_type() -> Any:
    """DTensor, if its module is loaded: no object is a DTensor before it is (importing it here
    would cost a job that never uses DTensors most of a second inside its first save())."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The memory that holds `t`'s data on this rank (a DTensor's local shard; `t` itself otherwise)."""
    return _local_of(t) if is_dtensor(t) else t


def _local_of(dt: Any) -> torch.Tensor:
    """A DTensor's local shard: the tensor `to_local()` returns a view of, without that call's
    autograd function (about 20 us per DTensor, which save() pays on the training thread for every
    parameter and optimizer state); to_local() where a DTensor does not keep it so."""
    local = getattr(dt, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else dt.to_local()


def dtensor_layout(dt: Any, key: str) -> tuple[torch.Tensor, ShardLayout]:
    """(local shard, its layout) of a DTensor on any mesh; StateError for what a checkpoint cannot map.

    `Shard`, `_StridedShard` (FSDP2 over tensor parallel) and `Replicate` map: torch's own shard
    arithmetic gives, per tensor dim, the global indices the local shard holds, and those must be
    one contiguous run (they are for every layout FSDP2, TP, SP, HSDP and expert sharding produce).
    `Partial` is refused: its local values are addends of a sum that only a collective can form.
    """
    placements = tuple(dt.placements)
    mesh = dt.device_mesh
    local = _local_of(dt)
    for p in placements:
        if p.is_partial():
            raise StateError(
                f"state[{key!r}] is a DTensor with a Partial placement ({type(p).__name__}, reduce op "
                f"{getattr(p, 'reduce_op', '?')!r}): its local values are addends of a sum, not the tensor; reduce it "
                "before saving (dt.redistribute(dt.device_mesh, [Replicate() if p.is_partial() else p for p in "
                "dt.placements])) or save dt.full_tensor()"
            )
    layout, shape = _layout_of(mesh, tuple(dt.shape), placements, key)
    if shape is not None and shape != tuple(local.shape):
        raise StateError(
            f"state[{key!r}]: the DTensor's local shard does not have the shape its placements {list(placements)} "
            "give it; pass a DTensor whose local data matches its spec (DTensor.from_local(..., shape=, stride=))"
        )
    return local, layout


_LAYOUTS: dict[tuple, tuple[Any, ShardLayout, tuple[int, ...] | None]] = {}  # (id(mesh), shape, placements) -> (mesh ref, layout, local shape)


def _layout_of(mesh: Any, global_shape: tuple[int, ...], placements: tuple, key: str) -> tuple[ShardLayout, tuple[int, ...] | None]:
    """This rank's box of a tensor of `global_shape` placed so on `mesh`, and its local shape (None: not in the mesh).

    Cached per mesh, shape and placements: the mesh's rank table and torch's shard arithmetic cost
    about a millisecond per DTensor, which every save() would otherwise pay on the training thread
    for every parameter and optimizer state.
    """
    cache_key = (id(mesh), global_shape, placements)
    hit = _LAYOUTS.get(cache_key)
    if hit is not None and hit[0]() is mesh:
        return hit[1], hit[2]
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing of this tensor
        layout = ShardLayout(global_shape, (0,) * len(global_shape), (), _ranks(mesh.mesh))
        shape: tuple[int, ...] | None = None
    else:
        shape, offsets = shard_box(global_shape, tuple(mesh.shape), tuple(coord), placements, key)
        index = tuple(coord[d] if _shards(p) else slice(None) for d, p in enumerate(placements))
        layout = ShardLayout(global_shape, offsets, _ranks(mesh.mesh[index]), _ranks(mesh.mesh))
    if len(_LAYOUTS) >= 4096:
        _LAYOUTS.clear()
    _LAYOUTS[cache_key] = (weakref.ref(mesh), layout, shape)
    return layout, shape


def _ranks(ranks: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in ranks.flatten().tolist()))


def _shards(placement: Any) -> bool:
    """Shard or _StridedShard (torch's is_shard() says False for the latter)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    return isinstance(placement, (Shard, _StridedShard))


def shard_box(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offsets) of the box of the global tensor that mesh coordinate `coord` holds.

    Applies the placements left to right as torch does, keeping every dim's global indices, so a
    `_StridedShard` (whose local rows are a strided subset until the later `Shard` picks one run)
    lands where torch puts it; a local shard that is not one box is refused.
    """
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError:  # an older torch: its public helper knows Shard and Replicate
        return _box_from_public_helper(global_shape, mesh_shape, coord, placements, key)
    sizes = list(global_shape)
    indices: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if not _shards(p):
            continue
        size, index = _get_shard_size_and_offsets(sizes[p.dim], mesh_shape[mesh_dim], coord[mesh_dim], p, indices.get(p.dim), global_shape[p.dim], False)
        sizes[p.dim] = int(size)
        indices[p.dim] = index
    offsets = [0] * len(global_shape)
    for dim, index in indices.items():
        if sizes[dim] == 0:
            continue  # an empty shard (uneven split): it holds nothing, wherever it says it starts
        runs = index[: sizes[dim]]
        first = int(runs[0])
        if not torch.equal(runs, torch.arange(first, first + sizes[dim], dtype=runs.dtype)):
            raise StateError(
                f"state[{key!r}]: the DTensor's placements {list(placements)} give a rank rows of dim {dim} that "
                "are not one contiguous block; redistribute it to Shard/Replicate placements before saving"
            )
        offsets[dim] = first
    return tuple(sizes), tuple(offsets)


def _box_from_public_helper(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if not all(isinstance(p, Shard) or not _shards(p) for p in placements):
        raise StateError(f"state[{key!r}]: saving {list(placements)} (FSDP2 over tensor parallel) needs a newer torch than {torch.__version__}")
    shape, offsets = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), placements)
    return tuple(int(n) for n in shape), tuple(int(o) for o in offsets)


def intersect(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box both boxes cover (offsets, shape), or None when they do not overlap."""
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_shape, b_off, b_shape))
    shape = tuple(h - l for l, h in zip(lo, hi))
    if any(n <= 0 for n in shape) or math.prod(a_shape) == 0 or math.prod(b_shape) == 0:
        return None
    return lo, shape


def row_span(box_off: tuple[int, ...], box_shape: tuple[int, ...], shard_off: tuple[int, ...], shard_shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows [r0, r1) of the shard (dim 0, relative to it) that contain `box` (a sub-box of the shard).

    Those rows are one contiguous byte range of the shard's row-major data; a 0-dim shard has one row.
    """
    if not shard_shape:
        return 0, 1
    r0 = box_off[0] - shard_off[0]
    return r0, r0 + box_shape[0]
