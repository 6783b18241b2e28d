"""Where a tensor's local data sits in its global tensor, and box arithmetic on shards.

A DTensor's local shard is a box (offsets, shape) in the global tensor; the ranks whose mesh
coordinates agree on every sharded mesh dimension hold the same box (its replicas). Plain tensors
are not sharded: every rank has its own full value, equal or not (the merge finds out by digest).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from checkpointing.errors import StateError


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # where the local shard starts in the global tensor
    replicas: tuple[int, ...]  # global ranks holding this very shard (this rank included), ascending


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
    return t.to_local() if is_dtensor(t) else t


def dtensor_layout(dt: Any, key: str) -> tuple[torch.Tensor, ShardLayout]:
    """(local shard, its layout) of a DTensor; StateError for placements a checkpoint cannot map."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(dt.placements)
    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise StateError(
                f"state[{key!r}] is a DTensor with placement {p}: only Shard and Replicate placements can be "
                "checkpointed (redistribute Partial tensors first; strided FSDP+TP shards are not supported)"
            )
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    local = dt.to_local()
    if coord is None:  # this rank is not in the mesh: it holds nothing of this tensor
        return local, ShardLayout(tuple(dt.shape), (0,) * dt.dim(), ())
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise StateError(
            f"state[{key!r}]: the DTensor's local shard has shape {list(local.shape)}, its placements "
            f"{list(placements)} give {list(shape)}; pass a DTensor whose local data matches its spec"
        )
    index = tuple(coord[d] if isinstance(p, Shard) else slice(None) for d, p in enumerate(placements))
    replicas = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
    return local, ShardLayout(tuple(dt.shape), tuple(int(o) for o in offsets), replicas)


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
