"""Pipeline stages and expert shards: per-stage keys save, restore on the same layout, on a new stage
count (keys mapped by name), and in one process; what cannot be mapped is refused by name."""

from __future__ import annotations

import pytest
import torch

import _pipeline
from _dist import run_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    directory = str(tmp / "ck")
    results = run_ranks(_pipeline.save_stages, 4, directory, tmp=tmp)
    refs: dict[str, torch.Tensor] = {}
    for r in results:
        refs.update(r["refs"])
    return directory, refs, results


def test_each_stage_saves_its_own_keys_and_restores_on_the_same_layout(saved):
    directory, refs, results = saved
    assert all(r["same_layout"] for r in results)
    assert {k for k in refs if k.startswith("model/")} == {f"model/layers.{i}.{p}" for i in range(4) for p in ("weight", "bias")}


def test_a_new_stage_count_maps_keys_by_name_and_refuses_positional_optimizer_state(saved, tmp_path):
    directory, refs, _ = saved
    results = run_ranks(_pipeline.restore_relaid, 4, directory, tmp=tmp_path)
    for rank, r in enumerate(results):
        assert r["got"], rank
        for key, value in r["got"].items():
            assert torch.equal(value, refs[key]), (rank, key)
        assert f"model/layers.{rank}.weight" in r["got"]
        assert "pipeline stages laid out anew" in r["refusal"] and "optim/state/0" in r["refusal"]


def test_one_process_restores_every_stage_and_every_expert(saved):
    from checkpointing import CheckpointManager

    directory, refs, _ = saved
    model, opt = _pipeline._stage(None, 0, 1, fsdp=False)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "experts": torch.zeros(4, 6, 6), "own_experts": {f"e{r}": torch.zeros(6) for r in range(4)}}
    with CheckpointManager(directory) as mgr:
        assert mgr.restore(state, step=1) == 1
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = _pipeline._by_name(model, opt)
    assert got.keys() == {k for k in refs if k.startswith(("model/", "optim/"))}
    for key, value in got.items():
        assert torch.equal(value, refs[key]), key
    assert torch.equal(state["experts"], refs["experts"])
    for r in range(4):
        assert torch.equal(state["own_experts"][f"e{r}"], refs[f"own_experts/e{r}"])


def test_keys_no_stage_saved_are_named(saved):
    from checkpointing import CheckpointManager, CheckpointMismatchError

    directory, _, _ = saved
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({str(i): torch.nn.Linear(6, 6) for i in range(5)})})
    with CheckpointManager(directory) as mgr, pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": model.state_dict()}, step=1)
    text = str(info.value)
    assert "model/layers.4.weight: missing from the checkpoint" in text and "layers.4.bias" in text
    assert "layers.3.weight" not in text


def test_one_process_refuses_the_stages_positional_optimizer_state_before_touching_the_model(saved):
    import pytest

    from checkpointing import CheckpointManager, CheckpointMismatchError

    directory, _, _ = saved
    model, opt = _pipeline._stage(None, 0, 1, fsdp=False)  # every layer, one optimizer over all of them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(directory, read_only=True) as mgr, pytest.raises(CheckpointMismatchError) as info:
        mgr.restore({"model": model, "optim": opt}, step=2)  # step 2: each stage's optimizer object, keyed by position
    assert "optim/param_groups: saved with 1 parameter group(s)" in str(info.value) and "get_state_dict" in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}
