"""Workers for pipeline-stage and expert-sharded state (tests/test_pipeline_keys.py); run by _dist.run_ranks.

A stage holds some of the model's layers under their full-model names (torchtitan's way: the
layers a stage does not run are deleted, so `layers.2.weight` is called that on every layout).
Experts are one (E, D, D) tensor sharded on dim 0 over the ranks, plus per-rank plain tensors
named after their expert (each rank saves only its own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

LAYERS, D, EXPERTS = 4, 6, 4


class Stack(nn.Module):
    def __init__(self, keep: range) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Linear(D, D) for i in range(LAYERS)})
        for i in range(LAYERS):
            if i not in keep:
                del self.layers[str(i)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def stage_layers(stage: int, stages: int) -> range:
    per = LAYERS // stages
    return range(stage * per, (stage + 1) * per)


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, D, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _full(t: Any) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The stage's parameters and AdamW state as full tensors, by full-model name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model/{k}": _full(v) for k, v in msd.items()}
    for name, st in osd["state"].items():
        out.update({f"optim/{name}/{k}": _full(v) for k, v in st.items()})
    return out


def _stage(mesh: Any, stage: int, stages: int, fsdp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = Stack(stage_layers(stage, stages))
    if fsdp:
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _experts(mesh: Any, placements: list, fill: bool) -> Any:
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(EXPERTS * D * D, dtype=torch.float32).reshape(EXPERTS, D, D) if fill else torch.zeros(EXPERTS, D, D)
    return distribute_tensor(full, mesh, placements)


def save_stages(rank: int, world: int, directory: str) -> dict[str, torch.Tensor]:
    """4 ranks = 2 stages x FSDP over 2; experts sharded 4 ways; per-rank experts. Returns full references."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from checkpointing import CheckpointManager

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    model, opt = _stage(mesh["dp"], stage, 2, fsdp=True)
    _train(model, opt, seed=stage)
    ep = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    own = {f"e{rank}": torch.full((D,), float(rank))}
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "experts": _experts(ep, [Shard(0)], fill=True), "own_experts": own}
    with CheckpointManager(directory, timeout_s=60) as mgr:
        mgr.save(1, state).wait()
        # the same layout restores, optimizer as an object too (its state keyed by position)
        fresh, fresh_opt = _stage(mesh["dp"], stage, 2, fsdp=True)
        positional = {"model": model, "optim": opt}
        mgr.save(2, positional).wait()
        assert mgr.restore({"model": fresh, "optim": fresh_opt}, step=2) == 2
        same = _equal(_by_name(fresh, fresh_opt), _by_name(model, opt))
    refs = _by_name(model, opt)
    refs["experts"] = _full(state["experts"])
    refs.update({f"own_experts/{k}": v for k, v in own.items()})
    return {"refs": refs, "same_layout": same}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def restore_relaid(rank: int, world: int, directory: str) -> dict[str, Any]:
    """4 ranks = 4 stages, no FSDP; experts (Shard(0), Replicate()) on a 2x2 mesh; another rank's own expert."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from checkpointing import CheckpointManager, CheckpointMismatchError

    model, opt = _stage(None, rank, 4, fsdp=False)
    msd, osd = get_state_dict(model, opt)
    experts = _experts(init_device_mesh("cpu", (2, 2)), [Shard(0), Replicate()], fill=False)
    wanted = f"e{(rank + 1) % world}"
    state = {"model": msd, "optim": osd, "experts": experts, "own_experts": {wanted: torch.zeros(D)}}
    with CheckpointManager(directory, timeout_s=60) as mgr:
        assert mgr.restore(state, step=1) == 1
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = _by_name(model, opt)
        got["experts"] = _full(experts)
        got[f"own_experts/{wanted}"] = state["own_experts"][wanted]
        _train(model, opt, seed=9)  # the restored optimizer trains on
        positional, positional_opt = _stage(None, rank, 4, fsdp=False)
        try:  # step 2 keyed optimizer state by position: at a new stage layout that cannot be matched
            mgr.restore({"model": positional, "optim": positional_opt}, step=2)
            refusal = ""
        except CheckpointMismatchError as exc:
            refusal = str(exc)
    dist.barrier()
    return {"got": got, "refusal": refusal}
