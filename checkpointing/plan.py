"""Where each chunk of each tensor goes in the pack file and in the staging pool (pure).

The pack file is the staging pool's image: a chunk at pack offset `o` is staged at pool offset
`o % pool_bytes`. Without a budget the chunks lie back to back and the pool is exactly the data's
size (the identity). With a smaller budget the pool is a ring of whole 4 KiB pages, and no chunk
straddles its end (the cursor skips to the next ring boundary, leaving unreferenced padding in the
pack).
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
    placements: tuple[Placement, ...]  # in pack order: eager leaves first, then deferred ones
    eager_placements: int  # how many leading placements save() copies before returning
    pack_bytes: int  # end of the last chunk
    pool_bytes: int

    @property
    def data_bytes(self) -> int:
        return sum(p.length for p in self.placements)


def plan_pack(leaf_nbytes: list[int], deferred: list[bool], *, chunk_bytes: int, budget: int | None) -> PackPlan:
    """Place every leaf's bytes, split into chunks of at most `chunk_bytes`."""
    order = [i for i, d in enumerate(deferred) if not d] + [i for i, d in enumerate(deferred) if d]
    unbounded = _place(leaf_nbytes, deferred, order, chunk_bytes, pool=None)
    if budget is None or budget >= unbounded.pack_bytes:
        return dataclasses.replace(unbounded, pool_bytes=unbounded.pack_bytes)
    pool = max(2 * POOL_ALIGN, budget // POOL_ALIGN * POOL_ALIGN)
    # a chunk plus one partly written page must fit, or the writer could not free room for it
    return _place(leaf_nbytes, deferred, order, min(chunk_bytes, pool - POOL_ALIGN), pool=pool)


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
