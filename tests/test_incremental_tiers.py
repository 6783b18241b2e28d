"""Incremental saves across ranks and on the remote tier, end to end: real gloo processes on
127.0.0.1 (tests/_dist.py, tests/_incremental.py), the real moto S3 server through s3fs
(tests/s3_server.py), faults injected into the real backend (tests/faults.py). Nothing is mocked.

A rank writes only the chunks that changed since its previous committed save; the manifest refers
to the unchanged ones in earlier steps' pack files. These tests check what that saves (bytes
written and uploaded), that every retained step still restores bit-exactly on either tier and on
another world size, and that retention and a failed upload never leave a committed step pointing
at a file its tier does not hold.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from faults import Fault, inject
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

import _incremental
from _dist import run_ranks
from checkpointing import CheckpointManager, CheckpointUploadError
from checkpointing.tier import catalog
from checkpointing.format import naming
from checkpointing.storage import LocalStorage, RetryPolicy, open_storage
from checkpointing.tier.verify import verify_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20
FAST = RetryPolicy(attempts=3, base_s=0.001, cap_s=0.005)


def verify_all(storage, expect: list[int] | None = None) -> list[int]:
    """Every committed step on the tier verifies completely (every chunk it references, any file)."""
    committed = catalog.list_steps(storage).committed
    if expect is not None:
        assert committed == expect, committed
    for step in committed:
        report = verify_step(storage, step)
        assert report.ok and report.bytes_checked > 0, (step, report.problems)
    return committed


def files_of(storage, step: int) -> set[str]:
    return {f.path for f in catalog.load_manifest(storage, step).files}


def earlier_files(storage, step: int) -> set[str]:
    """The files `step` references outside its own directory (earlier steps' packs)."""
    return {f for f in files_of(storage, step) if not f.startswith(naming.step_dir(step) + "/")}


def packs_on_disk(root: Path, but: int) -> set[str]:
    return {str(p.relative_to(root)) for p in root.glob("step-*/*.pack") if p.parent.name != naming.step_dir(but)}


# ----------------------------------------------------------------------------- 1. two ranks, FSDP2, shared local directories


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Two ranks save 4 steps of the FSDP2 model (frozen base, trained head) into shared directories."""
    tmp = tmp_path_factory.mktemp("fsdp")
    directory, refs = tmp / "ck", tmp / "refs"
    refs.mkdir()
    return directory, refs, run_ranks(_incremental.save_incremental, 2, str(directory), str(refs), tmp=tmp)


def test_two_ranks_write_only_what_changed_and_every_step_restores(fsdp_run, tmp_path):
    directory, refs, results = fsdp_run
    frozen = _incremental.frozen_bytes()
    for name in ("all", "one"):
        per_rank = [r[name] for r in results]
        for rank, stats in enumerate(per_rank):
            assert [s["step"] for s in stats] == [1, 2, 3, 4] and all(s["ok"] for s in stats)
            first = stats[0]
            assert first["bytes_reused"] == 0 and first["chunks_reused"] == 0
            assert first["bytes_written"] >= first["bytes_total"] // 2, first  # about half of everything per rank
            for s in stats[1:]:
                # the rank's half of the frozen part (at least) is taken from step 1 instead of written
                assert s["bytes_reused"] >= frozen // 2 * 0.9 and s["chunks_reused"] > 0, (rank, s)
                assert s["bytes_written"] < 0.25 * first["bytes_written"], (rank, s, first)
            # step 3: nothing changed since step 2, so nothing is written at all
            assert stats[2]["bytes_written"] == 0 and stats[2]["chunks_reused"] >= stats[2]["chunks_total"] - 2, stats[2]
        written = [sum(r[i]["bytes_written"] for r in per_rank) for i in range(4)]
        assert written[1] < 0.2 * written[0] and written[3] < 0.2 * written[0], written
        assert written[0] >= frozen, written

    every = LocalStorage(directory / "all")
    verify_all(every, [1, 2, 3, 4])
    assert earlier_files(every, 2) and earlier_files(every, 2) <= files_of(every, 1)  # the frozen part stays in step 1's packs
    assert earlier_files(every, 4) <= files_of(every, 1)
    assert files_of(every, 3) == earlier_files(every, 3)  # step 3 wrote nothing of its own

    # keep_local=1: only step 4 is committed, but the packs of earlier steps it refers to stay (and only those)
    one_root = directory / "one"
    one = LocalStorage(one_root)
    verify_all(one, [4])
    needed = earlier_files(one, 4)
    assert needed and all(f.startswith(naming.step_dir(1) + "/") for f in needed), needed
    assert packs_on_disk(one_root, but=4) == needed
    assert not (one_root / naming.step_dir(1) / naming.COMMIT_NAME).exists()
    assert not (one_root / naming.step_dir(2)).exists() and not (one_root / naming.step_dir(3)).exists()

    # resharded: the same checkpoints restored on one rank (FSDP2 over a 1-rank mesh)
    assert run_ranks(_incremental.restore_one_rank, 1, str(directory), str(refs), tmp=tmp_path) == [True]


def test_a_per_rank_tensor_does_not_cost_the_second_save_its_reuse(fsdp_run):
    """The state also holds a small tensor that differs between ranks (a per-rank RNG or loader
    state): the second save must still take the unchanged frozen part from step 1."""
    directory, _, results = fsdp_run
    frozen = _incremental.frozen_bytes()
    for rank, r in enumerate(results):
        stats = r["rng"]
        assert all(s["ok"] for s in stats) and stats[0]["bytes_reused"] == 0
        table = [(s["step"], s["bytes_written"], s["bytes_reused"]) for s in stats]
        for s in stats[1:]:
            assert s["bytes_reused"] >= frozen // 2 * 0.9 and s["bytes_written"] < 0.25 * stats[0]["bytes_written"], (rank, table)
    verify_all(LocalStorage(directory / "rng"), [1, 2, 3, 4])


def test_two_restarted_ranks_take_the_frozen_shards_from_the_restored_step(fsdp_run, tmp_path):
    """New processes restore step 4 of the per-rank directory at the same world size; their first
    save writes the trained head, not the frozen shards (matched by place and digest)."""
    directory, refs, results = fsdp_run
    frozen = _incremental.frozen_bytes()
    stats = run_ranks(_incremental.restart_and_save, 2, str(directory), str(refs), tmp=tmp_path)
    for rank, s in enumerate(stats):
        first = results[rank]["rng"][0]
        assert s["ok"] and s["step"] == 5, s
        assert s["bytes_reused"] >= frozen // 2 * 0.9 and s["bytes_written"] < 0.25 * first["bytes_written"], (rank, s, first)
    verify_all(LocalStorage(directory / "rng"), [1, 2, 3, 4, 5])


# ----------------------------------------------------------------------------- single process + S3


def remote_manager(local: Path, bucket: tuple[str, dict], **kwargs) -> CheckpointManager:
    url, options = bucket
    mgr = CheckpointManager(local, remote=url, storage_options=options, upload_part_bytes=5 * MiB, **kwargs)
    mgr.remote_storage.retry = FAST
    return mgr


class Run:
    """A frozen base (plain tensors, never changed), an extra tensor changed only when asked, and a
    trained head with AdamW."""

    def __init__(self, base_n: int = 1 << 17, parts: int = 4) -> None:
        g = torch.Generator().manual_seed(0)
        self.base = {f"w{i}": torch.randn(base_n, generator=g) for i in range(parts)}
        self.extra = torch.zeros(1 << 17)
        torch.manual_seed(1)
        self.head = torch.nn.Linear(64, 64)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=1e-2)
        self.i = 0
        self.train()

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def train(self) -> None:
        self.i += 1
        g = torch.Generator().manual_seed(self.i)
        x = torch.randn(8, 64, generator=g)
        self.head(x).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict:
        return {"base": self.base, "extra": self.extra, "head": self.head, "optim": self.opt, "i": self.i}

    def snapshot(self) -> dict:
        return {"base": {k: v.clone() for k, v in self.base.items()}, "extra": self.extra.clone(),
                "head": {k: v.detach().clone() for k, v in self.head.state_dict().items()},
                "optim": copy.deepcopy(self.opt.state_dict()), "i": self.i}


def restore_into_fresh(mgr: CheckpointManager, step: int | None = None) -> tuple[int | None, dict]:
    """Restore into a fresh state (other values everywhere) and return it in snapshot() form."""
    fresh = Run.__new__(Run)
    fresh.base = {k: torch.full_like(v, -1.0) for k, v in Run().base.items()}
    fresh.extra = torch.full((1 << 17,), -1.0)
    torch.manual_seed(99)
    fresh.head = torch.nn.Linear(64, 64)
    fresh.opt = torch.optim.AdamW(fresh.head.parameters(), lr=1e-2)
    state = {"base": fresh.base, "extra": fresh.extra, "head": fresh.head, "optim": fresh.opt, "i": -1}
    got = mgr.restore(state, step=step)
    fresh.i = state["i"]
    return got, fresh.snapshot()


def restores_from_the_remote_alone(tmp_path: Path, bucket: tuple[str, dict], refs: dict, *, newest: int, older: int) -> None:
    """A new machine (an empty local directory) sees exactly `older` and `newest` on the remote tier
    and restores both (newest by default) bit-exactly."""
    with remote_manager(tmp_path / "new-machine", bucket) as mgr:
        assert mgr.tiers() == {older: "remote", newest: "remote"}
        for step, asked in ((newest, None), (older, older)):
            got, restored = restore_into_fresh(mgr, step=asked)
            assert got == step
            assert_equal(refs[step], restored)


def assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, sorted(a, key=str), sorted(b, key=str))
        for k in a:
            assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


# ----------------------------------------------------------------------------- 2. remote tier, single process


def test_remote_uploads_only_new_files_and_restores_from_the_remote_alone(tmp_path, s3_bucket):
    local = tmp_path / "local"
    run = Run()
    remote = open_storage(*s3_bucket)
    refs, stats = {}, []
    with remote_manager(local, s3_bucket, keep_local=1, keep_remote=2) as mgr:
        for step in (1, 2, 3, 4):
            if step > 1:
                run.train()
            refs[step] = run.snapshot()
            stats.append(mgr.save(step, run.state()).wait())
            assert stats[-1].ok and stats[-1].tier == "local+remote", stats[-1]
            verify_all(remote)  # after this upload's remote retention ran
        assert mgr.tiers() == {3: "remote", 4: "local+remote"}
    first = stats[0]
    assert first.bytes_upload_reused == 0
    assert first.bytes_total <= first.bytes_uploaded <= first.bytes_total + 64 * 1024, first  # about the full state
    for s in stats[1:]:
        assert s.bytes_reused >= run.base_bytes + (1 << 19) and s.bytes_written < 0.1 * first.bytes_written, s
        # only the new pack goes up; step 1's pack (the frozen base) is on the remote tier already
        assert s.bytes_uploaded == s.bytes_written and s.bytes_uploaded < 0.1 * first.bytes_uploaded, s
        assert s.bytes_upload_reused == first.bytes_uploaded, s

    # retention on both tiers: step 1 and 2 are retired, step 1's pack stays (3 and 4 refer to it), step 2's is gone
    verify_all(remote, [3, 4])
    step1_packs = earlier_files(remote, 4)
    assert step1_packs and earlier_files(remote, 3) == step1_packs
    assert all(f.startswith(naming.step_dir(1) + "/") for f in step1_packs), step1_packs
    assert remote.list(naming.step_dir(1)) == sorted(Path(f).name for f in step1_packs)  # no COMMIT, no manifest
    assert remote.list(naming.step_dir(2)) == []
    assert catalog.list_steps(LocalStorage(local)).committed == [4]
    assert packs_on_disk(local, but=4) == earlier_files(LocalStorage(local), 4) == step1_packs

    shutil.rmtree(local)  # the machine is gone: a new one has only the bucket
    restores_from_the_remote_alone(tmp_path, s3_bucket, refs, newest=4, older=3)
    verify_all(remote, [3, 4])


# ----------------------------------------------------------------------------- 3. the upload after a failed one


def test_a_failed_upload_goes_again_once_the_remote_tier_answers_and_the_next_carries_what_it_needs(tmp_path, s3_bucket):
    local = tmp_path / "local"
    run = Run()
    remote = open_storage(*s3_bucket)
    refs = {}
    with remote_manager(local, s3_bucket, keep_local=1) as mgr:
        refs[1] = run.snapshot()
        first = mgr.save(1, run.state()).wait()
        # step 2 changes `extra` (kept as it is from then on); its upload is refused for good
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1, path=f"*{naming.step_dir(2)}/*"))
        run.extra.add_(1.5)
        run.train()
        refs[2] = run.snapshot()
        with pytest.raises(CheckpointUploadError, match="AccessDenied"):
            mgr.save(2, run.state()).wait()
        assert mgr.tiers() == {1: "remote", 2: "local"}  # keep_local=1: step 1 is on the remote tier only
        assert catalog.list_steps(remote).committed == [1]
        proxy.faults.clear()
        # the remote tier failed last, so step 2 waits (one process); step 3 takes `extra` from step 2's pack, and its
        # upload sends that pack too: every upload carries what its step needs
        run.train()
        refs[3] = run.snapshot()
        third = mgr.save(3, run.state()).wait()
        assert third.ok and third.tier == "local+remote", third
        assert catalog.list_steps(remote).committed == [1, 3]
        run.train()
        refs[4] = run.snapshot()
        fourth = mgr.save(4, run.state()).wait()  # the remote tier answered: step 2 goes again first, its pack there already
        assert fourth.ok and fourth.tier == "local+remote", fourth
    earlier = earlier_files(remote, 3)  # keep_local=1: step 3 is on the remote tier only now
    step2 = {f for f in earlier if f.startswith(naming.step_dir(2) + "/")}
    step1 = {f for f in earlier if f.startswith(naming.step_dir(1) + "/")}
    assert step2 and step1, earlier
    step2_bytes = sum(f.primary_bytes for f in catalog.load_manifest(remote, 3).files if f.path in step2)
    assert step2_bytes >= run.extra.numel() * 4
    assert third.bytes_uploaded == third.bytes_written + step2_bytes, (third, step2_bytes)
    assert third.bytes_upload_reused == first.bytes_uploaded, third  # step 1's pack was there
    assert verify_all(remote) == [1, 2, 3, 4]

    shutil.rmtree(local)
    with remote_manager(tmp_path / "new-machine", s3_bucket) as mgr:  # every step, from the remote tier alone
        assert mgr.tiers() == {1: "remote", 2: "remote", 3: "remote", 4: "remote"}
        for step in (4, 3, 2, 1):
            got, restored = restore_into_fresh(mgr, step=step)
            assert got == step
            assert_equal(refs[step], restored)
    assert refs[3]["extra"][0] == 1.5


# ----------------------------------------------------------------------------- 4. two ranks + remote


def test_two_ranks_incremental_with_a_remote_tier_restore_from_the_remote_alone(tmp_path, s3_bucket):
    url, options = s3_bucket
    base, refs = tmp_path / "nodes", tmp_path / "refs"
    refs.mkdir()
    results = run_ranks(_incremental.save_incremental_remote, 2, str(base), url, options, str(refs), tmp=tmp_path)
    remote = open_storage(url, options)
    verify_all(remote, [2, 3])
    frozen = _incremental.frozen_bytes()
    for rank, r in enumerate(results):
        stats = r["stats"]
        assert all(s["ok"] and s["tier"] == "local+remote" for s in stats), stats
        first = stats[0]
        assert first["bytes_reused"] == 0 and first["bytes_upload_reused"] == 0 and first["bytes_uploaded"] > 0
        for s in stats[1:]:
            assert s["bytes_reused"] >= frozen // 2 * 0.9 and s["bytes_written"] < 0.25 * first["bytes_written"], (rank, s)
            assert s["bytes_uploaded"] < 0.25 * first["bytes_uploaded"], (rank, s)
            assert s["bytes_upload_reused"] == first["bytes_uploaded"], (rank, s)  # its step-1 pack is there already
        # rank 0 applies keep_remote before its wait() returns; another rank's wait() may return first
        assert r["tiers"] == {2: "remote", 3: "local+remote"} or (rank > 0 and r["tiers"] == {1: "remote", 2: "remote", 3: "local+remote"}), r["tiers"]
        assert r["fresh_tiers"] == {2: "remote", 3: "remote"}, r["fresh_tiers"]
        assert r["restored"] and all("from the remote tier" in line for line in r["restored"]), r["restored"]
        # keep_local=1: the node keeps step 3 and the step-1 pack it refers to
        assert {p.split("/")[0] for p in r["local_packs"]} <= {naming.step_dir(1), naming.step_dir(3)}, r["local_packs"]
    total = sum(r["stats"][0]["bytes_uploaded"] for r in results)
    later = [sum(r["stats"][i]["bytes_uploaded"] for r in results) for i in (1, 2)]
    assert all(n < 0.2 * total for n in later), (total, later)
    assert earlier_files(remote, 3) and all(f.startswith(naming.step_dir(1) + "/") for f in earlier_files(remote, 3))
    assert earlier_files(remote, 2) == earlier_files(remote, 3)


def test_a_replicated_tensor_whose_primary_moves_to_a_local_only_copy_is_written_again(tmp_path, s3_bucket):
    """Regression: an incremental save took the new primary copy of a replicated tensor from the
    part of an earlier file that only the local tier holds (past its uploaded prefix); the merge
    refused the step on every rank ("takes a primary copy from past its uploaded prefix") and no
    later step could commit. Such a chunk is written again, and every step restores from the
    remote tier alone."""
    url, options = s3_bucket
    results = run_ranks(_incremental.replicated_tensor_moves_its_primary, 2, str(tmp_path / "nodes"), url, options, tmp=tmp_path)
    for rank, r in enumerate(results):
        assert all(s["ok"] for s in r["stats"]), r["stats"]
        assert r["stats"][1]["bytes_reused"] > 0, (rank, r["stats"])  # still incremental where it may be
    verify_all(open_storage(url, options), [1, 2, 3])
