"""The staging pool: bounded ring budgets, reuse across saves, and the guard's accounting."""

from __future__ import annotations

import pytest
import torch

import checkpointing

from checkpointing import CheckpointManager
from checkpointing.save.staging import StagingPool


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


def test_a_state_that_shrank_gives_its_staging_memory_back_and_one_that_varies_a_little_keeps_its_pool(tmp_path):
    big, small = {"w": torch.randn(1 << 20)}, {"w": torch.randn(1000)}  # 4 MiB, then 4000 bytes
    with CheckpointManager(tmp_path, keep_local=1) as mgr:
        mgr.save(1, big).wait()
        assert mgr.staging_bytes == 4 << 20
        mgr.save(2, {"w": torch.randn((1 << 20) - 4096)}).wait()  # a little smaller: the same pool
        assert mgr.staging_bytes == 4 << 20 and mgr._pool.allocations == 1
        for step in range(3, 6):
            mgr.save(step, small).wait()
        assert mgr.staging_bytes == 4000 and mgr._pool.allocations == 2  # given back once, then reused
        mgr.save(6, big).wait()
        assert mgr.staging_bytes == 4 << 20
    assert torch.equal(checkpointing.load(tmp_path)["w"], big["w"])


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="the kernel offers no transparent huge pages")
def test_the_pool_is_backed_by_huge_pages_and_keeps_its_exact_size():
    """The pool asks for huge pages (faster, steadier O_DIRECT writes) but is not rounded up to
    them: a staging budget is a limit."""
    pool = StagingPool()
    nbytes = (16 << 20) + 4096 * 3
    pool.ensure(nbytes, pinned=False)
    try:
        assert pool.capacity == nbytes and len(pool.view) == nbytes
        huge_kib = None
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= pool.address < hi
                elif inside and head == "AnonHugePages:":
                    huge_kib = int(line.split()[1])
                    break
        assert huge_kib is not None and huge_kib >= 2048 * 6, huge_kib  # at least 6 of its 8 aligned 2 MiB ranges
        pool.view[:4] = b"abcd"  # writable, faulted in
        assert bytes(pool.view[:4]) == b"abcd"
    finally:
        pool.release()
