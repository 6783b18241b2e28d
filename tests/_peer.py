"""Workers for the peer-copy tests (spawned by _dist.run_ranks; module level so they import).

Node-local directories: rank r of a job with `per_node` ranks per node uses `<base>/node<r // per_node>`
(ranks sharing a directory are one node). The state: a tensor per rank (`w`, large, unchanged
between steps so incremental saves borrow it), a small per-rank tensor that changes every step
(`b`), a tensor equal on the ranks of one node (`shared`, written once per node) and primitives.
(`shared` differs between nodes: an equal plain tensor on two one-rank nodes trips a merge error in
incremental saves that has nothing to do with peer copies; see /tmp/work/peer_progress.md.)
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

N = 1 << 19  # 2 MiB of float32 per rank in `w`


def node_dir(base: str, rank: int, per_node: int) -> str:
    return f"{base}/node{rank // per_node}"


def manager(base: str, rank: int, per_node: int, **kwargs: Any):
    from checkpointing import CheckpointManager

    kwargs.setdefault("peer_copies", 1)
    kwargs.setdefault("timeout_s", 30)
    return CheckpointManager(node_dir(base, rank, per_node), **kwargs)


def state(rank: int, step: int, node: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(N, generator=g)
    b = torch.full((4096,), float(step)) + rank
    shared = torch.arange(1 << 14, dtype=torch.float32) + node
    return {"w": w, "b": b, "shared": shared, "meta": {"step": step, "rank": rank}}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(N), "b": torch.zeros(4096), "shared": torch.zeros(1 << 14), "meta": {}}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("w", "b", "shared")) and a["meta"] == b["meta"]


class Lines(logging.Handler):
    """The checkpointing logger's messages, for tests that check what the log says."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        logger = logging.getLogger("checkpointing")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def save_copy_retain_delete(rank: int, world: int, base: str, per_node: int) -> dict[str, Any]:
    """Steps 1-3 with keep_local=2 and one peer copy each, then delete(2): what each rank saw."""
    out: dict[str, Any] = {}
    with manager(base, rank, per_node, keep_local=2) as mgr:
        for step in (1, 2, 3):
            handle = mgr.save(step, state(rank, step, rank // per_node))
            stats = handle.wait()
            assert handle.done() and handle.peer is not None and handle.peer.done.is_set()
            out[f"sent{step}"] = {r.node: (r.bytes_sent, r.bytes_reused, r.peers) for r in handle.peer.results}
            out[f"reused{step}"] = stats.bytes_reused
            out[f"files{step}"] = node_files(node_dir(base, rank, per_node), step)
            if step == 2:
                out["tiers2"] = mgr.tiers()
        out["tiers3"] = mgr.tiers()
        mgr.delete(2)
        out["tiers_deleted"] = mgr.tiers()
    return out


def node_files(directory: str, step: int) -> tuple[int, int]:
    """Bytes of the node's files of `step` (those on its own tier): (new in the step's directory, of earlier steps)."""
    from checkpointing.format import naming
    from checkpointing.storage import LocalStorage
    from checkpointing.tier import catalog
    from checkpointing.tier.tierfile import read_tier_id

    storage = LocalStorage(directory, create=False)
    tier = read_tier_id(storage)
    files = [f for f in catalog.load_manifest(storage, step).files if f.tier == tier]
    new = sum(f.nbytes for f in files if f.path.startswith(naming.step_dir(step) + "/"))
    return new, sum(f.nbytes for f in files) - new


def too_few_nodes(rank: int, world: int, base: str) -> str:
    from checkpointing import CheckpointConfigError

    try:
        manager(base, rank, world)  # every rank on one node
    except CheckpointConfigError as exc:
        return str(exc)
    return "created"


def copies_off(rank: int, world: int, base: str, per_node: int) -> dict[int, str]:
    with manager(base, rank, per_node, peer_copies=0) as mgr:
        mgr.save(1, state(rank, 1, rank)).wait()
        return mgr.tiers()


class _SlowPins:
    """A replica's real LocalStorage whose first pin write hangs for `delay_s` (a hung peer disk)."""

    fired = False

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner, self._delay_s = inner, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, path: str, data: bytes, **kwargs: Any) -> None:
        if "/PIN." in path and not _SlowPins.fired:
            _SlowPins.fired = True
            time.sleep(self._delay_s)
        self._inner.put(path, data, **kwargs)


def hung_peer(rank: int, world: int, base: str, hung: int, timeout_s: float) -> dict[str, Any]:
    """Rank `hung`'s replica disk hangs on the first copy it receives: the sender times out, every rank
    raises the same error naming the peer, the local commit stands, and the next save copies again."""
    from checkpointing.peer import replica
    from checkpointing.peer.types import CheckpointPeerError

    if rank == hung:
        real = replica.ReplicaArea.storage
        replica.ReplicaArea.storage = lambda self, tier: _SlowPins(real(self, tier), 1.5 * timeout_s)  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    with manager(base, rank, 1, timeout_s=timeout_s) as mgr:
        handle = mgr.save(1, state(rank, 1, rank))
        try:
            handle.wait()
            out["first"] = "copied"
        except CheckpointPeerError as exc:
            out["first"] = str(exc)
        out["tiers1"] = mgr.tiers()
        handle = mgr.save(2, state(rank, 2, rank))  # the next save copies again
        handle.wait()
        out["tiers2"] = mgr.tiers()
    return out


def error_at_a_later_save(rank: int, world: int, base: str, hung: int, timeout_s: float) -> dict[str, Any]:
    """Nobody waits for the handles: the failed copy of step 1 is raised by the save() that waits for it
    (save(3): at most one step copies while the next is written), on every rank; that save is not
    issued, the same call again is, and wait() finds everything else copied."""
    from checkpointing.peer import replica
    from checkpointing.peer.types import CheckpointPeerError

    if rank == hung:
        real = replica.ReplicaArea.storage
        replica.ReplicaArea.storage = lambda self, tier: _SlowPins(real(self, tier), 1.5 * timeout_s)  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    with manager(base, rank, 1, timeout_s=timeout_s, keep_local=None) as mgr:
        mgr.save(1, state(rank, 1, rank))
        mgr.save(2, state(rank, 2, rank))
        try:
            mgr.save(3, state(rank, 3, rank))
            out["save3"] = "issued"
        except CheckpointPeerError as exc:
            out["save3"] = str(exc)
        mgr.save(3, state(rank, 3, rank))  # again: issued now
        mgr.wait()
        out["tiers"] = mgr.tiers()
    return out


def sleep_then_kill_self(delay: float) -> None:
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGKILL)


