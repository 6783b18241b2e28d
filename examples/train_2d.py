"""2-D parallel training (FSDP2 over tensor parallel, the torchtitan layout) with sharded, asynchronous
checkpoints, resumable on another mesh. Launch it as usual:

    torchrun --nproc-per-node 4 examples/train_2d.py --dir ./ckpt-2d --steps 20 --dp 2 --tp 2

Run it again with another layout and it resumes from the newest committed step, resharding the model
and the AdamW state onto the new mesh (each rank reads only the saved shards overlapping its own):

    torchrun --nproc-per-node 2 examples/train_2d.py --dir ./ckpt-2d --steps 30 --dp 1 --tp 2   # TP only
    torchrun --nproc-per-node 4 examples/train_2d.py --dir ./ckpt-2d --steps 30 --dp 4 --tp 1   # FSDP only
    python examples/train_2d.py --dir ./ckpt-2d --steps 30 --dp 1 --tp 1                         # one process

The model is a small llama-shaped transformer (token embedding, pre-norm blocks with RMSNorm, rotary
attention wq/wk/wv/wo and a SwiGLU feed-forward w1/w2/w3, a final norm and an output projection),
built from code. The data are synthetic and deterministic: the global batch of step s is drawn from
a generator seeded with s and split over the data-parallel ranks, so every layout trains on the
same tokens and a resumed run's losses can be compared with an uninterrupted one's.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checkpointing import CheckpointManager


class Args:
    """Model and data sizes: a few hundred thousand parameters, a step in milliseconds on a CPU."""

    vocab, dim, n_heads, n_layers, ffn_hidden = 1024, 64, 4, 3, 176
    batch, seq = 8, 32  # the global batch: batch % dp == 0 and seq % tp == 0 (sequence parallel)


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, seq, heads, head_dim), computed from the positions."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)[None, :, None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: type[Args]) -> None:
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, a.dim, bias=False)
        self.wv = nn.Linear(a.dim, a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # under tensor parallel wq/wk/wv hold this rank's heads only: -1 is the local head count
        q, k, v = (w(x).view(bs, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, a: type[Args]) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: type[Args]) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: type[Args]) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model: Transformer, tp_mesh) -> None:
    """torchtitan's plan: column/row-parallel linears, sequence-parallel norms between them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def apply_fsdp(model: Transformer, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    # Under tensor parallel the logits are the output projection's local tensor, which torch hands
    # out as a view; FSDP2 warns about in-place edits of a root output view, and nothing here makes any.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def layout_problems(dp: int, tp: int, world: int) -> list[str]:
    """Why a (dp, tp) mesh does not fit this job and model, each with how to fix it (empty: it fits)."""
    a = Args
    problems = []
    if dp < 1 or tp < 1:
        problems.append(f"--dp {dp} and --tp {tp} must be at least 1")
        return problems
    if dp * tp != world:
        problems.append(f"--dp {dp} x --tp {tp} = {dp * tp}, but the job has {world} ranks: the mesh must use every rank")
    if a.n_heads % tp or a.ffn_hidden % tp or a.seq % tp:
        problems.append(f"--tp {tp} must divide the head count {a.n_heads}, the feed-forward width {a.ffn_hidden} and the sequence length {a.seq}")
    if a.batch % dp:
        problems.append(f"--dp {dp} must divide the global batch {a.batch}")
    return problems


def build(dp: int, tp: int, world: int) -> tuple[Transformer, int, int]:
    """The model laid out on a (dp, tp) mesh; returns it with this rank's data-parallel rank and size."""
    a = Args
    torch.manual_seed(0)  # the same initial weights on every rank and in every layout
    model = Transformer(a)
    if world == 1:
        return model, 0, 1
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if dp > 1:
        apply_fsdp(model, mesh["dp"])
    return model, mesh["dp"].get_local_rank(), dp


def batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch, this data-parallel rank's rows: sequences that climb by a fixed
    stride (mod vocab) from a random start, so the next token is learnable from the previous ones."""
    a = Args
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, a.vocab, (a.batch, 1), generator=g)
    stride = torch.randint(1, 9, (a.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(a.seq + 1)) % a.vocab
    rows = tokens[dp_rank * a.batch // dp:(dp_rank + 1) * a.batch // dp]
    return rows[:, :-1], rows[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description="FSDP2 + tensor parallel training with checkpoints that reshard across meshes")
    ap.add_argument("--dir", default="./ckpt-2d", help="checkpoint directory (node-local storage)")
    ap.add_argument("--steps", type=int, default=20, help="train up to this step")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP2) mesh size (default: world / tp)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel mesh size")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()

    distributed = "RANK" in os.environ  # launched by torchrun; `python examples/train_2d.py` is one plain process
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    dp = args.dp if args.dp is not None else max(world // args.tp, 1)
    problems = layout_problems(dp, args.tp, world)
    if problems:  # checked before any rank joins the job: said once, by rank 0
        raise SystemExit("train_2d.py: " + "; ".join(problems) if rank == 0 else 2)
    if distributed:
        dist.init_process_group("gloo")
    model, dp_rank, dp_size = build(dp, args.tp, world)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    state = {"model": model, "optim": optim}

    with CheckpointManager(args.dir, keep_local=2) as mgr:
        start = mgr.restore(state) or 0  # collective: the newest step every rank can read, resharded onto this mesh
        if rank == 0:
            print(f"rank 0: mesh dp={dp} tp={args.tp} ({world} ranks), "
                  + (f"resumed from step {start}" if start else "no checkpoint, starting at step 0"), flush=True)
        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, dp_rank, dp_size)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optim.step()  # waits here only if the previous snapshot is still being copied
            optim.zero_grad()
            # the global batch's loss: the mean of the data-parallel ranks' (tensor-parallel ranks hold the same)
            reported = loss.detach().clone()
            if distributed:
                dist.all_reduce(reported)
                reported /= world
            if rank == 0:
                print(f"step {step} loss {reported.item():.6f}", flush=True)
            if step % args.save_every == 0:
                mgr.save(step, state)  # returns after the snapshot; every rank writes only its own shards
        mgr.wait()
        if rank == 0:
            print(f"rank 0: trained to step {args.steps}, steps on disk {mgr.steps()}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
