"""The coordinator of a world of one rank: the same merge and commit as across ranks, no store (I/O).

A manager holds one `Coordinator` (types.py): this `LocalCoordinator` without a process group, a
`StoreCoordinator` (store_coordinator.py) with one; `resolve_group` and `open_coordinator` choose.
Both merge the ranks' reports the same way (format/rank_reports.py) and commit with the same writes
(tier/catalog.py: manifest, then COMMIT).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointing.dist.deferred import DeferredCoordinator
from checkpointing.dist.remote_commit import LocalTierCommitter
from checkpointing.dist.restore_agreement import RestoreView, agreed_step
from checkpointing.dist.keys import new_namespace
from checkpointing.dist.store_coordinator import StoreCoordinator
from checkpointing.dist.types import Coordinator, SaveRef, TierCommitter, Written
from checkpointing.errors import CheckpointConfigError, CheckpointError, MergeError
from checkpointing.format.gcpause import gc_paused
from checkpointing.format.manifest import CommittedStep
from checkpointing.format.rank_reports import RankPart, merge_parts
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog
from checkpointing.tier.identity import ensure_tier_id

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def resolve_group(process_group: Any) -> ProcessGroup | None:
    """The process group to coordinate over (default: WORLD when torch.distributed is initialised),
    or None for a single rank."""
    import torch.distributed as dist

    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    try:
        world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointConfigError(f"process_group={process_group!r} is not usable: {exc}") from exc
    if rank < 0:
        raise CheckpointConfigError("this process is not a member of process_group: create the manager on its ranks only")
    return None if world == 1 else process_group


def open_coordinator(storage: LocalStorage, group: ProcessGroup | None, *, timeout_s: float, read_only: bool = False) -> Coordinator:
    """A manager's coordinator: one rank's without a group, else one over the store (a collective call;
    a read-only manager's meets the other ranks at its first restore: deferred.py)."""
    if group is None:
        return LocalCoordinator(storage)
    if read_only:
        return DeferredCoordinator(storage, group, timeout_s=timeout_s)
    namespace = new_namespace(str(getattr(group, "group_name", "") or "world"))
    return StoreCoordinator(storage, group, timeout_s=timeout_s, namespace=namespace)


class LocalCoordinator:
    """One rank: commit straight to the local tier; nothing to share, wait for or agree on."""

    rank = 0
    world_size = 1
    leader = True

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.tiers = (ensure_tier_id(storage),)
        self.per_rank_keys: frozenset[str] = frozenset()

    def share_written(self, save: SaveRef, written: list[Written]) -> None:
        pass

    def peer_written(self, save: SaveRef) -> set[Written]:
        return set()

    def fail(self, save: SaveRef, error: BaseException) -> None:
        pass

    def commit(self, save: SaveRef, part: RankPart) -> CommittedStep:
        try:
            with gc_paused():  # encoded and decoded: a burst of objects (gcpause.py)
                manifest, data, _ = merge_parts(save.step, [part], self.tiers, save.metrics)
        except MergeError as exc:
            raise CheckpointError(f"step {save.step} cannot be committed: {exc}") from None
        return CommittedStep.of(manifest, catalog.commit_bytes(self.storage, save.step, data, save.token, manifest))

    def barrier(self, name: str, error: str | None = None) -> None:
        if error is not None:
            raise CheckpointError(error)

    def errors_at(self, name: str, error: str | None = None) -> dict[int, str]:
        return {} if error is None else {0: error}

    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        return agreed_step([RestoreView(readable, note, error)], requested)

    def gather(self, name: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        return [value]

    def remote_committer(self, local: Storage, remote: Storage) -> TierCommitter:
        return LocalTierCommitter(local, remote)

    def new_store_client(self) -> None:
        return None

    def close(self) -> None:
        pass
