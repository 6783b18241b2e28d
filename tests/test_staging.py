"""The staging pool: bounded ring budgets, reuse across saves, and the guard's accounting."""

from __future__ import annotations

import torch

from checkpointing import CheckpointManager


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(32, 256)).square().mean().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": torch.randn(3000, 7), "empty": torch.empty(0, 5)}


def _assert_same(a: dict, b: dict) -> None:
    for k, v in a["model"].state_dict().items():
        assert torch.equal(v, b["model"].state_dict()[k]), k
    sa, sb = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert torch.equal(a["extra"], b["extra"]) and b["empty"].shape == (0, 5)


def test_ring_budget_smaller_than_the_state_round_trips(tmp_path):
    state = _state(0)
    budget = 256 << 10  # the state is ~6.4 MB: the pool wraps many times
    with CheckpointManager(tmp_path, staging_budget_bytes=budget, chunk_bytes=64 << 10) as mgr:
        stats = mgr.save(1, state).wait()
        assert mgr.staging_bytes <= budget
        assert stats.bytes_total > 20 * budget
        target = _state(1)
        assert mgr.restore(target) == 1
    _assert_same(state, target)


def test_ring_save_is_guarded_like_a_full_pool(tmp_path):
    state = _state(0)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with CheckpointManager(tmp_path, staging_budget_bytes=128 << 10, chunk_bytes=32 << 10) as mgr:
        handle = mgr.save(1, state)
        state["model"](torch.randn(32, 256)).square().mean().backward()
        state["optim"].step()  # the guard holds this until every byte is staged
        handle.wait()
        target = _state(2)
        mgr.restore(target)
    for k, v in expected.items():
        if "running" in k or "num_batches" in k:
            continue  # forward above changed BatchNorm statistics after they were copied eagerly
        assert torch.equal(target["model"].state_dict()[k], v), k


def test_pool_is_allocated_once_and_reused(tmp_path):
    state = _state(0)
    with CheckpointManager(tmp_path, keep_local=1) as mgr:
        for step in range(5):
            mgr.save(step, state).wait()
        assert mgr._pool.allocations == 1
        assert mgr.staging_bytes < 1.01 * mgr.stats()[-1].bytes_total + 64 * 16 + 4096
