"""One writer per local tier, no symlink followed, durable step directories (issue findings 1, 2 and 6).

Real processes (a writer subprocess, SIGKILL, two gloo ranks), real symlinks and FIFOs, a fault-injecting
wrapper of the real LocalStorage for the COMMIT re-check, and os.fsync observed for the root fsync.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import checkpointing
from checkpointing import CheckpointManager
from checkpointing.errors import CheckpointCorruptError, CheckpointError, DirectoryLockedError
from checkpointing.format import naming
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog
from checkpointing.tier.lock import LOCK_NAME

from _dist import run_ranks
from _models import child_env

ROUNDS = 20

WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from checkpointing import CheckpointManager
    d, sig, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    mgr = CheckpointManager(d, keep_local=1)
    for i in range(rounds):
        g = torch.Generator().manual_seed(i)
        state = {"w": torch.randn(16 << 20, generator=g)}  # 64 MiB a step
        mgr.save(i, state)  # returns while the background thread still writes the step
        (sig / f"saving-{i}").write_text("x")
        while not (sig / f"probed-{i}").exists():
            time.sleep(0.005)
        mgr.wait()
        out = {"w": torch.zeros(16 << 20)}
        assert mgr.restore(out) == i, mgr.steps()
        assert torch.equal(out["w"], state["w"]), f"step {i} does not restore bit-exact"
        (sig / f"checked-{i}").write_text("x")
    mgr.close()
    print("WRITER-OK", flush=True)
    """
)

HOLDER = textwrap.dedent(
    """
    import sys, time
    from checkpointing import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    print("READY", flush=True)
    time.sleep(600)
    """
)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the writer exited ({proc.returncode}): {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} in time")
        time.sleep(0.002)


def _holder(directory: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], env=child_env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    return p


def test_second_process_is_refused_while_a_save_is_in_flight_20_times(tmp_path):
    d, sig = tmp_path / "ck", tmp_path / "sig"
    sig.mkdir()
    a = subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(sig), str(ROUNDS)], env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for i in range(ROUNDS):
            _wait_for(sig / f"saving-{i}", a)
            with pytest.raises(DirectoryLockedError) as err:  # B: an eval job / a monitoring script on the same directory
                CheckpointManager(d)
            msg = str(err.value)
            assert f"process {a.pid}" in msg and "since" in msg and "its own" in msg, msg
            (sig / f"probed-{i}").write_text("x")
            _wait_for(sig / f"checked-{i}", a)  # A's step committed and restored bit-exact
        out, errs = a.communicate(timeout=120)
        assert a.returncode == 0 and "WRITER-OK" in out, errs[-3000:]
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    info = json.loads((d / LOCK_NAME).read_text())
    assert info["pid"] == a.pid and info["host"] and info["since"]
    mgr = CheckpointManager(d)  # A is gone: the directory is free
    assert mgr.steps() == [ROUNDS - 1]
    mgr.close()


def test_sigkilled_writer_leaves_the_lock_free(tmp_path):
    d = tmp_path / "ck"
    p = _holder(d)
    with pytest.raises(DirectoryLockedError, match=f"process {p.pid}"):
        CheckpointManager(d)
    p.send_signal(signal.SIGKILL)
    p.wait()
    with CheckpointManager(d) as mgr:
        mgr.save(1, {"x": torch.arange(4)})
        mgr.wait()
        assert mgr.steps() == [1]


