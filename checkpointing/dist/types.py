"""What crosses into and out of the cross-rank room: the values and the Protocols (layer: dist).

The save and restore paths above this layer hand the coordinator a `SaveRef` (which save a call is
about) and get values back (a `CommittedStep`, `Written` identities, a step number); they never hand it
their job objects, and it never sets anything on them. `Coordinator` is what a manager's
coordinator offers (one rank: `LocalCoordinator`, coordinator.py; several: `StoreCoordinator`,
store_coordinator.py); `TierCommitter` is the remote tier's commit (remote_commit.py); `Store` is
the part of a torch.distributed store (a PrefixStore over the job's TCPStore) this package uses.

Call order for one save, on the ckpt-io thread of every rank (the same `seq` everywhere):
`share_written` once this rank knows what it writes -> `peer_written` (only when it may skip bytes
its local-tier peers write) -> `commit` with its part; or, at any point of its part failing,
`fail`. Collective calls on the training thread (every rank, the same order): `barrier`,
`agree_restore`, `gather`, `close`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

from checkpointing.format.manifest import CommittedStep, Metrics
from checkpointing.format.rank_reports import RankPart
from checkpointing.storage import Storage


@dataclasses.dataclass(frozen=True)
class SaveRef:
    """Which save a coordinator call is about: its step, its number among the manager's saves
    (`seq`, the same on every rank: it names the save's keys in the store) and its token (the
    manifest's file name on disk); with the metrics save() was given, which the merging rank
    (rank 0) records in the manifest: rank 0's are the step's."""

    step: int
    seq: int
    token: str
    metrics: Metrics = dataclasses.field(default_factory=dict, hash=False, compare=False)


class Written(NamedTuple):
    """The identity of one replicated tensor (or shard) a rank writes: equal identities on two ranks
    of one local tier mean equal bytes, so only one of them needs to store it."""

    key: str
    offsets: tuple[int, ...] | None
    digest: str


class Store(Protocol):
    """The torch.distributed store methods this package calls (c10d Store / PrefixStore)."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...

    def delete_key(self, key: str) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


class TierCommitter(Protocol):
    """Commits an uploaded step on the remote tier, with one rank or across ranks (remote_commit.py).

    Every rank calls `commit` once per upload, in the same order (`seq`), with its own upload's
    error (None when its files are up): it returns once the step is committed there on behalf of
    every rank, or raises why not (UploadRanksFailed names the failing ranks).
    """

    def commit(self, seq: int, committed: CommittedStep, error: BaseException | None, transfer_s: float) -> None: ...

    def close(self) -> None: ...


class StoreRoom(Protocol):
    """What a store-backed helper (the remote committer) takes from its StoreCoordinator."""

    rank: int
    world_size: int
    timeout_s: float

    def new_store_client(self) -> Store: ...


class Exchange(Protocol):
    """How a rank learns which replicated tensors its local-tier peers write (the save writer's view)."""

    def share_written(self, save: SaveRef, written: list[Written]) -> None: ...

    def peer_written(self, save: SaveRef) -> set[Written]: ...


class Coordinator(Exchange, Protocol):
    """A manager's coordinator: who this rank is among the others, and the calls that need them all.

    `tiers[r]` is rank r's local tier id; `leader`: this rank commits on its local tier (the lowest
    rank of the tier); `per_rank_keys`: the plain-tensor keys whose values differed between ranks at
    the last commit (each rank keeps its own copy of those).
    """

    rank: int
    world_size: int
    leader: bool
    tiers: tuple[str, ...]
    per_rank_keys: frozenset[str]

    def fail(self, save: SaveRef, error: BaseException) -> None:
        """This rank's part of `save` failed: tell the other ranks, then (several ranks) wait for rank
        0's verdict, which raises RanksFailedError naming every failing rank."""
        ...

    def commit(self, save: SaveRef, part: RankPart) -> CommittedStep:
        """Report this rank's part; the parts are merged and the step committed on every local tier.
        Raises if any rank failed (RanksFailedError) or did not answer (CoordinationTimeout)."""
        ...

    def barrier(self, name: str, error: str | None = None) -> None:
        """Wait for every rank; `error` (this rank cannot go on): every rank raises CheckpointError naming it."""
        ...

    def errors_at(self, name: str, error: str | None = None) -> dict[int, str]:
        """Wait for every rank; every rank's `error` at this point (rank -> message; empty: none had one)."""
        ...

    def agree_restore(self, readable: list[int], note: str, requested: int | None, error: str | None = None) -> int | None:
        """The newest step every rank can read (or check `requested`); the error names who cannot."""
        ...

    def gather(self, name: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `value` (JSON), indexed by rank; `name` is unique to this call on every rank
        ("resume": the interrupted uploads each rank can resume, plan/resume.py)."""
        ...

    def remote_committer(self, local: Storage, remote: Storage) -> TierCommitter:
        """The remote tier's committer for this world (it has a store connection of its own)."""
        ...

    def new_store_client(self) -> Store | None:
        """Another connection to this manager's key space (for another thread); None with one rank."""
        ...

    def close(self) -> None: ...
