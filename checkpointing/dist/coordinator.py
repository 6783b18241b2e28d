"""The coordinator of a world of one rank: the same merge and commit as across ranks, no store (I/O).

A manager holds one `Coordinator` (types.py): this `LocalCoordinator` without a process group, a
`StoreCoordinator` (store_coordinator.py) with one. Both merge the ranks' reports the same way
(format/rank_reports.py) and commit with the same writes (tier/catalog.py: manifest, then COMMIT).
"""

from __future__ import annotations

from checkpointing.dist.remote_commit import LocalTierCommitter
from checkpointing.dist.restore_agreement import RestoreView, agreed_step
from checkpointing.dist.types import Committed, SaveRef, TierCommitter, Written
from checkpointing.errors import CheckpointError, MergeError
from checkpointing.format.manifest import encode_manifest
from checkpointing.format.rank_reports import RankPart, merge_parts
from checkpointing.storage import LocalStorage, Storage
from checkpointing.tier import catalog
from checkpointing.tier.tierfile import ensure_tier_id


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

    def commit(self, save: SaveRef, part: RankPart) -> Committed:
        try:
            manifest, _ = merge_parts(save.step, [part], self.tiers)
        except MergeError as exc:
            raise CheckpointError(f"step {save.step} cannot be committed: {exc}") from None
        return Committed(manifest, catalog.commit_bytes(self.storage, save.step, encode_manifest(manifest), save.token))

    def barrier(self, name: str, error: str | None = None) -> None:
        if error is not None:
            raise CheckpointError(error)

    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        return agreed_step([RestoreView(readable, note, error)], requested)

    def agree_resume(self, mine: list[int]) -> list[int]:
        return sorted(mine)

    def remote_committer(self, local: Storage, remote: Storage) -> TierCommitter:
        return LocalTierCommitter(local, remote)

    def new_store_client(self) -> None:
        return None

    def close(self) -> None:
        pass
