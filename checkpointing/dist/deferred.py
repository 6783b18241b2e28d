"""A read-only manager's coordinator over several ranks: it joins the other ranks at its first collective call.

A writing manager's ranks meet when it opens (store_coordinator.py: every rank publishes its tier's
id). A read-only manager only lists, restores and loads, and listing needs nobody else: so one rank of a
job may open one to look at the steps (`latest_step()`, `steps()`, `tiers()`, `stats()`) and close it
again, alone. Only restore() meets the other ranks (which step every rank can read, and where each reads
from), and only then is the store's key space opened, with the next number of the read-only managers'
own sequence (keys.new_namespace): a manager that never met the others takes no number, so the ranks'
later managers, writing or read-only, still match up. A restore() that some rank never calls ends at
`timeout_s` with an error that says so and how to read on one rank alone, and gives its number back
(a later meeting uses it, and finds this rank's tier key there already, which is the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointing.dist.keys import give_back_namespace, new_namespace
from checkpointing.dist.store_coordinator import StoreCoordinator
from checkpointing.dist.types import SaveRef, Store, TierCommitter, Written
from checkpointing.errors import CheckpointConfigError
from checkpointing.format.manifest import CommittedStep
from checkpointing.format.rank_reports import RankPart
from checkpointing.storage import LocalStorage, Storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

JOINING = ("a read-only CheckpointManager meeting the other ranks (at its first restore(), a collective call with several ranks: "
           "every rank of its process group calls it; to read on this rank alone, use checkpointing.load(path, step=...))")


class DeferredCoordinator:
    """Several ranks, read-only: rank and world now, the store coordinator at the first call that needs it."""

    leader = False  # it commits nowhere
    per_rank_keys: frozenset[str] = frozenset()

    def __init__(self, storage: LocalStorage, group: ProcessGroup, *, timeout_s: float) -> None:
        import torch.distributed as dist

        self._storage, self._group, self._timeout_s = storage, group, timeout_s
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self._joined: StoreCoordinator | None = None

    def _coord(self) -> StoreCoordinator:
        if self._joined is None:
            sequence = str(getattr(self._group, "group_name", "") or "world") + "/read_only"
            namespace = new_namespace(sequence)
            try:
                self._joined = StoreCoordinator(self._storage, self._group, timeout_s=self._timeout_s, namespace=namespace, joining=JOINING)
            except BaseException:
                give_back_namespace(sequence, namespace)  # never met: the next meeting (this one's again, or another's) takes it
                raise
        return self._joined

    @property
    def tiers(self) -> tuple[str, ...]:
        return self._coord().tiers

    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        return self._coord().agree_restore(readable, note, requested, error)

    def gather(self, name: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        return self._coord().gather(name, value)

    def barrier(self, name: str, error: str | None = None) -> None:
        self._coord().barrier(name, error)

    def errors_at(self, name: str, error: str | None = None) -> dict[int, str]:
        return self._coord().errors_at(name, error)

    def new_store_client(self) -> Store | None:
        return self._coord().new_store_client()

    def close(self) -> None:
        if self._joined is not None:  # the ranks that met leave together; one that never met has no one to wait for
            self._joined.close()

    # a read-only manager writes nothing: these are never reached (manager.py refuses save() and delete() first)
    def share_written(self, save: SaveRef, written: list[Written]) -> None:
        raise _writes()

    def peer_written(self, save: SaveRef) -> set[Written]:
        raise _writes()

    def fail(self, save: SaveRef, error: BaseException) -> None:
        raise _writes()

    def commit(self, save: SaveRef, part: RankPart) -> CommittedStep:
        raise _writes()

    def remote_committer(self, local: Storage, remote: Storage) -> TierCommitter:
        raise _writes()


def _writes() -> CheckpointConfigError:
    return CheckpointConfigError("this CheckpointManager was opened read_only=True: it writes nothing; open it without read_only to save")
