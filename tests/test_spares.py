"""Spare pack files: a pack file that local retention retires is written over by the next save
instead of being deleted (issue 21: deleting a large file costs the device, and on a virtual
machine the host's CPU, a good part of a second per save).

Real training loops, real files, real processes; the inode numbers show which file a pack is.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _models import child_env
from checkpointing import CheckpointManager
from checkpointing.cli.app import main
from checkpointing.format import naming
from checkpointing.storage import LocalStorage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(width: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, model[0].in_features, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _packs(root) -> dict[int, tuple[int, int]]:
    """step -> (inode, size) of its pack file. A handle's wait() returns once its step is durable,
    while the files of the steps its retention retired may still be going: those may vanish here."""
    out = {}
    for path in glob.glob(f"{root}/step-*/*.pack"):
        step = naming.parse_step_dir(os.path.basename(os.path.dirname(path)))
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        out[step] = (st.st_ino, st.st_size)
    return out


def _spares(root) -> list[str]:
    d = os.path.join(root, naming.SPARES_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _restored(root, step: int, width: int = 256) -> dict[str, torch.Tensor]:
    model, opt = _model(width)
    with CheckpointManager(root, read_only=True) as mgr:
        mgr.restore({"model": model, "optim": opt}, step=step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_next_save_writes_over_the_pack_file_retention_retired(tmp_path):
    model, opt = _model()
    seen: dict[int, tuple[int, int]] = {}  # every pack file any step had
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(tmp_path, keep_local=2) as mgr:
        for step in range(1, 8):
            _train(model, opt, step)
            mgr.save(step, {"model": model, "optim": opt}).wait()
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            packs = _packs(tmp_path)
            if step >= 4:  # step 1 was retired when step 3 committed: its file became step 4's
                retired = {seen[s][0] for s in range(1, step - 2)}
                assert packs[step][0] in retired
                assert packs[step][1] == seen[1][1]  # the same plan: the same length, nothing left over
            seen.update(packs)
            assert len(_spares(tmp_path)) <= 1  # one rank writes here: at most one spare
    # the manager is closed: only the kept steps are left, no spare
    assert sorted(_packs(tmp_path)) == [6, 7]
    assert not os.path.exists(tmp_path / naming.SPARES_DIR)
    for step in (6, 7):
        got = _restored(tmp_path, step)
        assert all(torch.equal(got[k], saved[step][k]) for k in got)


def test_a_spare_longer_or_shorter_than_the_new_pack(tmp_path):
    """The state shrinks, then grows: a pack written over a longer spare is cut to its own length,
    one longer than the spare grows it; every step restores exactly."""
    widths = [512, 512, 512, 128, 128, 512, 512]
    saved = {}
    with CheckpointManager(tmp_path, keep_local=1, incremental=False) as mgr:
        for step, width in enumerate(widths, start=1):
            model, opt = _model(width)
            _train(model, opt, step)
            mgr.save(step, {"model": model, "optim": opt}).wait()
            saved[step] = (width, {k: v.clone() for k, v in model.state_dict().items()})
            size = _packs(tmp_path)[step][1]
            assert size < 2 << 20 if width == 128 else size > 2 << 20
            width_, want = saved[step]
            got = _restored(tmp_path, step, width_)
            assert all(torch.equal(got[k], want[k]) for k in got)


def test_what_the_spares_directory_holds_that_we_did_not_put_there_is_never_written(tmp_path):
    """A link to a file outside the root, a second name of an outside file and a FIFO in spares/:
    saves leave them (and what they point at) alone and write new files."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target, twin = outside / "victim.bin", outside / "twin.bin"
    target.write_bytes(b"precious" * 1000)
    twin.write_bytes(b"also precious" * 1000)
    root = tmp_path / "ckpt"
    spares = root / naming.SPARES_DIR
    spares.mkdir(parents=True)
    os.symlink(target, spares / "aaaa.pack")
    os.link(twin, spares / "bbbb.pack")
    os.mkfifo(spares / "cccc.pack")
    model, opt = _model()
    with CheckpointManager(root, keep_local=1) as mgr:
        for step in range(1, 5):
            _train(model, opt, step)
            mgr.save(step, {"model": model, "optim": opt}).wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
    assert target.read_bytes() == b"precious" * 1000
    assert twin.read_bytes() == b"also precious" * 1000
    assert sorted(os.listdir(spares)) == ["aaaa.pack", "bbbb.pack", "cccc.pack"]  # not ours to remove
    got = _restored(root, 4)
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_a_crashed_writers_spare_is_taken_by_the_next_manager_and_gc_removes_one_left(tmp_path, capsys):
    """A process killed between two saves leaves its spare; the next manager writes over it;
    `checkpointing gc` lists (--dry-run) and removes a spare nobody took."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_spares import _model, _train
        from checkpointing import CheckpointManager
        model, opt = _model()
        mgr = CheckpointManager({str(tmp_path)!r}, keep_local=1)
        for step in range(1, 4):
            _train(model, opt, step)
            mgr.save(step, {{"model": model, "optim": opt}}).wait()
        _train(model, opt, 4)
        mgr.save(4, {{"model": model, "optim": opt}})  # step 3's files are retired once this commits
        mgr.wait()
        os._exit(0)  # no close(): the spare stays
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env=child_env(), timeout=300)
    left = _spares(tmp_path)
    assert len(left) == 1
    inode = os.stat(tmp_path / naming.SPARES_DIR / left[0]).st_ino
    model, opt = _model()
    with CheckpointManager(tmp_path, keep_local=3) as mgr:
        mgr.restore({"model": model, "optim": opt})
        _train(model, opt, 5)
        mgr.save(5, {"model": model, "optim": opt}).wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        assert _packs(tmp_path)[5][0] == inode
    got = _restored(tmp_path, 5)
    assert all(torch.equal(got[k], want[k]) for k in got)
    # a spare nobody takes (a copy of a pack file, moved aside as retention would)
    storage = LocalStorage(tmp_path)
    pack = glob.glob(f"{tmp_path}/step-0000000004/*.pack")[0]
    spare = tmp_path / "step-0000000004" / "r00000.0123456789ab.pack"
    spare.write_bytes(open(pack, "rb").read())
    assert storage.keep_spare("step-0000000004/r00000.0123456789ab.pack", limit=1)
    assert len(_spares(tmp_path)) == 1 and not spare.exists()
    capsys.readouterr()
    assert main(["gc", str(tmp_path), "--dry-run", "--min-age-s", "0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"would remove {naming.SPARES_DIR}/" in out and "spare pack file" in out
    assert len(_spares(tmp_path)) == 1
    assert main(["gc", str(tmp_path)]) == 0  # gc leaves a file younger than an hour alone
    assert len(_spares(tmp_path)) == 1
    assert main(["gc", str(tmp_path), "--min-age-s", "0"]) == 0
    assert not os.path.exists(tmp_path / naming.SPARES_DIR)
    for step in (4, 5):
        assert main(["verify", str(tmp_path), "--step", str(step)]) == 0


def test_keep_spare_keeps_at_most_limit_and_only_plain_files(tmp_path):
    storage = LocalStorage(tmp_path)
    for n in range(3):
        storage.put(f"step-0000000001/r0000{n}.abcdef{n}.pack", b"x" * 8192)
    assert storage.keep_spare("step-0000000001/r00000.abcdef0.pack", limit=2)
    assert storage.keep_spare("step-0000000001/r00001.abcdef1.pack", limit=2)
    assert not storage.keep_spare("step-0000000001/r00002.abcdef2.pack", limit=2)  # two are there
    assert len(_spares(tmp_path)) == 2
    os.link(tmp_path / "step-0000000001/r00002.abcdef2.pack", tmp_path / "other-name")
    assert not LocalStorage(tmp_path).keep_spare("step-0000000001/r00002.abcdef2.pack", limit=9)  # a second link
    assert not storage.keep_spare("step-0000000001/missing.pack", limit=9)
