"""Workers for the incremental-save tests across ranks and tiers (spawned by _dist.run_ranks; module
level so the spawned interpreters import them), and the small model they train.

The model has a large frozen part (an embedding and an MLP body, requires_grad=False, not in the
optimizer) and a small trained head with AdamW: after the first save only the head and its
optimizer state change, which is what an incremental save must write (and upload) again.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from _dist import assert_same, full_state
from _tiered import _Lines

MiB = 1 << 20
VOCAB, D, OUT = 64, 128, 32


class FrozenBaseNet(nn.Module):
    """emb + body are frozen (about 90% of the bytes with AdamW state); head is trained."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.body = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def build(world: int, *, sharded: bool = True, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over every rank when `sharded`: body, head and the root each a unit) and
    AdamW over the head only."""
    torch.manual_seed(seed)
    model = FrozenBaseNet()
    model.emb.requires_grad_(False)
    model.body.requires_grad_(False)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.body, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.head.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, rank: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = torch.randint(0, VOCAB, (32,), generator=g)  # 2-D activations: FSDP2 warns about 3-D Linear outputs (views)
        loss = nn.functional.cross_entropy(model(x), x * 7 % OUT)
        loss.backward()
        opt.step()
        opt.zero_grad()


def frozen_bytes() -> int:
    m = FrozenBaseNet()
    return sum(p.numel() * p.element_size() for mod in (m.emb, m.body) for p in mod.parameters())


def _stats(s: Any) -> dict[str, Any]:
    return {k: s[k] for k in ("step", "ok", "tier", "bytes_total", "bytes_written", "bytes_reused", "chunks_reused", "chunks_total",
                              "bytes_uploaded", "bytes_upload_reused")}


def _restore_each(rank: int, world: int, mgr: Any, steps: list[int], refs: str) -> None:
    """Restore each step into a fresh model (another seed: the frozen part differs too) and compare bit-exactly."""
    for step in steps:
        model, opt = build(world, seed=123 + step)
        assert mgr.restore({"model": model, "optim": opt}, step=step) == step
        assert_same(torch.load(f"{refs}/ref{step}.pt"), full_state(model, opt))
        train(model, opt, 1, rank=rank, start=50)  # the restored optimizer works


# ----------------------------------------------------------------------------- test 1: ranks, local tier


def save_incremental(rank: int, world: int, directory: str, refs: str) -> dict[str, list[dict[str, Any]]]:
    """Saves 1..4 into three shared directories at once: 'all' keeps every step, 'one' keep_local=1,
    and 'rng' (every step) saves a small per-rank tensor beside the model, as a per-rank RNG or
    data-loader state would be. Step 3 is saved with nothing changed since step 2. Then every
    retained step of 'all' and 'one' is restored on these ranks and compared with the reference
    taken at save time."""
    from checkpointing import CheckpointManager

    model, opt = build(world)
    train(model, opt, 1, rank=rank)
    out: dict[str, list[dict[str, Any]]] = {"all": [], "one": [], "rng": []}
    every = CheckpointManager(f"{directory}/all", keep_local=None, timeout_s=60)
    one = CheckpointManager(f"{directory}/one", keep_local=1, timeout_s=60)
    per_rank = CheckpointManager(f"{directory}/rng", keep_local=None, timeout_s=60)
    try:
        for step in (1, 2, 3, 4):
            if step != 3:
                train(model, opt, 1, rank=rank, start=step)
            ref = full_state(model, opt)  # a collective: every rank takes part
            if rank == 0:
                torch.save(ref, f"{refs}/ref{step}.pt")
            for name, mgr in (("all", every), ("one", one)):
                out[name].append(_stats(mgr.save(step, {"model": model, "optim": opt}).wait()))
            rng = torch.full((256,), float(100 * rank + step))  # differs between ranks: saved per rank
            out["rng"].append(_stats(per_rank.save(step, {"model": model, "optim": opt, "rng": rng}).wait()))
        assert every.steps() == [1, 2, 3, 4] and one.steps() == [4], (every.steps(), one.steps())
        _restore_each(rank, world, every, [1, 2, 3, 4], refs)
        _restore_each(rank, world, one, [4], refs)
    finally:
        every.close()
        one.close()
        per_rank.close()
    return out


def restore_one_rank(rank: int, world: int, directory: str, refs: str) -> bool:
    """The checkpoints of save_incremental restored on another world size."""
    from checkpointing import CheckpointManager

    with CheckpointManager(f"{directory}/all", timeout_s=60) as mgr:
        _restore_each(rank, world, mgr, [1, 2, 3, 4], refs)
    with CheckpointManager(f"{directory}/one", timeout_s=60) as mgr:
        assert mgr.steps() == [4], mgr.steps()
        _restore_each(rank, world, mgr, [4], refs)
    return True


def restart_and_save(rank: int, world: int, directory: str, refs: str) -> dict[str, Any]:
    """A restarted job at the same world size: fresh objects restore the newest step of 'rng' (model,
    optimizer and the per-rank tensor), train a step and save step 5, whose first save takes the
    unchanged frozen shards from the restored step; step 5 then restores bit-exactly."""
    from checkpointing import CheckpointManager

    model, opt = build(world, seed=55)
    with CheckpointManager(f"{directory}/rng", keep_local=None, timeout_s=60) as mgr:
        rng = torch.zeros(256)
        assert mgr.restore({"model": model, "optim": opt, "rng": rng}) == 4
        assert float(rng[0]) == 100 * rank + 4
        train(model, opt, 1, rank=rank, start=60)
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, f"{refs}/ref5.pt")
        stats = _stats(mgr.save(5, {"model": model, "optim": opt, "rng": torch.full((256,), float(100 * rank + 5))}).wait())
        model2, opt2 = build(world, seed=66)
        rng2 = torch.zeros(256)
        assert mgr.restore({"model": model2, "optim": opt2, "rng": rng2}, step=5) == 5
        assert_same(torch.load(f"{refs}/ref5.pt"), full_state(model2, opt2))
        assert float(rng2[0]) == 100 * rank + 5
    return stats


# ----------------------------------------------------------------------------- test 4: ranks, remote tier




def save_incremental_remote(rank: int, world: int, base: str, url: str, options: dict, refs: str) -> dict[str, Any]:
    """Each rank its own node-local tier, one remote tier: saves 1..3 (keep_local=1, keep_remote=2),
    then the node-local directories are deleted and fresh managers restore the retained remote
    steps from the remote tier alone."""
    import torch.distributed as dist

    from checkpointing import CheckpointManager

    def manager(local: str) -> CheckpointManager:
        return CheckpointManager(local, remote=url, storage_options=options, timeout_s=60, upload_part_bytes=5 * MiB,
                                 keep_local=1, keep_remote=2)

    model, opt = build(world)
    train(model, opt, 1, rank=rank)
    stats = []
    local = f"{base}/node{rank}"
    with manager(local) as mgr:
        for step in (1, 2, 3):
            train(model, opt, 1, rank=rank, start=step)
            ref = full_state(model, opt)
            if rank == 0:
                torch.save(ref, f"{refs}/ref{step}.pt")
            stats.append(_stats(mgr.save(step, {"model": model, "optim": opt}).wait()))
        tiers = mgr.tiers()
    kept = sorted(str(p.relative_to(local)) for p in Path(local).rglob("*.pack"))
    dist.barrier()
    shutil.rmtree(local)  # every node is replaced by an empty machine
    dist.barrier()
    lines = _Lines()
    logger = logging.getLogger("checkpointing")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    with manager(f"{base}/fresh{rank}") as mgr:
        fresh_tiers = mgr.tiers()
        model2, opt2 = build(world, seed=77)
        assert mgr.restore({"model": model2, "optim": opt2}) == 3
        assert_same(torch.load(f"{refs}/ref3.pt"), full_state(model2, opt2))
        _restore_each(rank, world, mgr, [2], refs)
    logger.removeHandler(lines)
    return {"stats": stats, "tiers": tiers, "fresh_tiers": fresh_tiers, "local_packs": kept,
            "restored": [line for line in lines.lines if "restored step" in line]}


def replicated_tensor_moves_its_primary(rank: int, world: int, base: str, url: str, options: dict) -> dict[str, Any]:
    """Each rank its own node-local tier, one remote tier. A plain tensor with the same bytes on
    every rank ("shared") beside per-rank ones ("mine"): at step 1 the ranks do not know yet that
    "mine" differs, so "shared" is rank 1's primary copy and rank 0 keeps it only locally, past its
    file's uploaded prefix; from step 2 "shared" is rank 0's primary, its bytes unchanged. Saves
    1..3, then a fresh node restores each step from the remote tier alone."""
    import torch.distributed as dist

    from checkpointing import CheckpointManager

    g = torch.Generator().manual_seed(100 + rank)
    state = {"mine": torch.randn(1 << 19, generator=g), "shared": torch.arange(16384.0)}
    want = {}
    stats = []
    with CheckpointManager(f"{base}/node{rank}", remote=url, storage_options=options, timeout_s=60) as mgr:
        for step in (1, 2, 3):
            if step == 3:
                state["mine"].add_(1.0)
            want[step] = {k: v.clone() for k, v in state.items()}
            stats.append(_stats(mgr.save(step, state).wait()))
    dist.barrier()
    with CheckpointManager(f"{base}/fresh{rank}", remote=url, storage_options=options, timeout_s=60) as mgr:
        for step in (1, 2, 3):
            got = {k: torch.zeros_like(v) for k, v in state.items()}
            assert mgr.restore(got, step=step) == step
            assert all(torch.equal(got[k], want[step][k]) for k in got), (rank, step)
    return {"stats": stats}
