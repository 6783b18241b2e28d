"""The pack plan of a save and each leaf's region, cached while the state's shape does not change (orchestration).

Glue between a flattened state and the pure planners (plan/pack.py, plan/assign.py): the sizes,
which leaves are copied eagerly, which ranks hold each DTensor shard (as ranks of the process
group), and the coordinator's local tiers decide who writes what.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpointing.dist.types import Coordinator
from checkpointing.plan.assign import UNIQUE, LeafInfo, assign_regions
from checkpointing.plan.pack import PackPlan, plan_pack
from checkpointing.state.tree import FlatState

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class PackPlanner:
    """Plans for one manager: `group` is its process group (None: one rank), `coord` tells this
    rank's local tier and its peers', `budget` bounds the staging pool (None: a full copy)."""

    def __init__(self, coord: Coordinator, group: ProcessGroup | None, *, chunk_bytes: int, budget: int | None) -> None:
        self._coord, self._group = coord, group
        self._chunk_bytes, self._budget = chunk_bytes, budget
        self._cache: tuple[tuple, tuple[PackPlan, list[int]]] | None = None

    def plan_for(self, flat: FlatState) -> tuple[PackPlan, list[int]]:
        """The pack plan and each leaf's region; cached while the state's shape does not change."""
        sizes = [leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flat.leaves]
        deferred = [leaf.deferred for leaf in flat.leaves]
        holders = [None if leaf.layout is None else self._group_ranks(leaf.layout.replicas) for leaf in flat.leaves]
        keys = [leaf.key for leaf in flat.leaves]
        coord = self._coord
        cache_key = (tuple(sizes), tuple(deferred), tuple(keys), tuple(holders), coord.per_rank_keys)
        if self._cache is None or self._cache[0] != cache_key:
            budget = self._budget
            if budget is not None and budget < sum(sizes):
                regions = [UNIQUE] * len(sizes)  # a ring streams the pack in order: each rank writes all it holds
            else:
                infos = [LeafInfo(k, n, h) for k, n, h in zip(keys, sizes, holders)]
                regions = assign_regions(infos, rank=coord.rank, tiers=coord.tiers, per_rank_keys=coord.per_rank_keys)
            plan = plan_pack(sizes, deferred, chunk_bytes=self._chunk_bytes, budget=budget, regions=regions)
            self._cache = (cache_key, (plan, regions))
        return self._cache[1]

    def _group_ranks(self, global_ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Ranks of the process group for the global ranks a DTensor mesh names."""
        if self._group is None:
            return (0,) if global_ranks else ()
        import torch.distributed as dist

        return tuple(sorted(dist.get_group_rank(self._group, r) for r in global_ranks))
