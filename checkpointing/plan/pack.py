"""Where each chunk of each tensor goes in the pack file and in the staging pool (pure).

The pack file is the staging pool's image: a chunk at pack offset `o` is staged at pool offset
`o % pool_bytes`. Without a budget the chunks lie back to back and the pool is exactly the data's
size (the identity). With a smaller budget the pool is a ring of whole 4 KiB pages, and no chunk
straddles its end (the cursor skips to the next ring boundary, leaving unreferenced padding in the
pack).

Across ranks the pack is ordered by region (see assign.py): what only this rank holds, then the
replicated tensors it writes for everyone, then its copies for its own local tier, then the
replicated tensors another rank should write. The writer writes a prefix of the pack; the last
region is written only where no peer turned out to hold the same bytes. Staging copies eager
leaves first whatever their region, so save() returns as early as before.
"""

from __future__ import annotations

import dataclasses

POOL_ALIGN = 4096  # ring size and boundaries: O_DIRECT block size


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclasses.dataclass(frozen=True)
class Placement:
    leaf: int  # index into the flattened leaves
    src_offset: int  # byte offset inside the leaf
    length: int
    pack_offset: int


@dataclasses.dataclass(frozen=True)
class PackPlan:
    placements: tuple[Placement, ...]  # in pack order: by region, eager leaves first within one
    eager_placements: int  # how many leading entries of stage_order save() copies before returning
    pack_bytes: int  # end of the last chunk
    pool_bytes: int
    stage_order: tuple[int, ...] = ()  # placement indices in copy order: eager ones first
    region_ends: tuple[int, ...] = ()  # pack offset where each region ends

    @property
    def ring(self) -> bool:
        """A staging budget below the pack: staging streams it through the pool, which then is not the pack's image."""
        return self.pool_bytes < self.pack_bytes

    @property
    def data_bytes(self) -> int:
        return sum(p.length for p in self.placements)


def plan_pack(
    leaf_nbytes: list[int], deferred: list[bool], *, chunk_bytes: int, budget: int | None, regions: list[int] | None = None
) -> PackPlan:
    """Place every leaf's bytes, split into chunks of at most `chunk_bytes`, ordered by region."""
    regions = regions or [0] * len(leaf_nbytes)
    n_regions = max(regions, default=0) + 1
    order = sorted(range(len(leaf_nbytes)), key=lambda i: (regions[i], deferred[i], i))
    unbounded = _place(leaf_nbytes, deferred, order, chunk_bytes, pool=None)
    if budget is None or budget >= unbounded.pack_bytes:
        plan = dataclasses.replace(unbounded, pool_bytes=unbounded.pack_bytes)
    else:
        if n_regions > 1:
            raise ValueError("a staging ring streams the pack in order: every leaf must be in region 0")
        pool = max(2 * POOL_ALIGN, budget // POOL_ALIGN * POOL_ALIGN)
        # a chunk plus one partly written page must fit, or the writer could not free room for it
        plan = _place(leaf_nbytes, deferred, order, min(chunk_bytes, pool - POOL_ALIGN), pool=pool)
    eager = [i for i, p in enumerate(plan.placements) if not deferred[p.leaf]]
    lazy = [i for i, p in enumerate(plan.placements) if deferred[p.leaf]]
    ends = [0] * n_regions
    for p in plan.placements:
        ends[regions[p.leaf]] = p.pack_offset + p.length
    for r in range(1, n_regions):  # an empty region ends where the one before it does
        ends[r] = max(ends[r], ends[r - 1])
    return dataclasses.replace(plan, stage_order=tuple(eager + lazy), region_ends=tuple(ends))


def _place(leaf_nbytes: list[int], deferred: list[bool], order: list[int], chunk: int, pool: int | None) -> PackPlan:
    placements = []
    n_eager = 0
    cursor = 0
    for leaf in order:
        done = 0
        while done < leaf_nbytes[leaf]:
            length = min(chunk, leaf_nbytes[leaf] - done)
            if pool is not None and cursor % pool + length > pool:
                cursor = round_up(cursor, pool)
            placements.append(Placement(leaf, done, length, cursor))
            n_eager += not deferred[leaf]
            cursor += length
            done += length
    return PackPlan(tuple(placements), n_eager, cursor, pool or 0)


def write_spans(placements: list[Placement], *, align: int = POOL_ALIGN) -> list[tuple[int, int]]:
    """The pool ranges to write so that `placements` (in pack order) reach the file: each chunk's
    range widened to whole `align` pages (aligned addresses and lengths keep O_DIRECT writes
    possible) and adjacent or overlapping ranges merged. The last range ends with its last chunk:
    a stream's last write may be short, and nothing is written past what was asked for.

    A chunk at pool offset `o` inside span (start, end) written at file offset `w` lands at
    `w + o - start`; the bytes around it that the widening pulled in are padding.
    """
    spans: list[tuple[int, int]] = []
    for p in placements:
        start = p.pack_offset // align * align
        end = round_up(p.pack_offset + p.length, align)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    if spans:
        spans[-1] = (spans[-1][0], max(p.pack_offset + p.length for p in placements))
    return spans
