"""The CUDA path: pinned staging, side-stream copies, event ordering, guard, restore onto the GPU.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest -m cuda`.
"""

from __future__ import annotations

import pytest
import torch

from checkpointing import CheckpointManager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_pinned_staging_and_bit_exact_round_trip(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt}).wait()
        assert mgr._pool.pinned and mgr._pool.tensor(0, 16).is_pinned()
        fresh = _model(seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        assert mgr.restore({"model": fresh, "optim": fresh_opt}) == 1
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b), k
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v.cpu(), fresh_opt.state_dict()["state"][i][k].cpu())


def test_guard_orders_the_copy_before_the_optimizer_step(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    _train_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            handle = mgr.save(step, {"model": model})
            _train_step(model, opt)  # mutates every parameter right after save() returns
            handle.wait()
            restored = _model(seed=5)
            mgr.restore({"model": restored}, step=step)
            for k, v in expected.items():
                assert torch.equal(restored.state_dict()[k], v), (step, k)
            expected = {k: v.clone() for k, v in model.state_dict().items()}


def test_buffers_changed_in_forward_are_copied_eagerly(tmp_path):
    model = _model()
    model.train()
    with CheckpointManager(tmp_path) as mgr:
        before = model[1].running_mean.clone()
        handle = mgr.save(0, {"model": model})
        model(torch.randn(64, 1024, device="cuda"))  # BatchNorm updates running stats in forward
        handle.wait()
        restored = _model(seed=3)
        mgr.restore({"model": restored})
    assert torch.equal(restored[1].running_mean, before)


def test_cpu_checkpoint_restores_onto_gpu_and_back(tmp_path):
    cpu_model = _model().cpu()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"model": cpu_model, "t": torch.arange(10)}).wait()
        gpu_model = _model(seed=2)
        t = torch.zeros(10, dtype=torch.int64, device="cuda")
        mgr.restore({"model": gpu_model, "t": t})
    assert t.is_cuda and torch.equal(t.cpu(), torch.arange(10))
    for k, v in cpu_model.state_dict().items():
        assert torch.equal(gpu_model.state_dict()[k].cpu(), v), k


def test_bounded_ring_on_gpu(tmp_path):
    model = _model()
    with CheckpointManager(tmp_path, staging_budget_bytes=4 << 20, chunk_bytes=1 << 20) as mgr:
        mgr.save(0, {"model": model}).wait()
        assert mgr.staging_bytes <= 4 << 20
        restored = _model(seed=9)
        mgr.restore({"model": restored})
    for k, v in model.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v), k
