"""Before a restore: each node fetches back, from its peers, the steps its ranks saved that its disk lost (layer: peer).

A collective step of restore() (every rank, in the same order), before the ranks choose a step:

1. Every node's leader publishes what it holds (`peer/restore/<n>/<rank>`: each replica's source
   tier, the ranks that wrote it, their world size, its committed steps) and reads the others'.
2. From those, every leader works out the step the ranks will restore (the requested one, else the
   newest every node can read: plan/peers.fetch_plan). A leader whose disk does not hold it (a
   replaced machine: an empty local directory and a new TIER id; or a lost step directory), and a
   peer holds a replica its ranks wrote of it, fetches that replica back into its own peer area
   (server.pull: the copy is verified chunk by chunk and committed there, like a save's copy), from
   the first holder that answers (should every copy arrive damaged, the next older step every node
   can read, and so on); then it publishes `peer/fetched/<n>/<rank>`, bumping a beat while it works.
3. The other ranks of its node wait for that (a silent leader is waited for timeout_s).

Then every rank reads from its local tier, the replicas on its node's disk, or the remote tier
(restore/step_choice.py). A failed fetch is a warning: that step is then read from the remote tier
or skipped. Nothing is fetched when nothing was lost (one round through the store).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

from checkpointing.dist import keys
from checkpointing.dist.store import wait_keys
from checkpointing.dist.types import Store
from checkpointing.errors import CheckpointError, rank_ranges
from checkpointing.peer.copies import Node
from checkpointing.peer.liveness import beating, wait_alive
from checkpointing.peer.replica import ReplicaArea
from checkpointing.peer.server import pull
from checkpointing.plan.peers import Fetch, Hosted, fetch_plan
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")


class Recovery:
    """restore()'s peer step for one manager (training thread only; `store` is its own connection)."""

    def __init__(self, node: Node, store: Store, area: ReplicaArea, local: LocalStorage) -> None:
        self.node, self._store, self._area, self._local = node, store, area, local
        self._calls = 0  # the same on every rank: names this restore's keys

    def fetch_back(self, requested: int | None, remote: set[int]) -> None:
        node = self.node
        n, self._calls = self._calls, self._calls + 1
        if node.is_leader:
            local = set(catalog.list_steps(self._local).committed)
            hosted, steps = self._inventories(n, local)
            elsewhere = set().union(*(s for leader, s in steps.items() if leader != node.rank))
            plan = fetch_plan(node.rank, node.layout, node.world_size, local=steps, hosted=hosted, remote=remote, requested=requested)
            worker = threading.Thread(target=self._fetch_all, args=(plan,), name="ckpt-peer-fetch", daemon=True)
            beating(self._store, keys.peer_fetch_beat(n, node.rank), [worker])
            self._store.set(keys.peer_fetched(n, node.rank), b"1")
            on_peers = {s for h in hosted if (h.ranks, h.world_size) == (tuple(node.ranks), node.world_size) for s in h.steps}
            self._report_lost(elsewhere - local - on_peers)  # a step a peer holds is not lost: restore(step=k) fetches it
            return
        silent = wait_alive(self._store, {node.leader: keys.peer_fetched(n, node.leader)}, lambda r: keys.peer_fetch_beat(n, r),
                            node.timeout_s)
        if silent:
            log.warning("checkpointing: rank %d: %s (its node's leader) did not finish fetching peer copies back within timeout_s; "
                        "restoring from what its disk holds", node.rank, rank_ranges(silent))

    def _inventories(self, n: int, local: set[int]) -> tuple[list[Hosted], dict[int, set[int]]]:
        """Publish what this node holds (replicas, and the steps committed on its local tier); read what
        every node holds: the replicas, and the steps committed on each node's local tier (by leader)."""
        node = self.node
        mine = {"hosted": [dataclasses.asdict(h) for h in self._area.inventory(node.rank)], "local": sorted(local)}
        self._store.set(keys.peer_restore(n, node.rank), json.dumps(mine))
        waited = [keys.peer_restore(n, leader) for leader in node.leaders]
        wait_keys(self._store, waited, time.monotonic() + node.timeout_s, "restore: waiting for every node's list of peer copies",
                  timeout_s=node.timeout_s)
        hosted, steps = [], {}
        for leader, raw in zip(node.leaders, self._store.multi_get(waited)):
            got = json.loads(raw)
            steps[leader] = {int(s) for s in got["local"]}
            for h in got["hosted"]:
                hosted.append(Hosted(int(h["host"]), str(h["tier"]), tuple(h["ranks"]), int(h["world_size"]), tuple(h["steps"])))
        return hosted, steps

    def _report_lost(self, candidates: set[int]) -> None:
        """Steps other nodes hold whose data of this node's ranks survives nowhere on a disk: say so once."""
        node = self.node
        mine = [t for t in self._area.tiers() if self._area.source(t) == (tuple(node.ranks), node.world_size)]
        held = set().union(*(set(self._area.committed(t)) for t in mine))
        lost = sorted(candidates - held)
        if lost:
            log.warning("checkpointing: rank %d: step%s %s %s committed on other nodes, but what %s saved of %s is on no disk that "
                        "survived (this node's local tier lost it and no peer holds a committed copy): only a remote tier that holds it "
                        "can restore it", node.rank, "s" if len(lost) > 1 else "", ", ".join(map(str, lost)),
                        "are" if len(lost) > 1 else "is", rank_ranges(node.ranks), "them" if len(lost) > 1 else "it")

    def _fetch_all(self, plan: list[Fetch]) -> None:
        """The first step of the plan that arrives whole (plan/peers.fetch_plan: the step to restore, then older ones)."""
        for fetch in plan:
            try:
                if self._fetch(fetch):
                    return
            except Exception as exc:  # noqa: BLE001 - a fetch is an optimisation: restore goes on without it
                log.warning("checkpointing: rank %d: fetching step %d back failed: %s: %s", self.node.rank, fetch.step,
                            type(exc).__name__, exc)

    def _fetch(self, fetch: Fetch) -> bool:
        node = self.node
        for host in fetch.hosts:
            if host not in node.addresses:
                continue
            t0 = time.perf_counter()
            try:
                got, reused = pull(node.addresses[host], node.who(host), secret=node.secret, timeout_s=node.timeout_s, rank=node.rank,
                                   area=self._area, tier=fetch.tier, step=fetch.step)
            except (CheckpointError, OSError) as exc:
                log.warning("checkpointing: rank %d could not fetch step %d of its node's former tier %s from %s: %s",
                            node.rank, fetch.step, fetch.tier, node.who(host), exc)
                continue
            log.info("checkpointing: rank %d fetched back step %d (its node's former tier %s) from the peer copy on %s: "
                     "%.1f MB received (%.1f MB held already) in %.2f s, into %s", node.rank, fetch.step, fetch.tier, node.who(host),
                     got / 1e6, reused / 1e6, time.perf_counter() - t0, self._area.storage(fetch.tier).url)
            return True
        log.warning("checkpointing: rank %d: no peer could send back step %d of its node's former tier %s: that step is read from "
                    "the remote tier if it holds it, else skipped (an older step is fetched instead, if a peer holds one)",
                    node.rank, fetch.step, fetch.tier)
        return False
