"""Each save's peer copies: the "ckpt-peer" thread of every rank, and what the training thread waits for (layer: peer).

Per save, in save order (the same `seq` on every rank), once the step is committed locally:

1. A node's leader pushes the step to each of its peers at once (server.push: only the files a
   peer lacks), paced by one Throttle for all of them (peer_bandwidth), bumping
   `peer/<seq>/beat/<rank>` while it works; then it publishes `peer/<seq>/<rank>`: ok, or one line
   per failed peer naming the peer's rank and host and why.
2. Every rank (leaders too) waits for every leader's outcome; a leader whose beat stops for
   timeout_s is named as silent. The save's PeerJob is then done: committed on every node's peers,
   or a CheckpointPeerError naming each failure. So every rank raises the same error at the same
   call (handle.wait(), wait(), or the next save() that waits for that job).

A save that failed has no copies (its job is done at once: the error is the save's). The training
thread waits here before each save for every copy but the newest (at most one step copies while the
next one is written), in wait() for all of them; the local retention keeps a step while it copies.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any, Callable

from checkpointing.dist import keys
from checkpointing.dist.store import delete_keys
from checkpointing.dist.types import Store
from checkpointing.errors import CheckpointTimeoutError, rank_ranges
from checkpointing.format.manifest import CommittedStep
from checkpointing.peer.liveness import beating, wait_alive
from checkpointing.peer.server import Address, push
from checkpointing.peer.types import CheckpointPeerError, CopyResult, PeerJob
from checkpointing.storage import LocalStorage

log = logging.getLogger("checkpointing")


class Node:
    """Who this rank is among the nodes: its node's leader, every node's ranks by leader (`layout`),
    every leader's replica server (`addresses`), the peers its node copies to (`peer_ranks`, leader
    ranks), the job's secret, and the timeout. `where` names the node's local tier in messages."""

    def __init__(self, *, rank: int, world_size: int, leader: int, layout: dict[int, list[int]], tier: str,
                 addresses: dict[int, Address], peer_ranks: tuple[int, ...], secret: str, timeout_s: float, where: str) -> None:
        self.rank, self.world_size, self.leader, self.layout, self.tier = rank, world_size, leader, layout, tier
        self.ranks, self.leaders = layout[leader], sorted(layout)
        self.addresses, self.peer_ranks = addresses, peer_ranks
        self.secret, self.timeout_s, self.where = secret, timeout_s, where

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def peers(self) -> dict[int, Address]:
        return {p: self.addresses[p] for p in self.peer_ranks}

    def who(self, peer: int) -> str:
        host, port = self.addresses[peer]
        return f"peer rank {peer} (host {host}, port {port})"


class Copier:
    """The PeerJobs of one manager and the thread that runs them (see the module docstring)."""

    def __init__(self, node: Node, store: Store, local: LocalStorage, *, pace: Callable[[int], None]) -> None:
        self.node, self._store, self._local, self._pace = node, store, local, pace
        self._jobs: dict[int, PeerJob] = {}  # by seq: not yet waited for and reported
        self._published: list[int] = []  # this leader's outcome keys still in the store, by seq
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[PeerJob, CommittedStep | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ckpt-peer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the training thread's side

    def track(self, seq: int, step: int) -> PeerJob:
        """The peer job of save number `seq` (created by whichever of save() and the worker comes first)."""
        with self._lock:
            return self._jobs.setdefault(seq, PeerJob(seq, step))

    def held(self) -> set[int]:
        """Steps whose copies are queued or running (local retention keeps them)."""
        with self._lock:
            return {j.step for j in self._jobs.values() if not j.done.is_set()}

    def wait_previous(self, newest: int | None) -> None:
        """Before a save: the copies of every save numbered below `newest` (the newest save issued, whose
        copies may go on) finished; raise their errors (each once). By number, not by what is tracked
        yet, so every rank waits for the same saves (one that failed inside save() is registered by
        the worker only when it gets to it)."""
        if newest is None:
            return
        with self._lock:
            start = min(self._jobs, default=newest)
        self._finish([self.track(seq, -1) for seq in range(start, newest)], None)

    def wait(self, timeout: float | None = None) -> None:
        """Every copy finished; raise the first error (each once)."""
        with self._lock:
            jobs = [self._jobs[s] for s in sorted(self._jobs)]
        self._finish(jobs, timeout)

    def settle(self) -> None:
        """Every copy finished (delete(): nothing copies meanwhile); their errors stay for later."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.done.wait()

    def _finish(self, jobs: list[PeerJob], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                raise CheckpointTimeoutError(f"step {job.step} is not yet committed on every node's peers after {timeout} s; "
                                             "call wait() again or raise the timeout")
        with self._lock:
            for job in jobs:
                self._jobs.pop(job.seq, None)
        for job in jobs:
            job.raise_error()

    # ------------------------------------------------------------ the worker's side (ckpt-io thread)

    def committed(self, seq: int, step: int, committed: CommittedStep | None) -> None:
        """Save `seq` is committed locally (`committed`), or failed (None): queue its copies."""
        job = self.track(seq, step)
        job.step = step  # wait_previous may have created it without
        self._queue.put((job, committed))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # ------------------------------------------------------------ the ckpt-peer thread

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            job, committed = item
            try:
                if committed is None:
                    job.finish(None)
                    continue
                if self.node.is_leader:
                    self._publish(job, self._copy(job))
                job.finish(*self._gather(job))
            except BaseException as exc:  # noqa: BLE001 - never stop the thread: the job carries it (the store gone, ...)
                job.finish(exc if isinstance(exc, CheckpointPeerError) else CheckpointPeerError(job.step, [f"{type(exc).__name__}: {exc}"]))

    def _copy(self, job: PeerJob) -> dict[str, Any]:
        """This node's leader: push the step to every peer at once; the outcome to publish."""
        node, t0 = self.node, time.perf_counter()
        outcome: dict[int, Any] = {}

        def one(peer: int) -> None:
            try:
                outcome[peer] = push(node.peers[peer], node.who(peer), secret=node.secret, timeout_s=node.timeout_s, rank=node.rank,
                                     storage=self._local, tier=node.tier, step=job.step, ranks=node.ranks, world_size=node.world_size,
                                     pace=self._pace)
            except BaseException as exc:  # noqa: BLE001 - one peer's failure is reported, the others go on
                outcome[peer] = exc

        threads = [threading.Thread(target=one, args=(p,), name=f"ckpt-peer-{p}", daemon=True) for p in node.peers]
        beating(self._store, keys.peer_beat(job.seq, node.rank), threads)
        failures = []
        for peer, got in sorted(outcome.items()):
            if isinstance(got, BaseException):
                failures.append(f"{_node(node)} could not commit its copy on {node.who(peer)}: {got}")
            else:
                log.info("checkpointing: step %d copied to %s: %.1f MB sent, %.1f MB held there already, %.2f s",
                         job.step, node.who(peer), got.bytes_sent / 1e6, got.bytes_reused / 1e6, got.seconds)
        sent = [g for g in outcome.values() if not isinstance(g, BaseException)]
        return {"ok": not failures, "failures": failures, "peers": sorted(p for p, g in outcome.items() if not isinstance(g, BaseException)),
                "sent": sum(g.bytes_sent for g in sent), "reused": sum(g.bytes_reused for g in sent), "seconds": time.perf_counter() - t0}

    def _publish(self, job: PeerJob, outcome: dict[str, Any]) -> None:
        """This leader's outcome of save `seq`'s copies; its keys of saves two or more before go.

        Save seq is committed, so every rank issued it, and issuing a save waits for the copies of
        every save but the one before (wait_previous): every rank has read the older outcomes."""
        self._store.set(keys.peer_copied(job.seq, self.node.rank), json.dumps(outcome))
        self._published.append(job.seq)
        while self._published and self._published[0] <= job.seq - 2:
            old = self._published.pop(0)
            delete_keys(self._store, (keys.peer_copied(old, self.node.rank), keys.peer_beat(old, self.node.rank)))

    def _gather(self, job: PeerJob) -> tuple[CheckpointPeerError | None, tuple[CopyResult, ...]]:
        """Every leader's outcome of this save's copies (a silent leader is a failure)."""
        node = self.node
        waited = {leader: keys.peer_copied(job.seq, leader) for leader in node.leaders}
        silent = wait_alive(self._store, waited, lambda leader: keys.peer_beat(job.seq, leader), node.timeout_s)
        failures = [f"{rank_ranges([l])} (a node's leader) reported no outcome of its peer copies for {node.timeout_s:g} s "
                    "(timeout_s): it died or hangs" for l in silent]
        results = []
        for leader in [l for l in node.leaders if l not in silent]:
            status = json.loads(self._store.get(waited[leader]))
            failures.extend(status["failures"])
            results.append(CopyResult(leader, tuple(status["peers"]), int(status["sent"]), int(status["reused"]), float(status["seconds"])))
        return (CheckpointPeerError(job.step, failures) if failures else None), tuple(results)


def _node(node: Node) -> str:
    return f"the node of {rank_ranges(node.ranks)} ({node.where})"
