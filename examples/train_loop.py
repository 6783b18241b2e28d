"""Minimal training loop with checkpointing. Run it twice: the second run resumes.

    python examples/train_loop.py [CKPT_DIR] [STEPS]
"""
import sys

import torch
import torch.nn as nn

from checkpointing import CheckpointManager, RNGState

ckpt_dir = sys.argv[1] if len(sys.argv) > 1 else "./demo-run/train-loop"
total = int(sys.argv[2]) if len(sys.argv) > 2 else 40
every = 10

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
state = {"model": model, "optim": optim, "rng": RNGState(), "meta": {"samples": 0}}

with CheckpointManager(ckpt_dir, keep_local=2) as mgr:
    start = mgr.restore(state) or 0  # newest committed step, or None on a fresh run
    print(f"starting after step {start}; committed steps on disk: {mgr.steps()}")
    for step in range(start + 1, total + 1):
        x = torch.randn(32, 64)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) / 8)
        optim.zero_grad()
        loss.backward()
        optim.step()
        state["meta"]["samples"] += x.shape[0]
        if step % every == 0:
            mgr.save(step, state)  # returns after the snapshot; the write runs in the background
            print(f"step {step}: loss {loss.item():.4f}, save issued")
    mgr.wait()  # every save durable (or its error raised)
    for s in mgr.stats():
        print(f"saved step {s.step}: stall {s.stall_s * 1e3:.1f} ms, durable after {s.total_s * 1e3:.1f} ms")
    print(f"done; committed steps: {mgr.steps()}; samples seen: {state['meta']['samples']}")
