"""Peer copies as the manager holds them: start-up, and the calls of save, wait, delete, restore and tiers (layer: peer).

`open_peers` (a collective call of the manager's constructor, after the writer lock) returns
`NoPeers` when peer_copies is 0 (nothing changes: no thread, no socket, no key in the store), else
`Peers`:

1. Placement (plan/peers.py): nodes are the local tiers, named by their leader ranks; too few of
   them is a CheckpointConfigError on every rank before anything starts.
2. Each leader tidies the replicas it holds (copies that did not commit), starts its replica server
   on the address it reaches the store from, and publishes it; rank 0 publishes the job's secret
   first. Every rank reads every leader's address.
3. The copy thread (copies.py) starts on every rank.

A read-only manager holds a `Peers` without server, thread or store traffic: its restore reads the
replicas on its own disk as they are, and nothing is copied or fetched.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Callable, Collection, Mapping, Protocol

from checkpointing.dist import keys
from checkpointing.dist.store import store_host, wait_keys
from checkpointing.dist.types import Coordinator, Store
from checkpointing.errors import CheckpointError
from checkpointing.format.manifest import CommittedStep
from checkpointing.options import ManagerOptions
from checkpointing.peer.copies import Copier, Node
from checkpointing.peer.recovery import Recovery
from checkpointing.peer.replica import ReplicaArea
from checkpointing.peer.server import ReplicaServer, listed
from checkpointing.peer.types import PeerJob
from checkpointing.plan.peers import check_nodes, hosted_by, place
from checkpointing.storage import LocalStorage, Storage
from checkpointing.storage.transfers import Throttle

log = logging.getLogger("checkpointing")


class Numbered(Protocol):
    """A save as wait_previous needs it: its number among the manager's saves (save/job.SaveJob)."""

    @property
    def seq(self) -> int: ...


class NoPeers:
    """peer_copies=0: every call is a no-op, so the manager behaves exactly as without this room."""

    def held(self) -> set[int]:
        return set()

    def committed(self, seq: int, step: int, committed: CommittedStep | None) -> None:
        return None

    def track(self, seq: int, step: int) -> None:
        return None

    def wait_previous(self, newest: "Numbered | None") -> None:
        return None

    def wait(self, timeout: float | None = None) -> None:
        return None

    def settle(self) -> None:
        return None

    def delete(self, step: int) -> None:
        return None

    def before_restore(self, step: int | None = None, remote: Collection[int] = ()) -> dict[str, Storage]:
        return {}

    def on_disk(self, local: list[int]) -> list[int]:
        return local

    def tier_states(self, states: dict[int, str]) -> dict[int, str]:
        return states

    def close(self) -> None:
        return None


def open_peers(options: ManagerOptions, local: LocalStorage, coord: Coordinator, *, release: Callable[[], None]) -> "NoPeers | Peers":
    """The manager's peer copies (see the module docstring). On a failure every rank has in common (too
    few nodes) it closes the coordinator and calls `release` (the writer lock) before raising, as
    start_writing does."""
    if options.peer_copies == 0:
        return NoPeers()
    leaders = sorted({min(r for r in range(coord.world_size) if coord.tiers[r] == t) for t in coord.tiers})
    if not options.read_only:
        try:
            check_nodes(leaders, options.peer_copies, where=f" ({_layout(coord)})")
        except CheckpointError:
            coord.close()
            release()
            raise
    return Peers(options, local, coord, leaders)


def _layout(coord: Coordinator) -> str:
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(coord.tiers):
        groups.setdefault(t, []).append(r)
    return "; ".join(f"ranks {rs} share tier {t}" for t, rs in groups.items())


