"""Workers for tests/test_parallel_2d.py: 2-D parallel state (FSDP2 over tensor parallel) resharded across meshes.

The model is a small llama-shaped stack (embedding, two pre-norm MLP blocks, final norm, head) with
uneven sizes (vocab 1001, hidden 54) laid out four ways, all from the same seed:
  "2d"    parallelize_module on mesh["tp"] (Colwise, Rowwise, SequenceParallel norms), then
          fully_shard on mesh["dp"] per block and the root: (_StridedShard, Shard), (Shard, Shard(1)), (Shard, Replicate)
  "fsdp"  fully_shard only, on a 1-D mesh of every rank
  "tp"    parallelize_module only, on a 1-D mesh of every rank
  "plain" an nn.Module in one process (no process group)
The data are a fixed global batch split across the data-parallel ranks (tensor-parallel ranks see
the same rows), so every layout takes the same optimizer step up to float rounding.

Each worker runs its scenarios one after the other and returns, per scenario, ("ok", value) or
("error", traceback): one failing scenario is reported by its own test instead of hiding the rest.
"""

from __future__ import annotations

import linecache
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, D, H, SEQ, BATCH = 1001, 40, 54, 8, 4
STEPS = 2  # trained before the save; the save is step STEPS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def tp_plan() -> dict[str, Any]:
    """torchtitan's plan: sequence-parallel norms between column/row-parallel linears."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(2):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


class Job:
    """A model laid out one way, its AdamW, and which slice of the global batch this rank trains on."""

    def __init__(self, layout: str, seed: int = 0) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        torch.manual_seed(seed)
        self.model = model = Net()
        self.dp_rank, self.dp_size = 0, 1
        if layout == "2d":
            mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], tp_plan())
            dp = mesh["dp"]
        elif layout == "tp":
            parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)), tp_plan())
            dp = None
        elif layout == "fsdp":
            dp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        else:
            assert layout == "plain", layout
            dp = None
        if dp is not None:
            for block in model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
            self.dp_rank, self.dp_size = dp.get_local_rank(), dp.size()
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(self, steps: int, start: int = 0) -> None:
        for step in range(start, start + steps):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
            n = BATCH // self.dp_size
            x = x[self.dp_rank * n : (self.dp_rank + 1) * n]
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), torch.roll(x, 1, 1).flatten())
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def full(self, *, params_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter and AdamW state tensor, unsharded, keyed by parameter name."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {f"model/{n}": _full(p) for n, p in self.model.named_parameters()}
        if params_only:
            return out
        params = [p for g in self.opt.param_groups for p in g["params"]]
        assert len(params) == len(names)
        for p in params:
            for k, v in self.opt.state.get(p, {}).items():
                out[f"optim/{names[id(p)]}/{k}"] = _full(v)
        return out

    def boxes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """The manifest key of every tensor restored into -> (global offsets, shape) of what this rank holds
        (torch's own arithmetic, compute_local_shape_and_global_offset): what it needs to read."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        out = {}
        for i, (name, p) in enumerate(self.model.named_parameters()):
            if hasattr(p, "placements"):
                shape, offsets = compute_local_shape_and_global_offset(tuple(p.shape), p.device_mesh, p.placements)
            else:
                shape, offsets = tuple(p.shape), (0,) * p.dim()
            for key in (f"model/{name}", f"optim/state/{i}/exp_avg", f"optim/state/{i}/exp_avg_sq"):
                out[key] = (tuple(offsets), tuple(shape))
            out[f"optim/state/{i}/step"] = ((), ())
        return out

    def placements(self) -> dict[str, str]:
        return {n: str(tuple(p.placements)) for n, p in self.model.named_parameters() if hasattr(p, "placements")}


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def rchar() -> int:
    """Bytes this process has passed to read()/pread()/preadv() so far (the kernel's count, /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def read_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn()'s result and the bytes this process read while it ran, less Python's reads of its own source
    files (torch's FakeTensorMode records a stack trace the first time DTensor ops propagate shardings,
    and linecache reads every file on that stack once per process: not checkpoint reads)."""
    cached = set(linecache.cache)
    before = rchar()
    result = fn()
    nbytes = rchar() - before
    return result, nbytes - sum(linecache.cache[f][0] for f in set(linecache.cache) - cached if len(linecache.cache[f]) == 4)


def attempt(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test names which scenario failed, with the traceback
        return ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def restore_into(directory: str, layout: str) -> dict[str, Any]:
    """A fresh model (another seed) and a fresh AdamW (no state) in `layout`, restored from `directory`;
    then one more training step. Returns the restored full state, the bytes read, and the next step's params."""
    from checkpointing import CheckpointManager

    job = Job(layout, seed=123)
    with CheckpointManager(directory, timeout_s=60) as mgr:
        step, nbytes = read_during(lambda: mgr.restore(job.state()))
    full = job.full()
    job.train(1, start=STEPS)
    return {"step": step, "full": full, "rchar": nbytes, "boxes": job.boxes(), "next": job.full(params_only=True)}


def _dcp_round_trip(directory: str) -> dict[str, torch.Tensor]:
    """DCP's own round trip of the saved state (written by `dcp_save`) into a fresh model on the same mesh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    job = Job("2d", seed=123)
    msd, osd = get_state_dict(job.model, job.opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory)
    set_state_dict(job.model, job.opt, model_state_dict=msd, optim_state_dict=osd)
    return job.full()


def _refused(mgr: Any, step: int, state: dict[str, Any]) -> dict[str, Any]:
    """save() of a state that cannot be saved: the error it raised (or "saved"), and the steps after it."""
    phase = "save"
    try:
        handle = mgr.save(step, state)
        phase = "wait"
        handle.wait()
        phase, error = "", "saved"
    except Exception as exc:  # noqa: BLE001 - its type and text are the result
        error = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    try:
        mgr.wait()
    except Exception:  # noqa: BLE001 - the background part of a refused save, if any
        pass
    return {"raised_in": phase, "error": error, "steps": mgr.steps()}


def _strided_local(mesh: Any) -> Any:
    """(_StridedShard(0, sf=2), Replicate()) on a 2x2 mesh: each rank's 4 rows are rows {2c, 2c+1, 2c+4, 2c+5}."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    local = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    return DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Replicate()], run_check=False, shape=(8, 3), stride=(3, 1))


def four_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:  # one piece: one spawn of 4 ranks runs every 4-rank scenario in order
    """Train on (dp=2, tp=2), save, refuse Partial and non-box shards, DCP round trip, then restore on
    the same mesh and as pure FSDP on 4 ranks. Rank 0 returns the full tensors; every rank its errors and bytes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from checkpointing import CheckpointManager

    ours, theirs = f"{tmp}/ckpt", f"{tmp}/dcp"
    out: dict[str, Any] = {}
    job = Job("2d")
    job.train(STEPS)
    out["placements"] = job.placements()
    out["ref"] = job.full()
    with CheckpointManager(ours, timeout_s=60) as mgr:
        out["save"] = attempt(lambda: mgr.save(STEPS, job.state()).wait().bytes_written)
        msd, osd = get_state_dict(job.model, job.opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=theirs)
        flat = init_device_mesh("cpu", (world,))
        partial = DTensor.from_local(torch.full((3,), float(rank)), flat, [Partial()])
        out["partial"] = _refused(mgr, STEPS + 1, {"model": job.model, "grad_sum": partial})
        out["strided"] = _refused(mgr, STEPS + 2, {"odd": _strided_local(job.model.emb.weight.device_mesh)})
    job.train(1, start=STEPS)
    out["next"] = job.full(params_only=True)
    out["dcp"] = attempt(lambda: _dcp_round_trip(theirs))
    out["same_mesh"] = attempt(lambda: restore_into(ours, "2d"))
    out["fsdp4"] = attempt(lambda: restore_into(ours, "fsdp"))
    if rank:  # the full tensors are the same on every rank: rank 0 returns them
        out = {k: _drop_tensors(v) for k, v in out.items() if k not in ("ref", "next")}
    return out


def two_ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Restore the (dp=2, tp=2) checkpoint as tensor parallel only, then as 1-D FSDP, on 2 ranks."""
    out = {"tp": attempt(lambda: restore_into(directory, "tp")), "fsdp2": attempt(lambda: restore_into(directory, "fsdp"))}
    return out if rank == 0 else {k: _drop_tensors(v) for k, v in out.items()}


def _drop_tensors(value: Any) -> Any:
    """What ranks other than 0 return: no full tensors (rank 0's are the same), everything else."""
    if isinstance(value, tuple) and value[0] == "ok" and isinstance(value[1], dict):
        return ("ok", _drop_tensors(value[1]))
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in ("full", "next")} if "full" in value else value
    return value
