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


def _lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(1024, 512),
    ).cuda()


def _lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(64, 256, device="cuda", generator=g)
    y = torch.randint(0, 512, (64,), device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def test_bf16_autocast_training_resumes_bit_exact_with_cuda_rng(tmp_path):
    """A bf16-autocast loop with fused AdamW and dropout (the CUDA generator), saved at steps 3 and 6:
    a fresh model, optimizer and generator restored from step 6 repeat steps 7-9 of the unbroken run
    exactly, losses and weights."""
    from checkpointing import RNGState

    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    unbroken = []
    with CheckpointManager(tmp_path) as mgr:
        for step in range(1, 10):
            loss = _lm_step(model, opt, step)
            if step > 6:
                unbroken.append(loss)
            if step in (3, 6):
                mgr.save(step, {"model": model, "optim": opt, "rng": RNGState()})
        mgr.wait()
    fresh = _lm(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, fused=True)
    torch.cuda.manual_seed_all(12345)  # the generator is elsewhere; restore must put it back
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": fresh, "optim": fresh_opt, "rng": RNGState()}) == 6
    resumed = [_lm_step(fresh, fresh_opt, s) for s in range(7, 10)]
    assert resumed == unbroken
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_restore_on_gpu_fills_the_tensors_in_place(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optim": opt}).wait()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
        for _ in range(2):
            _train_step(model, opt)
        mgr.restore({"model": model, "optim": opt})
    for k, v in model.state_dict().items():
        assert v.is_cuda and v.data_ptr() == ptrs[k], k
        assert torch.equal(v, expected[k]), k


def test_incremental_save_on_gpu_writes_only_what_changed(tmp_path):
    """Both Linear layers frozen (fine-tuning the BatchNorm only): the second save takes their chunks
    from the first step's file (matched by digest: CUDA bytes reach the host only through the copy)
    and writes the rest; both steps restore exactly."""
    model = _model()
    frozen_params = [*model[0].parameters(), *model[3].parameters()]
    for p in frozen_params:
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    _train_step(model, opt)
    with CheckpointManager(tmp_path) as mgr:
        first = mgr.save(1, {"model": model}).wait()
        one = {k: v.clone() for k, v in model.state_dict().items()}
        _train_step(model, opt)
        second = mgr.save(2, {"model": model}).wait()
        frozen = sum(p.numel() * p.element_size() for p in frozen_params)
        assert first.bytes_reused == 0 and second.bytes_reused >= frozen * 0.9, (second.bytes_reused, frozen)
        assert second.bytes_written < first.bytes_written - frozen * 0.9
        for step, want in ((1, one), (2, model.state_dict())):
            fresh = _model(seed=7)
            mgr.restore({"model": fresh}, step=step)
            for k, v in want.items():
                assert torch.equal(fresh.state_dict()[k], v), (step, k)


def test_mixed_dtypes_views_and_shared_storage_on_gpu(tmp_path):
    base = torch.randn(64, 48, device="cuda")
    state = {
        "bf16": torch.randn(33, 17, device="cuda").to(torch.bfloat16),
        "half": torch.randn(1000, device="cuda").half(),
        "int8": torch.randint(-128, 127, (4096,), dtype=torch.int8, device="cuda"),
        "bool": torch.rand(77, device="cuda") > 0.5,
        "transposed": base.t(),
        "slice": base[5:20, 3:40],
        "scalar": torch.tensor(3.5, device="cuda"),
        "empty": torch.empty(0, 8, device="cuda"),
    }
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, state).wait()
        base.add_(1.0)  # the live tensors move on after the save
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        mgr.restore(target)
    for k, v in expected.items():
        assert target[k].is_cuda and target[k].dtype == v.dtype and torch.equal(target[k], v), k