class Peers:
    """peer_copies >= 1 (see the module docstring)."""

    def __init__(self, options: ManagerOptions, local: LocalStorage, coord: Coordinator, leaders: list[int]) -> None:
        self._options, self._local, self._coord = options, local, coord
        self._deletes = 0  # delete() calls so far: each one's barrier has a name of its own
        tier = coord.tiers[coord.rank]
        layout = {leader: [r for r in range(coord.world_size) if coord.tiers[r] == coord.tiers[leader]] for leader in leaders}
        ranks = [r for r in range(coord.world_size) if coord.tiers[r] == tier]
        placement = place(leaders, options.peer_copies) if len(leaders) > options.peer_copies else {l: () for l in leaders}
        self._sources = {coord.tiers[s] for s in hosted_by(placement).get(ranks[0], ())}
        self.area = ReplicaArea(local, read_only=options.read_only)
        self._server: ReplicaServer | None = None
        self._copier: Copier | None = None
        self._recovery: Recovery | None = None
        self.node = Node(rank=coord.rank, world_size=coord.world_size, leader=ranks[0], layout=layout, tier=tier, addresses={}, peer_ranks=placement.get(ranks[0], ()), secret="", timeout_s=options.timeout_s, where=str(local.root))
        if options.read_only:
            return
        store = coord.new_store_client()
        assert store is not None  # several nodes: several ranks
        self._start(store)
        pace = Throttle(options.peer_bandwidth) if options.peer_bandwidth else _unpaced
        self._copier = Copier(self.node, coord.new_store_client() or store, local, pace=pace)
        self._recovery = Recovery(self.node, store, self.area, local)

    def _start(self, store: Store) -> None:
        """Tidy and serve (leaders), exchange addresses and the secret (every rank)."""
        node, timeout_s = self.node, self._options.timeout_s
        if node.rank == 0:
            store.set(keys.PEER_SECRET, secrets.token_hex(16))
        wait_keys(store, [keys.PEER_SECRET], time.monotonic() + timeout_s, "start-up: waiting for rank 0's peer secret",
                  timeout_s=timeout_s, keys_rank=lambda k: 0)
        node.secret = store.get(keys.PEER_SECRET).decode("ascii")
        if node.is_leader:
            self.area.tidy()
            self._server = ReplicaServer(self.area, host=store_host(), rank=node.rank, secret=node.secret, timeout_s=timeout_s,
                                         accepts=self._sources.__contains__, after_commit=self._after_commit)
            host, port = self._server.address
            store.set(keys.peer_addr(node.rank), f"{host}:{port}")
        waited = [keys.peer_addr(leader) for leader in node.leaders]
        wait_keys(store, waited, time.monotonic() + timeout_s, "start-up: waiting for every node's replica server", timeout_s=timeout_s)
        for leader, raw in zip(node.leaders, store.multi_get(waited)):
            host, _, port = raw.decode("ascii").rpartition(":")
            node.addresses[leader] = (host, int(port))

    def _after_commit(self, tier: str, step: int) -> None:
        """A source's step committed here: its keep_local on the replica, then drop replicas of nodes
        this node holds no copies for any more (older than this step)."""
        try:
            self.area.retain(tier, self._options.local_retention, step)
            self.area.drop_stale(self._sources, newer_than=step, policy=self._options.local_retention)
        except Exception as exc:  # noqa: BLE001 - retried after the next copy; never stop serving
            log.warning("checkpointing: retention of the peer copy of tier %s after step %d failed: %s", tier, step, exc)

    # ------------------------------------------------------------ the save path

    def held(self) -> set[int]:
        return self._copier.held() if self._copier is not None else set()

    def committed(self, seq: int, step: int, committed: CommittedStep | None) -> None:
        if self._copier is not None:
            self._copier.committed(seq, step, committed)

    def track(self, seq: int, step: int) -> PeerJob | None:
        return self._copier.track(seq, step) if self._copier is not None else None

    def wait_previous(self, newest: "Numbered | None") -> None:
        """Before a save: the copies of every save before `newest` (the newest one issued) are done; their errors raised."""
        if self._copier is not None and newest is not None:
            self._copier.wait_previous(newest.seq)

    def wait(self, timeout: float | None = None) -> None:
        if self._copier is not None:
            self._copier.wait(timeout)

    def settle(self) -> None:
        if self._copier is not None:
            self._copier.settle()

    def delete(self, step: int) -> None:
        """mgr.delete(step), after the tiers' part: the step off the replicas this node holds (its leader),
        then a barrier, so that when delete() returns no node lists a copy of the step any more."""
        n, self._deletes = self._deletes, self._deletes + 1
        error = None
        try:
            if self.node.is_leader and not self._options.read_only:
                for url in self.area.delete_step(step):
                    log.info("checkpointing: rank %d: deleted step %d from the peer copy %s", self.node.rank, step, url)
        except (CheckpointError, OSError) as exc:
            error = f"rank {self.node.rank}: could not delete step {step} from the peer copies it holds: {exc}"
        self._coord.barrier(f"peer-delete-{n}", error)

    # ------------------------------------------------------------ restore and listing

    def before_restore(self, step: int | None = None, remote: Collection[int] = ()) -> dict[str, Storage]:
        """Fetch back what this node lost of the step to restore (collective: `step`, else the newest every
        node can read; `remote`: the steps on the remote tier), then every replica on this node's disk,
        by source tier."""
        if self._copier is not None:
            self._copier.settle()  # no copy of an earlier save still lands on a node while it fetches (and drops stale replicas)
        if self._recovery is not None:
            self._recovery.fetch_back(step, set(remote))
        return dict(self.area.storages())

    def on_disk(self, local: list[int]) -> list[int]:
        """The steps committed on the local tier (`local`) and those this node's ranks can restore from a
        copy of their own former tier on this node's disk (fetched back after the node was replaced)."""
        node = self.node
        own = [t for t in self.area.tiers() if t != node.tier and self.area.source(t) == (tuple(node.ranks), node.world_size)]
        return sorted(set(local).union(*(self.area.committed(t) for t in own)))

    def tier_states(self, states: dict[int, str]) -> dict[int, str]:
        """mgr.tiers() with "+peer" on the steps every peer of this node holds a committed copy of."""
        node = self.node
        if not node.addresses or not node.peer_ranks:
            return states
        held: set[int] | None = None
        for peer in node.peer_ranks:
            try:
                steps = set(listed(node.addresses[peer], node.who(peer), secret=node.secret, timeout_s=min(node.timeout_s, 10.0),
                                   rank=node.rank, tier=node.tier))
            except (CheckpointError, OSError) as exc:
                log.warning("checkpointing: cannot ask %s which copies it holds (%s); not showing them", node.who(peer), exc)
                steps = set()
            held = steps if held is None else held & steps
        return with_peer(states, held or set())

    def close(self) -> None:
        """After wait(): every node's copies of this manager's saves are done, so the server may go."""
        if self._copier is not None:
            self._copier.close()
        if self._server is not None:
            self._server.close()


def with_peer(states: Mapping[int, str], peer: set[int]) -> dict[int, str]:
    """'local' -> 'local+peer', 'local+remote' -> 'local+peer+remote', 'remote' -> 'peer+remote', and
    'peer' for a step only the peers hold."""
    out = {}
    for step in sorted(set(states) | peer):
        parts = states.get(step, "").split("+") if step in states else []
        if step in peer:
            parts = [p for p in ("local", "peer", "remote") if p in parts or p == "peer"]
        out[step] = "+".join(parts)
    return out


def _unpaced(nbytes: int) -> None:
    return None
