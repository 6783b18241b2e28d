"""mgr.delete(step) and `checkpointing rm` (issue 17, item 1): every tier, reference-safe with incremental saves.

The rewind story (restore an older step, delete the newer ones, save on) on a local tier and on an S3
tier (moto server on 127.0.0.1), with chunks borrowed across the deleted step; refusals (a missing
step, the newest one, a directory another process writes); two real gloo ranks, each with its own
node-local tier. Nothing is mocked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

from _dist import run_ranks
from _models import child_env
from checkpointing import CheckpointConfigError, CheckpointError, CheckpointManager, CheckpointNotFoundError
from checkpointing.format import naming
from checkpointing.storage import LocalStorage, open_storage
from checkpointing.tier import catalog

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 1 << 16  # floats per tensor: 256 KiB, four 64 KiB chunks
CHANGES = {1: "abcd", 2: "a", 3: "b", 4: "c", 5: "d", 6: "b"}  # which tensors each step changes


def values(step: int, *, salt: float = 0.0) -> dict[str, torch.Tensor]:
    """The state after `step`: each tensor moves by one each time a step up to `step` changes it."""
    out = {}
    for i, k in enumerate("abcd"):
        g = torch.Generator().manual_seed(i)
        times = sum(k in CHANGES[s] for s in range(1, step + 1))
        out[k] = torch.randn(N, generator=g) + times + salt
    return out


class Trainer:
    """One state object updated in place, only the tensors a step changes (so later saves borrow the rest)."""

    def __init__(self) -> None:
        self.state = {k: torch.zeros(N) for k in "abcd"}

    def to(self, step: int, *, salt: float = 0.0) -> dict:
        for k, v in values(step, salt=salt).items():
            if not torch.equal(self.state[k], v):
                self.state[k].copy_(v)
        return self.state


def restored(mgr: CheckpointManager, step: int) -> dict[str, torch.Tensor]:
    out = {k: torch.full((N,), -1.0) for k in "abcd"}
    assert mgr.restore(out, step=step) == step
    return out


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in "abcd")


def manager(d: Path, **kwargs) -> CheckpointManager:
    kwargs.setdefault("keep_local", None)
    return CheckpointManager(d, chunk_bytes=64 << 10, fsync=False, **kwargs)


def files_of(storage, step: int) -> set[str]:
    return {f.path for f in catalog.load_manifest(storage, step).files}


# ------------------------------------------------------------------ local tier


def test_delete_keeps_the_files_later_steps_borrow_and_gc_and_retention_keep_them(tmp_path, run_cli):
    d = tmp_path / "ck"
    t = Trainer()
    with manager(d) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, t.to(step)).wait()
        local = mgr.storage
        borrowed = {p for p in files_of(local, 4) if p.startswith(naming.step_dir(3) + "/")}
        assert borrowed, "step 4 must take tensor b from step 3's pack"
        mgr.delete(3)
        assert mgr.steps() == [1, 2, 4]
        assert not (d / naming.commit_name(3)).exists()
        assert sorted(p.name for p in (d / naming.step_dir(3)).iterdir()) == sorted(Path(p).name for p in borrowed)  # only the pack
        assert same(restored(mgr, 4), values(4)) and same(restored(mgr, 2), values(2))
        with pytest.raises(CheckpointNotFoundError, match="step 3 is not committed"):
            mgr.restore({k: torch.zeros(N) for k in "abcd"}, step=3)
    code, out = run_cli("gc", str(d), "--min-age-s", "0")
    assert code == 0 and "left 1 file(s) of step 3" in out, out
    with manager(d, keep_local=2) as mgr:  # retention after the next save: steps 1 and 2 go, step 3's pack stays
        assert same(restored(mgr, 4), values(4))
        mgr.save(5, t.to(5)).wait()
        assert mgr.steps() == [4, 5]
        assert same(restored(mgr, 4), values(4)) and same(restored(mgr, 5), values(5))
        assert any(p.startswith(naming.step_dir(3) + "/") for p in files_of(mgr.storage, 5))
    code, out = run_cli("verify", str(d))
    assert code == 0 and "all 2 step(s) verified" in out, out


def test_rewind_restore_an_older_step_delete_the_newer_ones_save_on(tmp_path):
    d = tmp_path / "ck"
    t = Trainer()
    with manager(d) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, t.to(step)).wait()
        t.state = {k: torch.zeros(N) for k in "abcd"}
        assert mgr.restore(t.state, step=2) == 2  # a loss spike after step 2: go back there
        t.state["d"] += 0.5  # train on from step 2: this time only d changes
        rewound = {k: v.clone() for k, v in t.state.items()}
        with pytest.raises(CheckpointError, match=r"step 3 is already committed .*mgr\.delete\(3\).*checkpointing rm"):
            mgr.save(3, t.state)
        mgr.delete(3)
        with pytest.raises(CheckpointError, match=r"newest committed step.*allow_latest=True") as err:
            mgr.delete(4)
        assert not isinstance(err.value, CheckpointNotFoundError)
        assert mgr.steps() == [1, 2, 4]
        mgr.delete(4, allow_latest=True)
        assert mgr.steps() == [1, 2]
        assert not (d / naming.step_dir(3)).exists() and not (d / naming.step_dir(4)).exists()  # nothing uses them
        stats = mgr.save(3, t.state).wait()  # a different step 3
        assert stats.bytes_reused == 3 * N * 4, "the save after restoring step 2 takes a, b and c from it"
        assert same(restored(mgr, 3), rewound) and same(restored(mgr, 2), values(2)) and same(restored(mgr, 1), values(1))


def test_deleting_the_base_of_the_next_save_makes_it_write_everything(tmp_path):
    t = Trainer()
    with manager(tmp_path / "ck") as mgr:
        mgr.save(1, t.to(1)).wait()
        mgr.save(2, t.to(2)).wait()
        mgr.delete(2, allow_latest=True)
        stats = mgr.save(3, t.to(3)).wait()
        assert stats.bytes_reused == 0 and stats.bytes_written >= 4 * N * 4
        assert mgr.save(4, t.state).wait().bytes_reused == 4 * N * 4  # nothing changed: all from step 3
        assert same(restored(mgr, 3), values(3)) and same(restored(mgr, 1), values(1))


def test_delete_waits_for_the_save_in_flight(tmp_path):
    t = Trainer()
    with manager(tmp_path / "ck") as mgr:
        mgr.save(1, t.to(1)).wait()
        mgr.save(2, t.to(2))  # not waited for
        mgr.delete(1)
        assert mgr.steps() == [2]
        mgr.save(3, t.to(3))
        mgr.delete(3, allow_latest=True)  # the step being written: deleted once it is committed
        assert mgr.steps() == [2]
        mgr.wait()
        assert same(restored(mgr, 2), values(2))


def test_delete_refuses_a_step_that_is_not_committed(tmp_path):
    with manager(tmp_path / "ck") as mgr:
        with pytest.raises(CheckpointNotFoundError, match=r"step 7 is not committed in .*nothing to delete \(committed steps: none\)"):
            mgr.delete(7)
        mgr.save(1, {"x": torch.arange(4)}).wait()
        mgr.save(2, {"x": torch.arange(4)}).wait()
        (tmp_path / "ck" / naming.step_dir(5)).mkdir()  # an incomplete step: no COMMIT
        with pytest.raises(CheckpointError, match=r"step 5 is not committed.*committed steps: 1, 2\)"):
            mgr.delete(5)
        with pytest.raises(CheckpointConfigError, match="step=-1 is invalid"):
            mgr.delete(-1)
        assert mgr.steps() == [1, 2]
    mgr.close()
    with pytest.raises(CheckpointError, match="closed"):
        mgr.delete(1)


# ------------------------------------------------------------------ S3 tier


def test_rewind_and_delete_on_both_tiers_with_s3(tmp_path, s3_bucket, run_cli):
    url, options = s3_bucket
    remote = open_storage(url, options)
    t = Trainer()

    def reader() -> CheckpointManager:  # another machine: nothing local, reads the remote tier only
        return CheckpointManager(tmp_path / "absent", remote=url, storage_options=options, read_only=True)

    with manager(tmp_path / "node", remote=url, storage_options=options, upload_part_bytes=5 << 20) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, t.to(step)).wait()  # durable on both tiers
        assert any(p.startswith(naming.step_dir(3) + "/") for p in files_of(remote, 4))
        mgr.delete(3)
        assert catalog.list_steps(remote).committed == [1, 2, 4] and catalog.list_steps(mgr.storage).committed == [1, 2, 4]
        assert remote.list(naming.step_dir(3)), "step 4 borrows from step 3's pack: it stays on the remote tier"
        with reader() as r:
            assert r.steps() == [1, 2, 4]
            assert same(restored(r, 4), values(4)) and same(restored(r, 2), values(2))
        code, out = run_cli("gc", url, "--min-age-s", "0", *_opts(options))
        assert code == 0, out
        with reader() as r:
            assert same(restored(r, 4), values(4))
        # the rewind: back to step 2, the newer steps deleted on both tiers, step 3 saved anew
        assert mgr.restore(t.state, step=2) == 2
        mgr.delete(4, allow_latest=True)
        assert mgr.tiers() == {1: "local+remote", 2: "local+remote"}
        assert remote.list(naming.step_dir(3)) == [] and remote.list(naming.step_dir(4)) == []
        mgr.save(3, t.to(3, salt=0.25)).wait()
        assert mgr.tiers() == {1: "local+remote", 2: "local+remote", 3: "local+remote"}
    with reader() as r:
        assert same(restored(r, 3), values(3, salt=0.25)) and same(restored(r, 1), values(1))
    code, out = run_cli("verify", url, *_opts(options))
    assert code == 0 and "all 3 step(s) verified" in out, out


def test_delete_of_a_step_only_on_the_remote_tier(tmp_path, s3_bucket):
    url, options = s3_bucket
    t = Trainer()
    with manager(tmp_path / "node", remote=url, storage_options=options, keep_local=1, upload_part_bytes=5 << 20) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, t.to(step)).wait()
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "local+remote"}
        mgr.delete(1)
        assert mgr.tiers() == {2: "remote", 3: "local+remote"}
        with pytest.raises(CheckpointNotFoundError, match=f"step 1 is not committed in .* or on the remote tier {re.escape(url)}"):
            mgr.delete(1)


def _opts(options: dict) -> list[str]:
    return ["-o", f"endpoint_url={options['endpoint_url']}", "-o", f"key={options['key']}", "-o", f"secret={options['secret']}",
            "-o", "client_kwargs.region_name=us-east-1"]


# ------------------------------------------------------------------ the CLI

HOLDER = textwrap.dedent(
    """
    import sys, time
    from checkpointing import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    print("READY", flush=True)
    time.sleep(600)
    """
)


def test_cli_rm(tmp_path, run_cli, s3_bucket):
    d = tmp_path / "ck"
    url, options = s3_bucket
    t = Trainer()
    with manager(d, remote=url, storage_options=options, upload_part_bytes=5 << 20) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, t.to(step)).wait()
    code, out = run_cli("rm", str(d), "--step", "4")
    assert code == 2 and "step 4 is the newest committed step" in out and "--force" in out, out
    code, out = run_cli("rm", str(d), "--step", "9")
    assert code == 2 and "step 9 is not committed" in out, out
    code, out = run_cli("rm", str(d), "--step", "3")
    assert code == 0 and "deleted step 3" in out and "left 1 file(s) of step 3" in out, out
    code, out = run_cli("ls", str(d), "--json")
    assert [(r["step"], r["state"]) for r in json.loads(out)] == [(1, "committed"), (2, "committed"), (3, "retired"), (4, "committed")]
    code, out = run_cli("rm", str(d), "--step", "4", "--force")
    assert code == 0 and "deleted step 4" in out, out
    assert LocalStorage(d).list("") == ["TIER", "WRITER", "metrics.jsonl", naming.step_dir(1), naming.step_dir(2)]
    code, out = run_cli("rm", url, "--step", "2", *_opts(options))
    assert code == 0 and "deleted step 2" in out, out
    assert catalog.list_steps(open_storage(url, options)).committed == [1, 3, 4]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        code, out = run_cli("rm", str(d), "--step", "1")
        assert code == 2 and f"process {holder.pid}" in out and "checkpointing rm" in out and "mgr.delete(1)" in out, out
    finally:
        holder.kill()
        holder.wait()
    with CheckpointManager(d, read_only=True) as r:
        assert r.steps() == [1, 2]


# ------------------------------------------------------------------ two ranks


def _delete_on_two_nodes(rank: int, world: int, base: str) -> dict:
    """Each rank its own node-local tier: both lose the step; refusals reach every rank."""
    t = Trainer()
    out: dict = {}
    with manager(Path(base) / f"rank{rank}", timeout_s=60) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, t.to(step)).wait()
        mgr.delete(3)
        out["after"] = mgr.steps()
        for bad in ((4,), (9,)):
            try:
                mgr.delete(*bad)
            except CheckpointError as exc:
                out[bad[0]] = str(exc)
                out[f"{bad[0]} type"] = type(exc).__name__  # not found on every rank: CheckpointNotFoundError, as with one
        if rank == 1:  # only rank 1's tier lost step 1: the delete stops on every rank, naming it
            (Path(base) / f"rank{rank}" / naming.commit_name(1)).unlink()
        try:
            mgr.delete(1)
        except CheckpointError as exc:
            out[1] = str(exc)
        mgr.delete(1, missing_ok=True)  # where a node lost it, the others delete it
        out["missing_ok"] = mgr.steps()
        assert same(restored(mgr, 4), values(4))
        mgr.restore(t.state, step=2)
        mgr.delete(4, allow_latest=True)
        mgr.save(3, t.to(3, salt=1.0)).wait()
        out["end"] = mgr.steps()
        assert same(restored(mgr, 3), values(3, salt=1.0))
    return out


def test_delete_with_two_ranks_is_collective(tmp_path):
    results = run_ranks(_delete_on_two_nodes, 2, str(tmp_path), tmp=tmp_path)
    for rank, out in enumerate(results):
        assert out["after"] == [1, 2, 4] and out["missing_ok"] == [2, 4] and out["end"] == [2, 3], out
        assert "ranks 0-1" in out[4] and "newest committed step" in out[4], out
        assert "step 9 is not committed" in out[9], out
        assert (out["9 type"], out["4 type"]) == ("CheckpointNotFoundError", "CheckpointError"), out
        assert out[1].startswith("rank 1: step 1 is not committed in") and "rank1" in out[1], out
    for rank in (0, 1):
        assert not (tmp_path / f"rank{rank}" / naming.step_dir(4)).exists()


def _resume_after_a_node_lost_steps(rank: int, world: int, base: str, phase: str) -> dict:
    """Each rank its own node-local tier; between the two jobs rank 1's node lost steps 3 and 4."""
    t = Trainer()
    with manager(Path(base) / f"rank{rank}", timeout_s=60) as mgr:
        if phase == "first job":
            for step in (1, 2, 3, 4):
                mgr.save(step, t.to(step)).wait()
            return {}
        out = {"restored": mgr.restore(t.state), "after restore": mgr.steps()}  # restoring alone deletes nothing
        for step in (3, 4):  # the training loop goes on from step 2, with other values than the lost run
            mgr.save(step, t.to(step, salt=1.0)).wait()
        out["end"] = mgr.steps()
        assert same(restored(mgr, 4), values(4, salt=1.0)) and same(restored(mgr, 3), values(3, salt=1.0))
    return out


