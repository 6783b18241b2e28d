"""A step whose data turns out damaged while it is read into the live objects (restore/attempt.py).

Targets are filled in place and each chunk is verified as it lands, so damage is found after some
targets already hold the step's bytes. restore() with step=None then restores the next older step
that reads clean on every rank (overwriting every target again); with a requested step, or with no
older step left, it raises CheckpointCorruptError saying the targets were overwritten, and applies
nothing (no load_state_dict, no primitives).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks
from hostile import flip_bits
import checkpointing
from checkpointing import CheckpointCorruptError, CheckpointError, CheckpointManager
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _train(net: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v.clone() for k, v in st.items()})
    return out


def _save_two_steps(ck: Path, *, rank: int = 0, **kw) -> dict[int, dict]:
    """Steps 1 and 2 of a short run, each written whole (incremental=False: no chunk shared); what each held."""
    net, opt = _model(rank)
    snaps = {}
    with CheckpointManager(ck, keep_local=None, incremental=False, **kw) as mgr:
        for step in (1, 2):
            _train(net, opt, step)
            mgr.save(step, {"model": net, "optim": opt, "progress": {"step": step}}).wait()
            snaps[step] = _snapshot(net, opt)
    return snaps


def _damage(ck: Path, step: int, rank: int = 0) -> str:
    """Flip a bit in the last model chunk of rank `rank`'s pack of `step` (what a rotting disk does); the file.
    Model tensors differ between the ranks here; the optimizer's step counts are equal, stored once."""
    manifest = catalog.load_manifest(LocalStorage(ck, direct=False), step)
    owner = {f.path: f.rank for f in manifest.files}
    refs = [c for t in manifest.tensors if t.key.startswith("model/") for s in t.shards for c in s.chunks if owner[c.file] == rank]
    victim = max(refs, key=lambda c: (c.file, c.offset))
    flip_bits(ck / victim.file, victim.offset + victim.length // 2)
    return victim.file


def _fresh_state(seed: int = 99) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    net, opt = _model(seed)
    _train(net, opt, 0)  # the optimizer has state to overwrite
    return {"model": net, "optim": opt, "progress": {"step": -1}}, net, opt


def test_newest_step_damaged_restores_the_one_before_it_whole(tmp_path, caplog):
    ck = tmp_path / "ck"
    snaps = _save_two_steps(ck)
    _damage(ck, 2)
    state, net, opt = _fresh_state()
    with caplog.at_level(logging.WARNING, logger="checkpointing"), CheckpointManager(ck, keep_local=None) as mgr:
        assert mgr.restore(state) == 1
    got = _snapshot(net, opt)
    assert sorted(got) == sorted(snaps[1])
    for k, v in snaps[1].items():
        assert torch.equal(got[k], v), f"{k} does not hold step 1's value after the fallback"
    assert state["progress"] == {"step": 1}
    assert any("step 2" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records), caplog.text


def test_a_requested_damaged_step_raises_and_applies_nothing(tmp_path):
    ck = tmp_path / "ck"
    _save_two_steps(ck)
    damaged = _damage(ck, 2)
    state, net, opt = _fresh_state()
    opt.param_groups[0]["lr"] = 0.5  # step 2 holds 1e-2: applied only by load_state_dict, after every read passed
    with CheckpointManager(ck, keep_local=None) as mgr, pytest.raises(CheckpointCorruptError) as err:
        mgr.restore(state, step=2)
    msg = str(err.value)
    assert "step 2" in msg and Path(damaged).name in msg, msg
    assert "overwritten" in msg and "do not train on them" in msg, msg
    # nothing was applied: the primitives and what load_state_dict() sets are as they were
    assert state["progress"] == {"step": -1}
    assert opt.param_groups[0]["lr"] == 0.5


def test_every_step_damaged_raises_naming_the_newest(tmp_path):
    ck = tmp_path / "ck"
    _save_two_steps(ck)
    _damage(ck, 2)
    _damage(ck, 1)
    state, _, _ = _fresh_state()
    with CheckpointManager(ck, keep_local=None) as mgr, pytest.raises(CheckpointCorruptError) as err:
        mgr.restore(state)
    msg = str(err.value)
    assert "step 1" in msg and "No older step" in msg and "do not train on them" in msg, msg
    assert state["progress"] == {"step": -1}


def test_a_damaged_local_copy_is_read_from_the_remote_tier_without_falling_back(tmp_path):
    """Damage that another copy covers is not damage to the step: step 2 comes whole from file://."""
    ck, remote = tmp_path / "ck", tmp_path / "remote"
    snaps = _save_two_steps(ck, remote=f"file://{remote}")
    _damage(ck, 2)
    state, net, opt = _fresh_state()
    with CheckpointManager(ck, keep_local=None, remote=f"file://{remote}") as mgr:
        assert mgr.restore(state) == 2
    got = _snapshot(net, opt)
    for k, v in snaps[2].items():
        assert torch.equal(got[k], v), k


# ----------------------------------------------------------------------------- two ranks


def _two_rank_save(rank: int, world: int, directory: str) -> dict:
    return _save_two_steps(Path(directory), rank=rank)


def _two_rank_restore(rank: int, world: int, directory: str, step: int | None) -> tuple:
    state, net, opt = _fresh_state(seed=50 + rank)
    with CheckpointManager(directory, keep_local=None) as mgr:
        try:
            got = mgr.restore(state, step=step)
        except CheckpointError as exc:
            return "error", type(exc).__name__, str(exc), state["progress"]
    return "ok", got, _snapshot(net, opt), state["progress"]


def test_two_ranks_fall_back_together_when_one_rank_finds_damage(tmp_path):
    ck = tmp_path / "ck"
    snaps = run_ranks(_two_rank_save, 2, str(ck), tmp=tmp_path)
    _damage(ck, 2, rank=1)  # only rank 1's data of step 2: rank 0 reads its own part clean
    results = run_ranks(_two_rank_restore, 2, str(ck), None, tmp=tmp_path)
    for rank, (status, step, got, progress) in enumerate(results):
        assert (status, step, progress) == ("ok", 1, {"step": 1}), (rank, status, step)
        for k, v in snaps[rank][1].items():
            assert torch.equal(got[k], v), f"rank {rank}: {k} is not step 1's"
    # asked for step 2 by name: every rank raises, rank 0 included, and applies nothing
    results = run_ranks(_two_rank_restore, 2, str(ck), 2, tmp=tmp_path)
    for rank, (status, kind, msg, progress) in enumerate(results):
        assert (status, kind, progress) == ("error", "CheckpointCorruptError", {"step": -1}), (rank, kind, msg)
        assert "step 2" in msg and "overwritten" in msg, msg
        if rank == 0:
            assert "rank 1" in msg, msg  # rank 0 read its part clean: the message says who found the damage


# ----------------------------------------------------------------------------- an unreadable COMMIT or manifest


def _damage_commit_or_manifest(root: Path, step: int, how: str) -> None:
    sdir = root / f"step-{step:010d}"
    commit = sdir / "COMMIT"
    if how == "torn_commit":
        commit.write_bytes(commit.read_bytes()[:20])
    elif how == "commit_link":
        commit.unlink()
        commit.symlink_to(root.parent / "elsewhere.json")
    elif how == "commit_dir":
        commit.unlink()
        commit.mkdir()
    elif how == "manifest_bit":
        [manifest] = sdir.glob("manifest.*.json")
        flip_bits(manifest, 40)
    elif how == "junk_newer":  # one object of a step that never was
        (root / f"step-{step + 10:010d}").mkdir()
        (root / f"step-{step + 10:010d}" / "COMMIT").write_text("junk")


@pytest.mark.parametrize("how", ["torn_commit", "commit_link", "commit_dir", "manifest_bit", "junk_newer"])
def test_a_newest_step_whose_commit_or_manifest_cannot_be_read_is_passed_over(tmp_path, how, caplog):
    root = tmp_path / "ck"
    net, opt = _model(0)
    with CheckpointManager(root) as mgr:
        _train(net, opt, 1)
        mgr.save(10, {"model": net, "optim": opt}).wait()
        good = _snapshot(net, opt)
        _train(net, opt, 2)
        mgr.save(20, {"model": net, "optim": opt}).wait()
    _damage_commit_or_manifest(root, 20, how)
    caplog.set_level(logging.WARNING, logger="checkpointing")
    fresh, fresh_opt = _model(1)
    _train(fresh, fresh_opt, 0)
    expect = 20 if how == "junk_newer" else 10
    with CheckpointManager(root) as mgr:
        assert mgr.restore({"model": fresh, "optim": fresh_opt}) == expect
        if how != "junk_newer":
            assert _snapshot(fresh, fresh_opt).keys() == good.keys()
            assert all(torch.equal(_snapshot(fresh, fresh_opt)[k], v) for k, v in good.items())
            with pytest.raises(CheckpointError):
                mgr.restore({"model": fresh, "optim": fresh_opt}, step=20)  # asked for by name: its error
    bad = 30 if how == "junk_newer" else 20
    assert any(f"step {bad}" in r.getMessage() and "passed over" in r.getMessage() for r in caplog.records)
    assert torch.equal(checkpointing.load(root, exclude="optim")["model"]["0.weight"],
                       good["model/0.weight"] if expect == 10 else _snapshot(net, opt)["model/0.weight"])


def _saved(root: Path, steps: tuple[int, ...]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model trained and saved at each of `steps` (default retention), as it is after the last."""
    net, opt = _model(0)
    with CheckpointManager(root) as mgr:
        for step in steps:
            _train(net, opt, step)
            mgr.save(step, {"model": net, "optim": opt}).wait()
    return net, opt


def test_every_committed_step_unreadable_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "ck"
    net, opt = _saved(root, (10, 20))
    _damage_commit_or_manifest(root, 10, "torn_commit")
    _damage_commit_or_manifest(root, 20, "manifest_bit")
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointCorruptError, match="no committed step .* can be read") as info:
            mgr.restore({"model": net, "optim": opt})
    assert "step 10" in str(info.value) and "step 20" in str(info.value) and "--step" in str(info.value)
    with pytest.raises(CheckpointCorruptError, match="no committed step .* can be read"):
        checkpointing.load(root)


@pytest.mark.parametrize("how", ["pack", "torn_commit"])
def test_the_loop_goes_on_after_restore_passed_over_a_damaged_step(tmp_path, how, caplog):
    """The README loop (start = restore() or 0; save every step) after the newest step was found damaged:
    restore() resumes from the older step, and the next save() deletes the damaged one, so the loop saves that step again."""
    root = tmp_path / "ck"
    _saved(root, (5, 10, 15))
    if how == "pack":
        [pack] = (root / "step-0000000015").glob("*.pack")
        flip_bits(pack, 100)
    else:
        _damage_commit_or_manifest(root, 15, "torn_commit")
    caplog.set_level(logging.WARNING, logger="checkpointing")
    fresh, fresh_opt = _model(1)
    with CheckpointManager(root) as mgr:
        start = mgr.restore({"model": fresh, "optim": fresh_opt}) or 0
        assert start == 10 and mgr.steps() == [10, 15]  # keep_local=2 had kept 10 and 15; restoring alone deletes nothing
        for step in range(start + 1, 17):
            _train(fresh, fresh_opt, step)
            mgr.save(step, {"model": fresh, "optim": fresh_opt}).wait()
        assert mgr.steps() == [15, 16]  # keep_local=2
    assert any("step(s) 15 could not be restored" in r.getMessage() and "saved again" in r.getMessage() for r in caplog.records)
    check, check_opt = _model(2)
    with CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore({"model": check, "optim": check_opt}) == 16
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(check, check_opt).values(), _snapshot(fresh, fresh_opt).values()))


@pytest.mark.parametrize("damage", ["deleted", "one bit flipped", "garbage", "another id"])
def test_a_lost_or_damaged_tier_file_gets_its_id_back_from_the_committed_steps(tmp_path, damage, caplog, run_cli):
    """A new random id would make every committed step there look like another node's: unreadable."""
    root = tmp_path / "ck"
    net, opt = _saved(root, (10, 20))
    tier = root / "TIER"
    original = tier.read_bytes()
    if damage == "deleted":
        tier.unlink()
    elif damage == "one bit flipped":
        tier.write_bytes(bytes([original[0] ^ 0x40]) + original[1:])  # '0'..'9' -> 'p'..'y', 'a'..'f' -> '!'..'&'
    elif damage == "garbage":
        tier.write_bytes(b"\x00garbage\xff")
    else:  # still an id (a hex digit flipped into another, or a directory assembled from another node's): named by no file
        tier.write_text("0123456789abcdef0123456789abcdef\n")
    fresh, fresh_opt = _model(2)
    assert checkpointing.load(root)["model"]["0.weight"].shape == fresh[0].weight.shape  # readers: as holding every copy
    with caplog.at_level(logging.WARNING, logger="checkpointing"), CheckpointManager(root) as mgr:  # the training job resuming
        assert mgr.restore({"model": fresh, "optim": fresh_opt}) == 20
        mgr.save(30, {"model": fresh, "optim": fresh_opt}).wait()
    assert tier.read_bytes() == original and "which it gets again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(fresh, fresh_opt).values(), _snapshot(net, opt).values()))
    code, out = run_cli("verify", str(root))
    assert code == 0 and "shard(s) live on other" not in out, out


def _save_split(rank: int, world: int, base: str) -> None:
    """Two ranks, one node-local directory each, a Shard(0) tensor: each directory holds half of it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(torch.arange(64.0).reshape(8, 8), init_device_mesh("cpu", (world,)), [Shard(0)])
    with CheckpointManager(Path(base) / f"node{rank}") as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": w}).wait()


def test_one_node_s_directory_of_a_larger_job_is_an_error_not_a_fresh_start_nor_damage(tmp_path, run_cli):
    """Its steps' other shards are on the other node: restore(step=None) must not answer None over committed
    steps, nor call them damaged (verify finds nothing wrong), nor delete them."""
    run_ranks(_save_split, 2, str(tmp_path), tmp=tmp_path)
    node0 = tmp_path / "node0"
    with CheckpointManager(node0) as mgr:
        with pytest.raises(CheckpointError, match="no committed step .* can be read by this process") as info:
            mgr.restore({"w": torch.zeros(8, 8)})
        assert not isinstance(info.value, CheckpointCorruptError)
        assert "step 20" in str(info.value) and "step 10" in str(info.value) and "remote tier" in str(info.value)
        assert mgr.steps() == [10, 20]
    code, out = run_cli("verify", str(node0))
    assert code == 0 and "live on other ranks' local tiers" in out, out
