"""Restore maps what users hold onto what was saved, and never skips in silence.

Compiled and plain modules (`_orig_mod.`), a module and its state_dict() map onto each other both
ways; only=/exclude= restore part of a state and leave the rest as it is; inside a selection a key
on one side only is still an error; a pattern that matches nothing is an error, not a no-op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from checkpointing import CheckpointManager, CheckpointMismatchError


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa.values(), sb.values()))


@pytest.fixture
def mgr(tmp_path):
    with CheckpointManager(tmp_path / "ck") as m:
        yield m


def test_compiled_and_plain_modules_restore_into_each_other(mgr):
    saved = Net(0)
    mgr.save(1, {"model": torch.compile(saved)}).wait()
    assert list(torch.compile(saved).state_dict())[0].startswith("_orig_mod.")
    plain = Net(1)
    mgr.restore({"model": plain})
    assert _same(plain, saved)
    mgr.save(2, {"model": saved}).wait()
    compiled = torch.compile(Net(2))
    mgr.restore({"model": compiled}, step=2)
    assert _same(compiled._orig_mod, saved)
    blockwise = Net(3)
    blockwise.layers[0] = torch.compile(blockwise.layers[0])  # per-block compile: layers.0._orig_mod.weight
    mgr.restore({"model": blockwise}, step=1)
    assert torch.equal(blockwise.layers[0]._orig_mod.weight, saved.layers[0].weight)


def test_a_module_and_its_state_dict_restore_into_each_other(mgr):
    saved = Net(0)
    mgr.save(1, {"model": saved}).wait()
    sd = Net(1).state_dict()
    mgr.restore({"model": sd})
    assert all(torch.equal(sd[k], v) for k, v in saved.state_dict().items())
    mgr.save(2, {"model": saved.state_dict()}).wait()
    module = Net(2)
    mgr.restore({"model": module}, step=2)
    assert _same(module, saved)


def test_only_and_exclude_restore_part_and_keep_the_rest(mgr):
    model = Net(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    mgr.save(1, {"model": model, "optim": opt, "epoch": 4}).wait()

    fresh = Net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    state = {"model": fresh, "optim": fresh_opt, "epoch": 0}
    mgr.restore(state, only="model")
    assert _same(fresh, model) and fresh_opt.state_dict()["state"] == {} and state["epoch"] == 0

    mgr.restore(state, exclude=["optim"])
    assert state["epoch"] == 4 and fresh_opt.state_dict()["state"] == {}

    first = Net(2)
    kept = first.layers[1].weight.detach().clone()
    mgr.restore({"model": first}, only="model/layers.0.*")
    assert torch.equal(first.layers[0].weight, model.layers[0].weight) and torch.equal(first.layers[1].weight, kept)

    # the target without an optimizer: only= says so, where strict=False would have skipped keys in silence
    mgr.restore({"model": Net(3)}, only="model")


def test_inside_a_selection_strict_still_holds(mgr):
    mgr.save(1, {"model": Net(0), "epoch": 1}).wait()
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": Net(1), "ema": torch.zeros(3)}, only=["model", "ema"])
    assert "ema: missing from the checkpoint" in str(info.value)
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": Net(1)})
    text = str(info.value)
    assert "epoch" in text and "only=" in text and "strict=False" not in text


def test_a_pattern_that_matches_nothing_is_an_error(mgr):
    model = Net(0)
    mgr.save(1, {"model": model}).wait()
    target = Net(1)
    with pytest.raises(CheckpointMismatchError, match="'modle'.*matches no key.*'model'"):
        mgr.restore({"model": target}, only="modle")
    with pytest.raises(CheckpointMismatchError, match="'optimizer'.*matches no key"):
        mgr.restore({"model": target}, exclude="optimizer")
    assert not _same(target, model)
