"""A parameter whose data is a tensor subclass (nn.Parameter(TwoTensor), as quantized and wrapper weights are) is
refused by key with a clear error, saved as a module or restored into, never a raw RuntimeError or a read into address 0."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from checkpointing import CheckpointError, CheckpointManager, StateError


def _wrapped() -> torch.nn.Linear:
    m = torch.nn.Linear(4, 2)
    m.weight = torch.nn.Parameter(TwoTensor(torch.randn(2, 4), torch.randn(2, 4)), requires_grad=False)
    return m


@pytest.mark.parametrize("snapshot", ["async", "eager"])
def test_saving_a_module_with_a_subclass_parameter_is_refused_by_key(tmp_path, snapshot):
    with CheckpointManager(tmp_path, snapshot=snapshot) as mgr:
        with pytest.raises(StateError, match=r"state\['model/weight'\] is a .*TwoTensor.*tensor subclasses are not supported"):
            mgr.save(1, {"model": _wrapped()})
        mgr.save(1, {"model": torch.nn.Linear(4, 2)}).wait()  # the manager goes on


def test_restoring_into_a_subclass_parameter_is_refused_before_anything_is_read(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(4, 2)}).wait()
        target = _wrapped()
        before = target.bias.clone()
        with pytest.raises(CheckpointError, match="model/weight: the target is a .*TwoTensor: a tensor subclass"):
            mgr.restore({"model": target})
        assert torch.equal(target.bias, before)
