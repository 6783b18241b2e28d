"""Optimizer state saved keyed by position (the optimizer object, `Optimizer.state_dict()`) restores
into a target keyed by parameter name (torch.distributed.checkpoint's `get_state_dict`), and back:
the groups list the same parameters in the same order (restore/optim_keys.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpointing import CheckpointManager, CheckpointMismatchError


def _build(width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    return net, torch.optim.AdamW([{"params": net[0].parameters(), "lr": 0.01}, {"params": net[2].parameters(), "lr": 0.02}])


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    net, opt = _build()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        net(torch.randn(5, 4, generator=gen)).sum().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _assert_same_optimizer(a: dict, b: dict) -> None:
    assert sorted(a["state"]) == sorted(b["state"])
    for i, st in a["state"].items():
        assert all(torch.equal(st[k], b["state"][i][k]) for k in st), i
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]


def test_the_optimizer_object_restores_into_get_state_dict_targets_and_back(tmp_path):
    net, opt = _trained()
    expected = copy.deepcopy(opt.state_dict())
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": net, "optim": opt}).wait()  # keyed by position
        net2, opt2 = _build()
        msd, osd = get_state_dict(net2, opt2)  # keyed by name ("0.weight"); DCP gives it state to fill
        assert mgr.restore({"model": msd, "optim": osd}) == 1
        assert [g["params"] for g in osd["param_groups"]] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]  # its own keying
        set_state_dict(net2, opt2, model_state_dict=msd, optim_state_dict=osd)
        _assert_same_optimizer(opt2.state_dict(), expected)

        msd1, osd1 = get_state_dict(net, opt)
        mgr.save(2, {"model": msd1, "optim": osd1}).wait()  # keyed by name
        net3, opt3 = _build()  # a fresh optimizer object: no state yet, positions in its groups
        assert mgr.restore({"model": net3, "optim": opt3}, step=2) == 2
        _assert_same_optimizer(opt3.state_dict(), expected)
        assert all(torch.equal(a, b) for a, b in zip(net3.parameters(), net.parameters()))


def test_groups_of_other_sizes_are_not_mapped_by_position(tmp_path):
    net, opt = _trained()
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"optim": opt}).wait()
        other = nn.Linear(4, 2)
        opt_other = torch.optim.AdamW([{"params": [other.weight]}, {"params": [other.bias]}, {"params": []}])
        _, osd = get_state_dict(other, opt_other)
        with pytest.raises(CheckpointMismatchError):
            mgr.restore({"optim": osd})


def test_an_optimizer_of_other_groups_or_another_class_is_refused_before_the_model_is_touched(tmp_path):
    net, opt = _trained()
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": net, "optim": opt}).wait()
    fresh = _build()[0]
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(42.0)
    one_group = torch.optim.AdamW(fresh.parameters())  # 1 group of 4 where 2 groups of 2 were saved
    sgd = torch.optim.SGD([{"params": fresh[0].parameters()}, {"params": fresh[2].parameters()}], lr=0.1, momentum=0.9)
    for target, said in ((one_group, "optim/param_groups: saved with 2 parameter group(s) of [2, 2] parameters, the target optimizer has 1 of [4]"),
                         (sgd, "optim: saved from a torch.optim.adamw.AdamW, the target is a torch.optim.sgd.SGD")):
        with CheckpointManager(tmp_path / "ck") as mgr, pytest.raises(CheckpointMismatchError) as err:
            mgr.restore({"model": fresh, "optim": target})
        assert said in str(err.value) and "exclude=['optim']" in str(err.value)
        assert all(bool((p == 42.0).all()) for p in fresh.parameters())  # nothing was read into the model
        assert target.state_dict()["state"] == {}
    with CheckpointManager(tmp_path / "ck") as mgr:  # leaving the optimizer out restores the model
        assert mgr.restore({"model": fresh, "optim": sgd}, exclude="optim") == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), net.parameters()))
