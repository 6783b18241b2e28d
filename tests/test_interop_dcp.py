"""torch.distributed.checkpoint loads our checkpoints through `checkpointing.interop.dcp.CheckpointReader`.

Real DCP (`dcp.load`, its default planner, its resharding), real models and optimizers, real gloo
processes on 127.0.0.1 for the sharded targets, a moto S3 server on loopback; nothing mocked.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import _dist
from _dist import run_ranks
from hostile import flip_bits
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

from checkpointing import CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointManager, CheckpointNotFoundError
from checkpointing.interop.dcp import CheckpointReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    for _ in range(2):
        model(torch.randn(5, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(99)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(5, 6)).sum().backward()  # AdamW state exists: DCP loads tensors in place
    opt.step()
    opt.zero_grad()
    return model, opt


def _cause(info: pytest.ExceptionInfo) -> BaseException:
    """The error read_data raised on rank 0, out of DCP's CheckpointException (DCP wraps every rank's failure)."""
    return info.value.failures[0][0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _same_optim(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        _same(a["state"][i], b["state"][i])


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]]]:
    """Step 1: model and optimizer saved as objects; step 2: as plain state dicts (other values)."""
    root = tmp_path / "ck"
    first, second = _trained(0), _trained(1)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": first[0], "optim": first[1], "epoch": 3, "tag": ("run", 7)}).wait()
        mgr.save(2, {"model": second[0].state_dict(), "optim": second[1].state_dict(), "epoch": 4, "tag": ("run", 8)}).wait()
    return root, {1: first, 2: second}


def test_model_and_optimizer_load_bit_exact_with_primitives(saved):
    root, runs = saved
    for step in (1, 2):  # saved as objects / as state dicts: the same names to DCP
        model, opt = _fresh()
        state = {"model": model.state_dict(), "optim": opt, "epoch": 0, "tag": None}
        reader = CheckpointReader(root, step=step)
        dcp.load(state, storage_reader=reader, no_dist=True)
        model.load_state_dict(state["model"])
        _same(runs[step][0].state_dict(), model.state_dict())
        _same_optim(runs[step][1].state_dict(), opt.state_dict())  # lr and betas (a tuple) came back too
        assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.95)
        assert state["epoch"] == 2 + step and state["tag"] == ("run", 6 + step)
        assert reader.step == step and reader.bytes_read > 0


def test_newest_step_by_default_and_checkpoint_id_resets(saved, tmp_path):
    root, runs = saved
    model, _ = _fresh()
    sd = {"model": model.state_dict()}
    reader = CheckpointReader(root)
    assert reader.step == 2 and CheckpointReader.validate_checkpoint_id(root)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    _same(runs[2][0].state_dict(), sd["model"])
    other = tmp_path / "other"
    third = _trained(5)[0]
    with CheckpointManager(other) as mgr:
        mgr.save(9, {"model": third}).wait()
    dcp.load(sd, storage_reader=reader, checkpoint_id=other, no_dist=True)  # DCP calls reader.reset(other)
    assert reader.step == 9
    _same(third.state_dict(), sd["model"])


def test_metadata_names_and_unflattening_match_dcp(saved):
    root, runs = saved
    md = CheckpointReader(root, step=1).read_metadata()
    weight = md.state_dict_metadata["model.0.weight"]
    assert isinstance(weight, TensorStorageMetadata) and tuple(weight.size) == (12, 6) and weight.properties.dtype == torch.float32
    assert [tuple(c.offsets) for c in weight.chunks] == [(0, 0)]
    assert isinstance(md.state_dict_metadata["optim.state.0.exp_avg"], TensorStorageMetadata)
    for name in ("epoch", "tag", "optim.param_groups.0.lr", "optim.param_groups.0.params"):
        assert isinstance(md.state_dict_metadata[name], BytesStorageMetadata), name
    # DCP's own "load everything" planner rebuilds the nested dict from our planner_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        everything = _load_state_dict_from_keys(storage_reader=CheckpointReader(root, step=1))
    _same(runs[1][0].state_dict(), everything["model"])
    assert everything["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3] and everything["epoch"] == 3


def test_optimizer_by_parameter_name_with_param_names(saved):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root, runs = saved
    model, opt = _fresh()
    msd, osd = get_state_dict(model, opt)  # DCP's form: optimizer state keyed by parameter name
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(CheckpointException, match="Missing key.*optim.state.0.weight"):  # ids, not names, without param_names
        dcp.load({"model": msd, "optim": osd}, storage_reader=CheckpointReader(root, step=1), no_dist=True)
    dcp.load({"model": msd, "optim": osd}, storage_reader=CheckpointReader(root, step=1, param_names={"optim": names}), no_dist=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _same(runs[1][0].state_dict(), model.state_dict())
    _same_optim(runs[1][1].state_dict(), opt.state_dict())
    with pytest.raises(CheckpointConfigError, match="gives 2 names"):
        CheckpointReader(root, param_names={"optim": names[:2]})
    with pytest.raises(CheckpointConfigError, match="does not hold"):
        CheckpointReader(root, param_names={"opt": names})
    # get_state_dict's own output saved by us: keyed by name already, it maps with no help
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"model": msd, "optim": osd}).wait()
    model2, opt2 = _fresh()
    msd2, osd2 = get_state_dict(model2, opt2)
    dcp.load({"model": msd2, "optim": osd2}, storage_reader=CheckpointReader(root), no_dist=True)
    set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    _same(model.state_dict(), model2.state_dict())
    _same_optim(opt.state_dict(), opt2.state_dict())
    with pytest.raises(CheckpointConfigError, match="keyed by parameter name already"):
        CheckpointReader(root, param_names={"optim": names})


def test_missing_step_and_places_are_clear_errors(saved, tmp_path):
    root, _ = saved
    with pytest.raises(CheckpointNotFoundError, match="step 5 is not committed.*1, 2"):
        CheckpointReader(root, step=5)
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        CheckpointReader(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed step"):
        CheckpointReader(tmp_path / "empty")
    assert not CheckpointReader.validate_checkpoint_id(tmp_path / "empty")
    assert not (tmp_path / "nowhere").exists()


def test_a_damaged_chunk_is_refused(saved):
    root, _ = saved
    commit = json.loads((root / "step-0000000002" / "COMMIT").read_text())
    manifest = json.loads((root / commit["manifest"]).read_text())
    weight = next(t for t in manifest["tensors"] if t["key"] == "model/2.weight")
    file, offset, _length, _digest = weight["shards"][0]["chunks"][0]
    flip_bits(root / file, offset + 3)
    model, _ = _fresh()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"model": model.state_dict()}, storage_reader=CheckpointReader(root), no_dist=True)
    assert isinstance(_cause(info), CheckpointCorruptError) and "model/2.weight" in str(_cause(info)) and "damaged" in str(_cause(info))
    # the undamaged keys still load
    sd = {"model": {"0.weight": torch.zeros(12, 6)}}
    dcp.load(sd, storage_reader=CheckpointReader(root), no_dist=True)
    assert sd["model"]["0.weight"].abs().sum() > 0


def test_load_from_s3(tmp_path, s3_bucket):
    url, options = s3_bucket
    model, opt = _trained(3)
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=options) as mgr:
        mgr.save(4, {"model": model, "optim": opt, "epoch": 11}).wait()
    target, target_opt = _fresh()
    state = {"model": target.state_dict(), "optim": target_opt, "epoch": 0}
    reader = CheckpointReader(url, storage_options=options)
    assert options["secret"] not in reader.checkpoint_id
    dcp.load(state, storage_reader=reader, no_dist=True)
    target.load_state_dict(state["model"])
    _same(model.state_dict(), target.state_dict())
    _same_optim(opt.state_dict(), target_opt.state_dict())
    assert state["epoch"] == 11


# ----------------------------------------------------------------------------- two ranks, FSDP2 targets


def _load_sharded(directory: str, world: int, table: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any], int]:
    """A fresh FSDP2 model and AdamW in DCP's state dict form (and a row-sharded table), loaded by dcp.load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model, opt = _dist.build(world, seed=123)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "epoch": -1, "loader": {"pos": -1}}
    if table:
        state["table"] = distribute_tensor(torch.zeros(TABLE), init_device_mesh("cpu", (world,)), [Shard(0)])
    reader = CheckpointReader(directory, param_names={"optim": [n for n, _ in model.named_parameters()]})
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if table:
        assert torch.equal(state["table"].full_tensor(), torch.arange(TABLE, dtype=torch.float32))
    return model, opt, {"epoch": state["epoch"], "loader": state["loader"]}, reader.bytes_read