def committed_steps(path: str) -> list[int]:
    from checkpointing.storage import LocalStorage
    from checkpointing.tier import catalog

    return catalog.list_steps(LocalStorage(path, create=False)).committed if Path(path).is_dir() else []


# ----------------------------------------------------------------------------- node loss (stage 3)


def save_steps(rank: int, world: int, base: str, per_node: int, steps: list[int], remote: tuple[str, dict] | None = None,
               keep_local: int | None = None) -> str:
    """Save `steps` with one peer copy each (and a remote tier when given); wait until durable everywhere."""
    kwargs: dict[str, Any] = {} if remote is None else {"remote": remote[0], "storage_options": remote[1], "upload_part_bytes": 5 << 20}
    with manager(base, rank, per_node, keep_local=keep_local, **kwargs) as mgr:
        for step in steps:
            mgr.save(step, state(rank, step, rank // per_node)).wait()
        return repr(mgr.tiers())


def restore_after_loss(rank: int, world: int, base: str, per_node: int, expect: int, remote: tuple[str, dict] | None = None,
                       then_save: int | None = None) -> dict[str, Any]:
    """Restore into a blank state, check it bit-exactly against step `expect`, return this rank's log; then
    optionally save `then_save` (the copies of the replaced node's new tier replace its old ones)."""
    lines = Lines()
    kwargs: dict[str, Any] = {} if remote is None else {"remote": remote[0], "storage_options": remote[1], "upload_part_bytes": 5 << 20}
    target = blank()
    with manager(base, rank, per_node, keep_local=None, **kwargs) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(target)
        seconds = time.perf_counter() - t0
        assert step == expect, (step, expect)
        assert same(target, state(rank, expect, rank // per_node)), "restored state differs"
        tiers = mgr.tiers()
        if then_save is not None:
            mgr.save(then_save, state(rank, then_save, rank // per_node)).wait()
    return {"lines": lines.lines, "seconds": seconds, "tiers": tiers}


def killed_mid_copy(rank: int, world: int, base: str, victim: int, timeout_s: float) -> dict[str, Any]:
    """Step 1 is copied; during step 2's copy the peer `victim` (holding rank 0's copy) is SIGKILLed.
    The survivor: a clear error naming the peer, its local step 2 committed, training goes on."""
    import threading

    import torch.nn as nn

    from checkpointing.peer.types import CheckpointPeerError

    out: dict[str, Any] = {}
    mgr = manager(base, rank, 1, timeout_s=timeout_s, keep_local=None, peer_bandwidth=1e6)  # 2 MB per node: ~2 s per copy
    mgr.save(1, state(rank, 1, rank)).wait()
    if rank == victim:  # die once the copy of rank 0's step 2 has begun arriving here (its pin is there)
        def watch() -> None:
            while not list(Path(node_dir(base, rank, 1), "peers").glob("*/step-0000000002/PIN.*")):
                time.sleep(0.005)
            sleep_then_kill_self(0.4)
        threading.Thread(target=watch, daemon=True).start()
    step2 = state(rank, 2, rank)
    step2["w"] = step2["w"] + 1  # all new bytes: the whole pack must travel
    handle = mgr.save(2, step2)
    try:
        handle.wait()
        out["error"] = None
    except CheckpointPeerError as exc:
        out["error"] = str(exc)
    out["tiers"] = mgr.tiers()
    model = nn.Linear(8, 8)  # training goes on: nothing waits for the dead peer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    out["trained"] = True
    mgr.close()
    return out


def store_keys_over_saves(rank: int, world: int, base: str, per_node: int, saves: int) -> list[int]:
    """Save `saves` steps with peer copies, each waited for everywhere; the job store's key count after each.
    Every save's keys (the commit's and the copies') must go once no rank needs them: the count stays flat."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    counts = []
    with manager(base, rank, per_node, keep_local=2) as mgr:
        for step in range(1, saves + 1):
            mgr.save(step, state(rank, step, rank // per_node)).wait()
            dist.barrier()
            counts.append(_get_default_store().num_keys())
            dist.barrier()
    return counts
