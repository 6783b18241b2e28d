"""FSDP2 training with sharded, asynchronous checkpoints. Launch it as usual:

    torchrun --nproc-per-node 2 examples/train_fsdp.py --dir ./ckpt-fsdp --steps 30

Run it again (with the same or another --nproc-per-node) and it resumes from the newest step every
rank can read, resharding the model and optimizer when the number of ranks changed. Across
machines, start the same command on each with the usual rendezvous settings, e.g.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id run1 examples/train_fsdp.py --dir /nvme/ckpt/run1

where --dir is node-local storage on each machine (each node keeps what its ranks need).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from checkpointing import CheckpointManager, CheckpointMismatchError


class Net(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="./ckpt-fsdp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    torch.manual_seed(0)
    model = Net().to(device)
    mesh = init_device_mesh(device, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = {"batches_seen": 0}  # this rank's position in its data: restored per rank
    state = {"model": model, "optim": optim, "loader": loader}

    with CheckpointManager(args.dir, keep_local=2) as mgr:
        try:
            start = mgr.restore(state)  # collective: every rank agrees on the step
        except CheckpointMismatchError:
            # saved on another number of ranks: the per-rank loader positions cannot be mapped,
            # the model and optimizer are resharded
            start = mgr.restore({"model": model, "optim": optim}, strict=False)
        start = start or 0
        for step in range(start + 1, args.steps + 1):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randint(0, 256, (8, 32), generator=g).to(device)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
            loss.backward()
            optim.step()  # waits here only if the previous snapshot is still being copied
            optim.zero_grad()
            loader["batches_seen"] += 1
            if step % args.every == 0:
                mgr.save(step, state)  # returns after the snapshot; every rank writes its own shards
        mgr.wait()
        if rank == 0:
            last = mgr.stats()[-1] if mgr.stats() else None
            print(f"rank 0: resumed at {start}, trained to {args.steps}, loss {loss.item():.4f}, "
                  f"steps on disk {mgr.steps()}" + (f", last save stalled {last.stall_s * 1e3:.1f} ms" if last else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
