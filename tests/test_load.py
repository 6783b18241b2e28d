"""checkpointing.load(): a step as a fresh dict, read-only, verified, reading only the selected keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import _dist
from _dist import run_ranks
from hostile import flip_bits
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import checkpointing
from checkpointing import CheckpointConfigError, CheckpointCorruptError, CheckpointManager, CheckpointMismatchError, CheckpointNotFoundError


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 8)).square().sum().backward()
    opt.step()
    return model, opt


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _chunks_of(root: Path, step: int, prefix: str) -> list[tuple[str, int, int]]:
    manifest_path = next((root / f"step-{step:010d}").glob("manifest.*.json"))
    manifest = json.loads(manifest_path.read_bytes())
    out = []
    for t in manifest["tensors"]:
        if t["key"].startswith(prefix):
            for shard in t["shards"]:
                out += [(c[0], c[1], c[2]) for c in shard["chunks"]]
    return out


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained()
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(3, {"model": model, "optim": opt, "epoch": 7, "name": "run-a"}).wait()
        mgr.save(5, {"model": model, "optim": opt, "epoch": 8, "name": "run-a"}).wait()
    return tmp_path / "ck", model, opt


def test_load_returns_the_newest_step_as_plain_dicts_and_touches_nothing(saved):
    root, model, opt = saved
    before = _tree(root)
    state = checkpointing.load(root)
    assert _tree(root) == before
    assert state["epoch"] == 8 and state["name"] == "run-a"
    assert state["model"].keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v) and state["model"][k].device.type == "cpu"
    expected = opt.state_dict()
    assert state["optim"]["param_groups"] == expected["param_groups"]
    for i, st in expected["state"].items():
        for k, v in st.items():
            assert torch.equal(state["optim"]["state"][i][k], v)
    assert checkpointing.load(root, step=3)["epoch"] == 7


def test_key_selection_reads_only_the_selected_bytes(saved):
    root, model, _ = saved
    # damage every chunk of the optimizer: a model-only load never reads them, a full load finds them
    for file, offset, _length in _chunks_of(root, 5, "optim/"):
        flip_bits(root / file, offset + 1)
    model_only = checkpointing.load(root, keys="model")
    assert list(model_only) == ["model"]
    assert all(torch.equal(model_only["model"][k], v) for k, v in model.state_dict().items())
    assert set(checkpointing.load(root, exclude=["optim"])) == {"model", "epoch", "name"}
    assert set(checkpointing.load(root, keys=["model/0.*", "epoch"])["model"]) == {"0.weight", "0.bias"}
    with pytest.raises(CheckpointCorruptError, match="optim"):
        checkpointing.load(root)


def test_load_errors_say_what_and_how(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(CheckpointNotFoundError, match="step 4 is not committed.*3, 5"):
        checkpointing.load(root, step=4)
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        checkpointing.load(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed step"):
        checkpointing.load(tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []
    with pytest.raises(CheckpointConfigError, match="storage_options"):
        checkpointing.load(root, storage_options={"key": "x"})
    with pytest.raises(TypeError, match="glob patterns"):
        checkpointing.load(root, keys=[3])


def test_load_passes_over_a_newest_step_whose_data_is_damaged_as_restore_does(tmp_path, caplog):
    root = tmp_path / "ck"
    with CheckpointManager(root, keep_local=None) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((1000,), float(s))}).wait()
    for s in (2, 3):
        flip_bits(next((root / f"step-{s:010d}").glob("r*.pack")), 10)
    assert torch.equal(checkpointing.load(root)["w"], torch.full((1000,), 1.0))
    assert "passes over step 3" in caplog.text and "passes over step 2" in caplog.text
    with pytest.raises(CheckpointCorruptError, match="step 3, tensor 'w'.*damaged"):  # a step asked for by name: its damage
        checkpointing.load(root, step=3)
    with pytest.raises(CheckpointConfigError, match="storage_options"):  # positional, as ARCHITECTURE.md writes it
        checkpointing.load(root, None, {"key": "x"})


def test_per_rank_values_need_a_rank(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(_dist.per_rank_state, 2, ck, "save-sharded", tmp=tmp_path)
    with pytest.raises(CheckpointMismatchError) as info:
        checkpointing.load(ck)
    assert "rng" in str(info.value) and "loader/pos" in str(info.value) and "rank=" in str(info.value)
    assert "as load() was asked" in str(info.value) and "passed to restore" not in str(info.value)  # load() takes no state
    assert checkpointing.load(ck, keys="shared")["shared"].tolist() == [0, 1, 2, 3]
    for rank in (0, 1):
        state = checkpointing.load(ck, rank=rank)
        assert state["rng"].tolist() == [float(rank)] * 3 and state["loader"] == {"pos": 10 * rank, "seed": 7}
        assert torch.equal(state["sharded"], torch.arange(12.0).reshape(6, 2))  # sharded tensors come back whole
    with pytest.raises(CheckpointConfigError, match="saved by 2 rank"):
        checkpointing.load(ck, rank=2)


def test_load_from_s3(tmp_path, s3_bucket):
    url, options = s3_bucket
    model, opt = _trained()
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=options) as mgr:
        mgr.save(1, {"model": model, "optim": opt}).wait()
    state = checkpointing.load(url, storage_options=options, keys="model")
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("step", ["4", 4.0, -1, True])
def test_a_step_that_is_not_a_step_number_is_refused_by_restore_and_load(tmp_path, step):
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(4, {"x": torch.ones(2)}).wait()
        with pytest.raises(CheckpointConfigError, match=r"is invalid: pass an int in 0\.\."):
            mgr.restore({"x": torch.zeros(2)}, step=step)
    with pytest.raises(CheckpointConfigError, match=r"is invalid: pass an int in 0\.\."):
        checkpointing.load(tmp_path / "ck", step=step)
    with pytest.raises(TypeError, match="glob patterns"):
        checkpointing.load(tmp_path / "ck", keys=5)
