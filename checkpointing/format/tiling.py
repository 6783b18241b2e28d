"""Do a tensor's shards tile it: no two overlap (layer: format, pure).

decode.py checks it for every tensor of a manifest it reads, rank_reports.py for every tensor rank 0
merges, before either is trusted; a hostile manifest can list any boxes at all.
"""

from __future__ import annotations

import itertools
import math

from checkpointing.errors import ManifestError


def check_tiling(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], where: str) -> None:
    """Shards (offsets, shape) must tile the global shape: no overlaps (with the element count checked by the caller, no holes).

    O(n log n) for any sharding a save produces. Boxes with equal offsets in every dimension but
    the first (sharding on dim 0 only, the common case) are intervals: neighbours after the sort
    must not overlap. Otherwise the boxes are painted onto the grid their
    boundaries cut (as many cells as boxes for a tiling, so linear after the sort); only when that
    grid is far larger than the boxes (boxes not aligned with each other) does a sweep along the
    first dimension compare the boxes whose first-dimension spans overlap.
    """
    nonempty = sorted((o, s) for o, s in boxes if math.prod(s))
    if shape and nonempty and all(o[1:] == nonempty[0][0][1:] for o, _ in nonempty):
        # all start at one corner in the other dimensions (sharded on the first only, as FSDP does), so
        # any two overlap there: they overlap where their first-dimension intervals do
        for (oa, sa), (ob, _) in itertools.pairwise(nonempty):
            if ob[0] < oa[0] + sa[0]:
                raise ManifestError(f"{where}: shards at offsets {list(oa)} and {list(ob)} overlap")
        return
    if len(shape) >= 2 and len(nonempty) > 16 and _paint_grid(nonempty, len(shape), where):
        return
    for i, (oa, sa) in enumerate(nonempty):
        for j in range(i + 1, len(nonempty)):
            ob, sb = nonempty[j]
            if ob[0] >= oa[0] + sa[0] if shape else False:
                break  # sorted by the first offset: no later shard can overlap this one
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                raise ManifestError(f"{where}: shards at offsets {list(oa)} and {list(ob)} overlap")


def _paint_grid(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], ndim: int, where: str) -> bool:
    """Paint every box onto the grid of all box boundaries; an overlap raises. False (nothing
    decided) when the grid has far more cells than there are boxes."""
    cuts = [sorted({o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes}) for d in range(ndim)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 4 * len(boxes) + 4096:
        return False
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(ndim)]
    owner = [-1] * cells
    for b, (o, n) in enumerate(boxes):
        spans = [range(index[d][o[d]] * strides[d], index[d][o[d] + n[d]] * strides[d], strides[d]) for d in range(ndim)]
        for cell in itertools.product(*spans):
            flat = sum(cell)
            if owner[flat] >= 0:
                other = boxes[owner[flat]][0]
                raise ManifestError(f"{where}: shards at offsets {list(other)} and {list(o)} overlap")
            owner[flat] = b
    return True
