"""Which rank writes a tensor that several ranks hold (pure).

Every rank runs the same function on the same facts and so reaches the same answer without
talking to the others:

- a tensor only this rank holds (a DTensor shard without replicas, or a plain tensor known to
  differ between ranks) is UNIQUE: this rank writes it;
- a replicated tensor (a DTensor shard with replicas, or a plain tensor every rank may hold) is
  written once for everyone by its PRIMARY writer, chosen among its holders to balance bytes, and
  once more on each other local tier by a TIER writer there (a local tier must restore its ranks
  alone);
- every other holder files it as OTHER: it skips it when a peer on its tier wrote the same bytes
  (checked by digest after staging), and writes it itself otherwise.

Plain tensors are assigned first and in one global order, so ranks agree on them even where their
DTensor shards differ; shards are then assigned in an order their holders share.
"""

from __future__ import annotations

import dataclasses

UNIQUE, PRIMARY, TIER, OTHER = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    key: str
    nbytes: int
    holders: tuple[int, ...] | None  # ranks holding the same shard; None: a plain tensor (any rank may)


def assign_regions(leaves: list[LeafInfo], *, rank: int, tiers: tuple[str, ...], per_rank_keys: frozenset[str] = frozenset()) -> list[int]:
    """The region of each leaf for `rank`; `tiers[r]` names rank r's local tier."""
    world = len(tiers)
    regions = [UNIQUE] * len(leaves)
    if world == 1:
        return regions
    every = tuple(range(world))
    plain = [i for i, leaf in enumerate(leaves) if leaf.holders is None and leaf.key not in per_rank_keys]
    sharded = [i for i, leaf in enumerate(leaves) if leaf.holders is not None and len(leaf.holders) > 1]
    load = [0] * world  # primary bytes so far: the same numbers on every rank
    tier_load = [0] * world  # all bytes so far: the same numbers on every rank of this tier
    for group in (plain, sharded):
        for i in sorted(group, key=lambda i: (-leaves[i].nbytes, leaves[i].key)):
            holders = leaves[i].holders or every
            primary = min(holders, key=lambda r: (load[r], r))
            load[primary] += leaves[i].nbytes
            tier_load[primary] += leaves[i].nbytes
            writer = primary
            if tiers[primary] != tiers[rank]:
                writer = min((r for r in holders if tiers[r] == tiers[rank]), key=lambda r: (tier_load[r], r))
                tier_load[writer] += leaves[i].nbytes
            regions[i] = PRIMARY if rank == primary else TIER if rank == writer else OTHER
    return regions
