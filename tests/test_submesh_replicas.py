"""FSDP over the dp dimension of a 2x2 mesh, tensor parallelism over tp on some layers, a layer TP
leaves alone (as torchtitan lays out a model): that layer's parameters are DTensors on a dp
sub-mesh, and each tp rank's dp group ([0, 2] and [1, 3]) holds the same tensor. Saved as one
tensor (not one per dp group, which read as per-rank state), they restore on another world size
and load without a process group.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from _dist import run_ranks
import checkpointing
from checkpointing import CheckpointManager
from checkpointing.format import naming


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x))))


def _build(layout: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    net = Net()
    if layout == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(net, mesh=mesh["dp"])
    else:
        fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _full(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(net, opt)
    out = {f"model/{k}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        out.update({f"optim/{fqn}/{n}": v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for n, v in st.items()})
    return out


def _save(rank: int, world: int, directory: str) -> dict[str, torch.Tensor]:
    net, opt = _build("2x2", world)
    torch.manual_seed(1)  # every rank the same batch: data parallel over dp would differ, the test does not need it
    for _ in range(2):
        net(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    with CheckpointManager(directory, timeout_s=120) as mgr:
        mgr.save(2, {"model": net, "optim": opt}).wait()
    return _full(net, opt)


def _restore(rank: int, world: int, directory: str) -> dict[str, torch.Tensor]:
    net, opt = _build("fsdp", world)
    with CheckpointManager(directory, timeout_s=120) as mgr:
        assert mgr.restore({"model": net, "optim": opt}) == 2
    return _full(net, opt)


def test_a_submesh_dtensor_replicated_across_tp_is_one_tensor_and_reshards(tmp_path):
    ck = str(tmp_path / "ck")
    saved = run_ranks(_save, 4, ck, tmp=tmp_path)
    expected = saved[0]
    for other in saved[1:]:
        assert all(torch.equal(other[k], v) for k, v in expected.items())
    [manifest_path] = (Path(ck) / naming.step_dir(2)).glob("manifest.*.json")
    keys = [t["key"] for t in json.loads(manifest_path.read_bytes())["tensors"]]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)  # head.* once, not once per dp group
    assert {"model/head.weight", "model/head.bias", "model/up.weight"} <= set(keys)

    loaded = checkpointing.load(ck)  # no process group: every tensor whole
    for k, v in expected.items():
        if k.startswith("model/"):
            assert torch.equal(loaded["model"][k.removeprefix("model/")], v), k

    for world in (1, 2):  # FSDP alone, on fewer ranks
        for rank, got in enumerate(run_ranks(_restore, world, ck, tmp=tmp_path)):
            assert sorted(got) == sorted(expected), (world, rank)
            for k, v in expected.items():
                assert torch.equal(got[k], v), f"{k} differs after restoring on {world} rank(s) (rank {rank})"