def test_close_releases_and_same_process_shares(tmp_path):
    d = tmp_path / "ck"
    first = CheckpointManager(d)
    second = CheckpointManager(d)  # the same process: shares the lock, does not tidy under the first
    second.close()
    p = subprocess.run([sys.executable, "-c", "import sys; from checkpointing import CheckpointManager; CheckpointManager(sys.argv[1])", str(d)],
                       env=child_env(), capture_output=True, text=True)
    assert p.returncode != 0 and "DirectoryLockedError" in p.stderr, "still held by `first`"
    first.close()
    p = subprocess.run([sys.executable, "-c", "import sys; from checkpointing import CheckpointManager; CheckpointManager(sys.argv[1]).close()", str(d)],
                       env=child_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def test_gc_takes_the_lock_and_dry_run_does_not(tmp_path):
    d = tmp_path / "ck"
    holder = _holder(d)
    try:
        run = lambda *a: subprocess.run([sys.executable, "-m", "checkpointing", "gc", str(d), *a], env=child_env(), capture_output=True, text=True)  # noqa: E731
        r = run()
        assert r.returncode != 0 and f"process {holder.pid}" in r.stdout + r.stderr and "Traceback" not in r.stderr
        assert run("--dry-run").returncode == 0
    finally:
        holder.kill()
        holder.wait()
    assert run().returncode == 0


def test_gc_and_rm_on_a_directory_without_checkpoints_leave_it_as_it_was(tmp_path):
    d = tmp_path / "not-a-checkpoint"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    run = lambda *a: subprocess.run([sys.executable, "-m", "checkpointing", *a], env=child_env(), capture_output=True, text=True)  # noqa: E731
    assert run("gc", str(d), "--min-age-s", "0").returncode == 0
    r = run("rm", str(d), "--step", "3")
    assert r.returncode == 2 and "step 3 is not committed" in r.stdout + r.stderr
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def _two_ranks_share(rank: int, world: int, directory: str) -> list[int]:
    with CheckpointManager(directory) as mgr:
        mgr.save(3, {"t": torch.full((8,), float(rank))})
        mgr.wait()
        return mgr.steps()


def _two_ranks_refused(rank: int, world: int, directory: str) -> str:
    try:
        CheckpointManager(directory)
    except CheckpointError as exc:
        return str(exc)
    return "not refused"


def test_ranks_of_one_job_share_the_tier_lock(tmp_path):
    d = tmp_path / "ck"
    assert run_ranks(_two_ranks_share, 2, str(d), tmp=tmp_path) == [[3], [3]]
    holder = _holder(d)
    try:
        msgs = run_ranks(_two_ranks_refused, 2, str(d), tmp=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert all(f"process {holder.pid}" in m for m in msgs), msgs  # every rank gets the same error


# ------------------------------------------------------------------ symlinks


def _outside(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path / "secrets"
    out.mkdir()
    files = {"id_rsa": b"PRIVATE", "notes.txt": b"keep me"}
    for k, v in files.items():
        (out / k).write_bytes(v)
    return out, files


def _intact(out: Path, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(out)) == sorted(files)
    for k, v in files.items():
        assert (out / k).read_bytes() == v


def test_symlinks_in_the_root_are_never_followed(tmp_path, caplog):
    out, files = _outside(tmp_path)
    d = tmp_path / "ck"
    d.mkdir()
    (d / naming.step_dir(98)).symlink_to(out)  # "an incomplete step"
    real = d / naming.step_dir(97)  # a real incomplete step holding a link to a file outside
    real.mkdir()
    (real / "pack").symlink_to(out / "id_rsa")
    (d / naming.METRICS_NAME).symlink_to(out / "notes.txt")
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with CheckpointManager(d, keep_local=1) as mgr:
            for step in (1, 2, 3):  # retention rotates
                mgr.save(step, {"w": torch.arange(1000.0) + step})
                mgr.wait()
            assert mgr.steps() == [3]
    _intact(out, files)
    assert (d / naming.step_dir(98)).is_symlink()
    assert any("symbolic link" in r.getMessage() and naming.step_dir(98) in r.getMessage() for r in caplog.records)
    assert any("metrics line not written" in r.getMessage() for r in caplog.records)
    r = subprocess.run([sys.executable, "-m", "checkpointing", "gc", str(d), "--pin-ttl-s", "0"], env=child_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    _intact(out, files)


def test_a_users_file_or_directory_under_our_names_is_left_alone(tmp_path, caplog):
    """A file named like a step directory (an operator's notes) is no incomplete step to tidy away: open, saves,
    retention, `gc` and `ls` leave it as it is; a directory named metrics.jsonl costs the metrics line, not the save."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / naming.step_dir(50)).write_text("operator's notes, not a checkpoint\n")
    (d / naming.METRICS_NAME).mkdir()
    with caplog.at_level(logging.WARNING, logger="checkpointing"):
        with CheckpointManager(d, keep_local=1) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": torch.arange(1000.0) + step}).wait()
            assert mgr.steps() == [2]
            with pytest.raises(checkpointing.CheckpointSaveError, match="not a directory; a file of that name is in the way: move or rename it"):
                mgr.save(50, {"w": torch.zeros(3)}).wait()  # the file is in the way, and stays
    assert any("metrics" in r.getMessage() and "Is a directory" in r.getMessage() for r in caplog.records)
    for args in (["gc", str(d), "--pin-ttl-s", "0"], ["ls", str(d)]):
        r = subprocess.run([sys.executable, "-m", "checkpointing", *args], env=child_env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    assert (d / naming.step_dir(50)).read_text() == "operator's notes, not a checkpoint\n"
    assert (d / naming.METRICS_NAME).is_dir()
    assert checkpointing.load(d)["w"].equal(torch.arange(1000.0) + 2)


def test_local_storage_reads_no_link_fifo_or_oversized_object(tmp_path):
    out, files = _outside(tmp_path)
    s = LocalStorage(tmp_path / "ck")
    s.put("step-0000000001/a", b"abc")
    (s.root / "step-0000000001" / "link").symlink_to(out / "id_rsa")
    (s.root / "step-0000000002").symlink_to(out)
    os.mkfifo(s.root / "step-0000000001" / "fifo")
    assert s.list("") == ["step-0000000001"]
    assert s.list("step-0000000001") == ["a", "fifo"]
    assert s.list("step-0000000002") == []
    for path in ("step-0000000001/link", "step-0000000002/id_rsa"):
        with pytest.raises(FileNotFoundError, match="symbolic link"):
            s.get(path)
        with pytest.raises(FileNotFoundError):
            s.size(path)
        with pytest.raises(FileNotFoundError):
            s.read_into(path, 0, memoryview(bytearray(3)))
        s.delete(path)
        s.remove_dir(path)
    s.delete("step-0000000002")
    _intact(out, files)
    done: list[BaseException] = []

    def read_fifo() -> None:
        try:
            s.get("step-0000000001/fifo")
        except BaseException as exc:  # noqa: BLE001
            done.append(exc)

    t = threading.Thread(target=read_fifo, daemon=True)
    t.start()
    t.join(30)
    assert done and isinstance(done[0], CheckpointCorruptError) and "regular file" in str(done[0])
    with pytest.raises(CheckpointCorruptError, match="more than the 2 "):
        s.get("step-0000000001/a", max_bytes=2)
    assert s.get("step-0000000001/a", max_bytes=3) == b"abc"
    s.delete("step-0000000001")
    assert s.list("") == [] and not (s.root / "step-0000000001").exists()
    _intact(out, files)


def test_commit_symlinked_to_dev_zero_is_not_a_commit(tmp_path):
    d = tmp_path / "ck"
    with CheckpointManager(d) as mgr:
        mgr.save(5, {"w": torch.arange(10.0)})
        mgr.wait()
    commit = d / naming.commit_name(5)
    commit.unlink()
    commit.symlink_to("/dev/zero")
    s = LocalStorage(d)
    assert catalog.list_steps(s).committed == [5]  # listed, so that readers report it damaged; never read
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        catalog.read_commit(s, 5)
    with CheckpointManager(d) as mgr:  # start-up tidying leaves it alone; restore names it
        with pytest.raises(CheckpointError, match="symbolic link"):
            mgr.restore({"w": torch.zeros(10)})
    assert commit.is_symlink() and os.readlink(commit) == "/dev/zero"


# ------------------------------------------------------------------ the COMMIT re-check and the root fsync


class _DeletesPackBeforeCommit:
    """The real LocalStorage; once the manifest is written (the COMMIT comes next), another process
    'deletes' the step's packs (what a second manager's tidying did in finding 1)."""

    def __init__(self, inner: LocalStorage) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def put(self, path: str, data: bytes, **kw) -> None:
        self.inner.put(path, data, **kw)
        if path.endswith(".json"):
            step_dir = path.split("/")[0]
            for name in self.inner.list(step_dir):
                if name.endswith(".pack"):
                    os.unlink(self.inner.root / step_dir / name)


def test_commit_rechecks_every_file(tmp_path):
    d = tmp_path / "ck"
    state = {"w": torch.arange(5000.0)}
    with CheckpointManager(d) as mgr:
        mgr.save(1, state)
        mgr.wait()
    s = LocalStorage(d)
    manifest = catalog.load_manifest(s, 1)
    d2 = tmp_path / "ck2"
    s2 = LocalStorage(d2)
    s2.put("TIER", s.get("TIER"))
    for f in manifest.files:
        s2.put(f.path, s.get(f.path))
    manifest2 = manifest
    with pytest.raises(CheckpointCorruptError, match="was not committed"):
        catalog.commit(_DeletesPackBeforeCommit(s2), manifest2, "tok")  # type: ignore[arg-type]
    assert catalog.list_steps(s2).committed == []
    assert not (d2 / naming.commit_name(1)).exists()


def test_new_step_directory_is_made_durable_in_the_root(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    s = LocalStorage(d)
    root_ino = os.stat(d).st_ino
    seen: list[tuple[int, list[str]]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) and st.st_ino == root_ino:
            seen.append((st.st_ino, sorted(os.listdir(d))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    s.put(naming.step_dir(7) + "/x", b"1")
    # the root was fsynced with the new step directory in it, before its first file had its final name
    assert seen and seen[0][1] == [naming.step_dir(7)]
    assert os.listdir(d / naming.step_dir(7)) == ["x"]


def test_a_users_files_inside_step_directories_and_spares_are_left_alone(tmp_path, run_cli):
    """gc and a writer's tidying delete only names this library gives files; `ls` calls data no step uses incomplete."""
    d = tmp_path / "ck"
    with CheckpointManager(d, keep_local=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.arange(1000.0) + step}).wait()
    (d / naming.step_dir(1)).mkdir(exist_ok=True)
    (d / naming.step_dir(1) / "notes.txt").write_text("mine\n")
    (d / naming.step_dir(2) / "notes.txt").write_text("mine too\n")
    (d / naming.SPARES_DIR).mkdir(exist_ok=True)
    (d / naming.SPARES_DIR / "notes.txt").write_text("and mine\n")
    (d / naming.step_dir(7)).mkdir()
    (d / naming.step_dir(7) / "r00000.0123456789ab.pack").write_bytes(b"x" * 100)  # an interrupted save's data
    code, out = run_cli("ls", str(d), "--json")
    assert code == 0 and {r["step"]: r["state"] for r in json.loads(out)} == {1: "incomplete", 2: "committed", 7: "incomplete"}, out
    code, out = run_cli("gc", str(d), "--min-age-s", "0", "--pin-ttl-s", "0")
    assert code == 0 and "notes.txt" not in out and "step-0000000007/r00000.0123456789ab.pack" in out, out
    with CheckpointManager(d, keep_local=1) as mgr:
        mgr.save(3, {"w": torch.zeros(3)}).wait()
    for sub in (naming.step_dir(1), naming.step_dir(2), naming.SPARES_DIR):
        assert (d / sub / "notes.txt").exists(), sub
    assert not (d / naming.step_dir(7)).exists()