TABLE = 1 << 20  # 4 MiB of float32: four 1 MiB chunks, two of them in each rank's half


def two_rank_worker(rank: int, world: int, one_rank_dir: str, one_rank_ref: str, two_rank_dir: str, two_rank_ref: str) -> dict[str, Any]:
    # a checkpoint saved by one unsharded process, loaded into FSDP2 shards on two ranks
    model, opt, extra, read = _load_sharded(one_rank_dir, world, table=True)
    _dist.assert_same(torch.load(one_rank_ref), _dist.full_state(model, opt))
    assert extra == {"epoch": 3, "loader": {"pos": 100}}
    _dist.train(model, opt, 1, rank=rank, start=3)  # the loaded optimizer steps
    # a checkpoint saved by these two ranks (FSDP2), per-rank loader positions included
    saved, saved_opt = _dist.build(world)
    _dist.train(saved, saved_opt, 3, rank=rank)
    ref = _dist.full_state(saved, saved_opt)
    if rank == 0:
        torch.save(ref, two_rank_ref)
    with CheckpointManager(two_rank_dir, timeout_s=60) as mgr:
        mgr.save(3, {"model": saved, "optim": saved_opt, "epoch": 3, "loader": {"pos": 100 + rank}}).wait()
    model, opt, extra, read2 = _load_sharded(two_rank_dir, world, table=False)
    _dist.assert_same(ref, _dist.full_state(model, opt))
    assert extra == {"epoch": 3, "loader": {"pos": 100 + rank}}  # each rank its own
    return {"read_from_one_rank_save": read, "read_from_two_rank_save": read2}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_two_ranks_load_into_fsdp2_shards(tmp_path, one_torch_thread):
    one_rank_dir, two_rank_dir = str(tmp_path / "one"), str(tmp_path / "two")
    model, opt = _dist.build(1, sharded=False)
    _dist.train(model, opt, 3, rank=0)
    torch.save(_dist.full_state(model, opt), tmp_path / "one.pt")
    table = torch.arange(TABLE, dtype=torch.float32)
    with CheckpointManager(one_rank_dir) as mgr:
        mgr.save(3, {"model": model, "optim": opt, "epoch": 3, "loader": {"pos": 100}, "table": table}).wait()
    results = run_ranks(two_rank_worker, 2, one_rank_dir, str(tmp_path / "one.pt"), two_rank_dir, str(tmp_path / "two.pt"), tmp=tmp_path)
    # each rank reads the chunks its boxes overlap, not the step (a small tensor is one chunk: read whole, verified)
    one_total = _nbytes(torch.load(tmp_path / "one.pt")) + TABLE * 4
    two_total = _nbytes(torch.load(tmp_path / "two.pt"))
    for r in results:
        assert r["read_from_one_rank_save"] < 0.6 * one_total and r["read_from_two_rank_save"] < 0.6 * two_total, (r, one_total, two_total)
    # the two-rank checkpoint in one process: resharded to whole tensors; per-rank values need rank=
    plain, _ = _dist.build(1, sharded=False, seed=7)
    state: dict[str, Any] = {"model": plain.state_dict(), "loader": {"pos": -1}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=CheckpointReader(two_rank_dir), no_dist=True)
    assert isinstance(_cause(info), CheckpointError) and "loader/pos: saved per rank" in str(_cause(info)) and "rank=" in str(_cause(info))
    dcp.load(state, storage_reader=CheckpointReader(two_rank_dir, rank=1), no_dist=True)
    plain.load_state_dict(state["model"])
    expected = torch.load(tmp_path / "two.pt")
    _same({k: v for k, v in expected.items() if k.startswith("model/")}, {f"model/{k}": v for k, v in plain.state_dict().items()})
    assert state["loader"] == {"pos": 101}
