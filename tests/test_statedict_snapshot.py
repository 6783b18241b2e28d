"""State dicts take the low-stall path: tensors that share memory with a watched optimizer's
parameters or state are copied after save() returns, and the snapshot still holds the values of
save() time when optimizer.step() runs right after (the guard holds it)."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.optim import optimizer as torch_optimizer

import checkpointing
from checkpointing import CheckpointManager
from checkpointing.save.stepped import SteppedOptimizers
from checkpointing.state.tree import flatten_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _param_and_state_bytes(model, opt) -> int:
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return _nbytes(model.parameters()) + _nbytes(state)


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if torch.is_tensor(tree) else tree


def _assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_watched_storages_are_the_optimizers_parameters_and_state():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped = SteppedOptimizers()
    assert set(stepped.storages()) == set()
    stepped.saw_in({"model": model, "optim": opt, "epoch": 3})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert set(stepped.storages()) == params  # no state before the first step
    _train_step(model, opt, 0)
    state = {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()}
    assert set(stepped.storages()) == params | state
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    assert not buffers & set(stepped.storages())
    del opt
    gc.collect()
    assert set(stepped.storages()) == set()  # a dropped optimizer is forgotten


def test_flatten_defers_state_dict_tensors_of_watched_storages_only():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    stepped = SteppedOptimizers()
    stepped.saw(opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "copy": model[0].weight.detach().clone()}
    flat = flatten_state(state, watched=stepped.storages())
    deferred = {leaf.key for leaf in flat.leaves if leaf.deferred}
    eager = {leaf.key for leaf in flat.leaves if not leaf.deferred}
    assert "model/0.weight" in deferred and "optim/state/0/exp_avg" in deferred and "optim/state/0/step" in deferred
    assert {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked"} <= eager  # change in forward
    assert "copy" in eager  # its own memory: nothing guards it
    assert not any(leaf.deferred for leaf in flatten_state(state, watched=stepped.storages(), eager=True).leaves)
    assert not any(leaf.deferred for leaf in flatten_state(state).leaves)  # nothing watched: all eager


def test_state_dicts_defer_like_objects_and_keep_save_time_values(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "ckpt", keep_local=None, incremental=False) as mgr:
        _train_step(model, opt, 0)  # the guard sees the optimizer step
        expected = {}
        for step in (1, 2, 3):
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            expected[step] = _clone(state)
            mgr.save(step, state)
            _train_step(model, opt, step)  # mutates every parameter and moment right after save() returns
        mgr.wait()
        stats = {s.step: s for s in mgr.stats()}
    deferred = _param_and_state_bytes(model, opt)
    for step in (1, 2, 3):
        assert stats[step].bytes_deferred == deferred, step
        _assert_same(checkpointing.load(tmp_path / "ckpt", step), expected[step], f"step {step}")


def test_dcp_get_state_dict_output_defers_and_restores(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        _train_step(model, opt, 1)
        msd, osd = get_state_dict(model, opt)
        expected = _clone({"model": msd, "optim": osd})
        mgr.save(5, {"model": msd, "optim": osd})
        _train_step(model, opt, 2)
        mgr.wait()
        assert mgr.stats()[-1].bytes_deferred == _param_and_state_bytes(model, opt)
    _assert_same(checkpointing.load(tmp_path / "ckpt", 5), expected)


def test_first_save_before_any_step_is_eager_unless_the_optimizer_is_passed(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CheckpointManager(tmp_path / "a") as mgr:
        mgr.save(1, {"model": model.state_dict()}).wait()
        assert mgr.stats()[-1].bytes_deferred == 0  # no optimizer known to guard these parameters yet
    with CheckpointManager(tmp_path / "b") as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": opt}).wait()
        assert mgr.stats()[-1].bytes_deferred == _nbytes(model.parameters())


def test_eager_mode_copies_state_dicts_inside_save(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path / "ckpt", snapshot="eager") as mgr:
        _train_step(model, opt, 0)
        mgr.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        assert mgr.stats()[-1].bytes_deferred == 0


def test_what_changes_outside_optimizer_step_is_copied_before_save_returns(tmp_path):
    """A tensor lr (scheduler.step() writes it in place), an embedding a forward renormalizes
    (max_norm), and parameters a global pre-hook registered before the manager scales: each step
    holds the values of the save() call."""
    torch.manual_seed(0)
    emb = nn.Embedding(512, 16, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(4.0)  # rows longer than max_norm: a forward rewrites the rows it looks up
    model = nn.Sequential(emb, nn.Flatten(), nn.Linear(16 * 4, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)

    def decay(optimizer, args, kwargs):  # decoupled weight decay as a global pre-hook, registered first
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.mul_(0.9)

    hook = torch_optimizer.register_optimizer_step_pre_hook(decay)
    try:
        flat = flatten_state({"model": model, "optim": opt})
        eager = {leaf.key for leaf in flat.leaves if not leaf.deferred}
        assert {"model/0.weight", "optim/param_groups/0/lr"} <= eager and "model/2.weight" not in eager
        with CheckpointManager(tmp_path / "ckpt", keep_local=None, incremental=False) as mgr:
            expected = {}
            for step in (1, 2, 3):
                idx = torch.randint(0, 512, (8, 4), generator=torch.Generator().manual_seed(step))
                model(idx).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                state = {"model": model, "optim": opt, "sched": sched}
                expected[step] = _clone({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()})
                h = mgr.save(step, state)
                sched.step()  # the lr tensor, in place
                model(idx).sum().backward()  # the embedding rows, in place
                opt.step()  # the pre-hook scales every parameter before the guard would have waited
                opt.zero_grad()
                h.wait()
            assert next(iter(torch_optimizer._global_optimizer_pre_hooks.values())) == mgr._on_optimizer_step
        for step in (1, 2, 3):
            _assert_same(checkpointing.load(tmp_path / "ckpt", step), expected[step], f"step {step}")
    finally:
        hook.remove()


def test_lazy_and_meta_tensors_are_refused_naming_the_key(tmp_path):
    import pytest

    from checkpointing import CheckpointMismatchError
    from checkpointing.errors import StateError

    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(StateError, match=r"state\['model/1.weight'\] is an uninitialized parameter .*forward pass"):
            mgr.save(1, {"model": nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(8))})
        mgr.save(1, {"model": nn.Linear(4, 4)}).wait()
        with torch.device("meta"):
            meta = nn.Linear(4, 4)
        with pytest.raises(CheckpointMismatchError, match=r"model/weight: .*on the meta device: materialize it first"):
            mgr.restore({"model": meta})
        with pytest.raises(CheckpointMismatchError, match=r"model/weight: .*uninitialized lazy parameter"):
            mgr.restore({"model": nn.LazyLinear(4)})