def test_training_goes_on_after_a_node_lost_the_newest_steps(tmp_path):
    """restore(step=None) with several ranks passes over the steps one node lost; the next save()
    deletes them on the ranks that still hold them, so the loop saves those step numbers again."""
    run_ranks(_resume_after_a_node_lost_steps, 2, str(tmp_path), "first job", tmp=tmp_path)
    for step in (3, 4):
        (tmp_path / "rank1" / naming.commit_name(step)).unlink()
    results = run_ranks(_resume_after_a_node_lost_steps, 2, str(tmp_path), "second job", tmp=tmp_path)
    assert results[0] == {"restored": 2, "after restore": [1, 2, 3, 4], "end": [1, 2, 3, 4]}, results
    assert results[1] == {"restored": 2, "after restore": [1, 2], "end": [1, 2, 3, 4]}, results


def _delete_on_rank_zero_only(rank: int, world: int, base: str) -> str:
    with manager(Path(base) / "shared", timeout_s=5) as mgr:
        mgr.save(1, {"x": torch.arange(8)}).wait()
        mgr.save(2, {"x": torch.arange(8)}).wait()
        if rank == 0:  # the wrong use: rank 1 never calls delete()
            try:
                mgr.delete(1)
            except CheckpointError as exc:
                return str(exc)
            return "not refused"
        return "skipped"


def test_delete_on_one_rank_only_is_a_clear_error(tmp_path):
    msg, _ = run_ranks(_delete_on_rank_zero_only, 2, str(tmp_path), tmp=tmp_path)
    assert "delete(1)" in msg and "every rank calls delete()" in msg and "rank 1 did not answer" in msg, msg
    assert (tmp_path / "shared" / naming.commit_name(1)).exists(), "nothing was deleted"
