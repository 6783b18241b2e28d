"""CheckpointManager(dir, read_only=True) (issue 17, item 2) and the constructor's help (item 6).

A read-only manager lists and restores but leaves every byte, name and mtime of the directory as it
was (an incomplete step and a stale pin included), takes no lock, hooks nothing, and refuses save()
and delete(). It reads a directory this process cannot write, a directory without a TIER file (a
copy of a remote tier), and a remote tier (S3 on a moto server at 127.0.0.1) with no local directory.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import pydoc
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from s3_server import client, s3_bucket, s3_endpoint  # noqa: F401 - fixtures

from _dist import run_ranks
from checkpointing import CheckpointConfigError, CheckpointError, CheckpointManager
from checkpointing.format import naming
from checkpointing.options import ManagerOptions
from checkpointing.storage import LocalStorage
from checkpointing.tier import pins

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 1 << 15


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "b": torch.randn(N, generator=g) if step == 1 else torch.ones(N), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(N), "b": torch.zeros(N), "step": -1}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def write_steps(d: Path, **kwargs) -> None:
    with CheckpointManager(d, chunk_bytes=16 << 10, fsync=False, keep_local=None, **kwargs) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).wait()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every name below `root` (root included) with its kind, mode, size, mtime and content digest."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
        out[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, digest)
    return out


def litter(d: Path) -> None:
    """What a crashed save leaves: an incomplete step with data and a pin; and a stale pin in a committed step."""
    storage = LocalStorage(d, create=False)
    pins.write_pin(storage, 4, 0, "deadbeef", [])
    storage.put(naming.pack_name(4, 0, "deadbeef"), b"x" * 8192)
    pins.write_pin(storage, 2, 0, "c0ffee", [])


def check_reads(r: CheckpointManager) -> None:
    assert r.steps() == [1, 2, 3] and r.latest_step() == 3 and r.tiers() == {1: "local", 2: "local", 3: "local"}
    out = blank()
    assert r.restore(out) == 3 and same(out, state(3))
    assert r.restore(out, step=1) == 1 and same(out, state(1))
    assert r.stats() == [] and r.staging_bytes == 0


def test_read_only_leaves_the_directory_byte_identical(tmp_path):
    d = tmp_path / "ck"
    write_steps(d)
    litter(d)
    (d / "WRITER").unlink()  # no lock file now: a read-only open must not create one
    before = snapshot(d)
    hooks = dict(torch_optimizer._global_optimizer_pre_hooks)
    handler = signal.getsignal(signal.SIGTERM)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(d, read_only=True) as r:
        check_reads(r)
        assert dict(torch_optimizer._global_optimizer_pre_hooks) == hooks, "no optimizer step hook"
        for _ in range(3):
            model(torch.ones(4)).sum().backward()
            opt.step()
        assert r.summary().steps == 0, "optimizer.step() marks no step of a read-only manager"
        for call in (lambda: r.save(4, state(3)), lambda: r.delete(1), lambda: r.handle_preemption({"model": model})):
            with pytest.raises(CheckpointConfigError, match="opened read_only=True"):
                call()
        assert signal.getsignal(signal.SIGTERM) == handler, "no signal handler"
        assert r.steps() == [1, 2, 3]
    assert snapshot(d) == before
    assert not (d / "WRITER").exists()


def test_read_only_beside_a_writer_and_the_writer_goes_on(tmp_path):
    d = tmp_path / "ck"
    with CheckpointManager(d, chunk_bytes=16 << 10, keep_local=None) as w:
        w.save(1, state(1)).wait()
        with CheckpointManager(d, read_only=True) as r:  # takes no writer lock: no DirectoryLockedError
            w.save(2, state(2)).wait()
            out = blank()
            assert r.restore(out) == 2 and same(out, state(2))
        w.save(3, state(3)).wait()
        assert w.steps() == [1, 2, 3]


def test_read_only_on_a_directory_this_process_cannot_write(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    d = tmp_path / "ck"
    write_steps(d)
    litter(d)
    paths = [d, *d.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        before = snapshot(d)
        with CheckpointManager(d, read_only=True) as r:
            check_reads(r)
        assert snapshot(d) == before
    finally:
        for p in paths:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_directory_without_tier_file_is_read_as_holding_every_primary_copy(tmp_path):
    """A copy of a remote tier (here: a file:// remote tier itself) has no TIER file: it is read, and none is made."""
    remote = tmp_path / "remote"
    write_steps(tmp_path / "node", remote=f"file://{remote}")
    assert not (remote / "TIER").exists()
    before = snapshot(remote)
    with CheckpointManager(remote, read_only=True) as r:
        check_reads(r)
    assert snapshot(remote) == before
    local = tmp_path / "node"
    (local / "TIER").unlink()  # a local tier whose TIER file is gone: one rank wrote every file, so it holds them all
    with CheckpointManager(local, read_only=True) as r:
        check_reads(r)
    assert not (local / "TIER").exists()


def _write_two(rank: int, world: int, d: str) -> list[int]:
    write_steps(Path(d))
    return [1, 2, 3]


def _read_two(rank: int, world: int, d: str) -> bool:
    with CheckpointManager(d, read_only=True, timeout_s=60) as r:  # collective through the store, like a writer's
        check_reads(r)
    return True


def test_read_only_with_two_ranks(tmp_path):
    d = tmp_path / "ck"
    run_ranks(_write_two, 2, str(d), tmp=tmp_path)
    litter(d)
    before = snapshot(d)
    assert run_ranks(_read_two, 2, str(d), tmp=tmp_path) == [True, True]
    assert snapshot(d) == before


def _one_rank_looks(rank: int, world: int, d: str) -> list:
    """Rank 0 alone looks at the steps with a read-only manager; then every rank restores read-only, then
    saves with a writing manager (the managers of the ranks still match up); then rank 0 alone restores (a
    timeout), and then every rank restores read-only again."""
    seen = []
    if rank == 0:
        with CheckpointManager(d, read_only=True, timeout_s=60) as r:
            seen += [r.steps(), r.latest_step(), sorted(r.tiers().items())]
    with CheckpointManager(d, read_only=True, timeout_s=60) as r:
        out = blank()
        seen.append(r.restore(out) == 3 and same(out, state(3)))
    with CheckpointManager(d, fsync=False, keep_local=None, timeout_s=60) as mgr:
        mgr.save(4, state(4)).wait()
        seen.append(mgr.steps())
    if rank == 0:
        with CheckpointManager(d, read_only=True, timeout_s=3) as r:
            assert r.latest_step() == 4
            with pytest.raises(CheckpointError, match=r"first restore\(\), a collective call .* checkpointing.load") as caught:
                r.restore(blank())
            seen.append(type(caught.value).__name__)
        Path(d + ".alone-done").touch()
    while not os.path.exists(d + ".alone-done"):  # rank 1 comes only after rank 0's lone restore ended
        time.sleep(0.05)
    with CheckpointManager(d, read_only=True, timeout_s=60) as r:  # the lone meeting gave its number back: they meet
        out = blank()
        seen.append(r.restore(out) == 4 and same(out, state(4)))
    return seen


def test_read_only_on_one_rank_of_a_job_lists_without_the_others(tmp_path):
    """Opening a read-only manager and listing meet no other rank; only restore() is collective."""
    d = tmp_path / "ck"
    run_ranks(_write_two, 2, str(d), tmp=tmp_path)
    first, second = run_ranks(_one_rank_looks, 2, str(d), tmp=tmp_path)
    assert first == [[1, 2, 3], 3, [(1, "local"), (2, "local"), (3, "local")], True, [1, 2, 3, 4], "CoordinationTimeout", True]
    assert second == [True, [1, 2, 3, 4], True]


def _objects(url: str) -> list[tuple]:
    bucket = url.split("/")[2]
    listed = client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted((o["Key"], o["Size"], o["ETag"], o["LastModified"]) for o in listed)


def test_read_only_on_a_remote_tier_with_no_local_directory(tmp_path, s3_bucket):
    url, options = s3_bucket
    write_steps(tmp_path / "node", remote=url, storage_options=options, upload_part_bytes=5 << 20)
    before = _objects(url)
    absent = tmp_path / "absent"
    with CheckpointManager(absent, remote=url, storage_options=options, read_only=True) as r:
        assert r.tiers() == {1: "remote", 2: "remote", 3: "remote"}
        out = blank()
        assert r.restore(out) == 3 and same(out, state(3))
        assert r.restore(out, step=1) == 1 and same(out, state(1))
    assert _objects(url) == before and not absent.exists()


def test_read_only_refuses_a_missing_directory_and_bad_values(tmp_path):
    with pytest.raises(CheckpointConfigError, match="is not a directory: nothing to read"):
        CheckpointManager(tmp_path / "nope", read_only=True)
    assert not (tmp_path / "nope").exists()
    with pytest.raises(CheckpointConfigError, match="read_only='yes' is invalid"):
        CheckpointManager(tmp_path / "ck", read_only="yes")  # type: ignore[arg-type]


def test_help_lists_every_constructor_option():
    doc = CheckpointManager.__init__.__doc__ or ""
    names = [n for n in inspect.signature(CheckpointManager.__init__).parameters if n != "self"]
    missing = [n for n in names if f"\n    {n}:" not in doc and f"\n{n}:" not in inspect.cleandoc(doc)]
    assert not missing, f"CheckpointManager's docstring does not describe {missing}"
    fields = {f.name for f in ManagerOptions.__dataclass_fields__.values()}
    assert fields <= set(names), fields - set(names)
    assert "read_only: only read" in pydoc.render_doc(CheckpointManager, renderer=pydoc.plaintext)
