"""Workers for the multi-rank remote-tier tests (spawned by _dist.run_ranks; module level so they import).

Each rank has its own node-local directory `<base>/node<rank>`; the remote tier is a bucket on the
test session's moto server (127.0.0.1), reached with the storage options the parent passes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from _dist import assert_same, build, full_state, train

MiB = 1 << 20


def _manager(base: str, rank: int, url: str, options: dict, **kwargs: Any):
    from checkpointing import CheckpointManager

    return CheckpointManager(f"{base}/node{rank}", remote=url, storage_options=options, timeout_s=60,
                             upload_part_bytes=5 * MiB, **kwargs)


def _state(model: Any, opt: Any, table: torch.Tensor) -> dict[str, Any]:
    return {"model": model, "optim": opt, "table": table, "cfg": {"lr": 0.01}}


def save_remote(rank: int, world: int, base: str, url: str, options: dict, ref_path: str) -> dict[str, Any]:
    """Train, save step 1 on every node-local tier and the remote tier; return what each rank saw."""
    model, opt = build(world)
    train(model, opt, 2, rank=rank)
    table = torch.arange(1 << 16, dtype=torch.float32)  # replicated: uploaded once in total
    ref = full_state(model, opt)  # a collective: every rank takes part
    if rank == 0:
        torch.save(ref, ref_path)
    with _manager(base, rank, url, options) as mgr:
        stats = mgr.save(1, _state(model, opt, table)).wait()
        return {"tier": stats.tier, "uploaded": stats.bytes_uploaded, "tiers": mgr.tiers(), "ok": stats.ok}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def restore_remote(rank: int, world: int, base: str, url: str, options: dict, ref_path: str) -> str:
    """Restore the newest step into a fresh model; check it bit-exactly; return this rank's restore log line."""
    lines = _Lines()
    logger = logging.getLogger("checkpointing")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    model, opt = build(world, seed=5)
    table = torch.zeros(1 << 16)
    cfg: dict = {}
    with _manager(base, rank, url, options) as mgr:
        step = mgr.restore({"model": model, "optim": opt, "table": table, "cfg": cfg})
    assert step == 1, step
    assert_same(torch.load(ref_path), full_state(model, opt))
    assert torch.equal(table, torch.arange(1 << 16, dtype=torch.float32)) and cfg == {"lr": 0.01}
    return next(line for line in lines.lines if "restored step" in line)


def crash_before_remote_commit(rank: int, world: int, base: str, url: str, options: dict, shared: bool) -> str:
    """Rank 0 'dies' before the remote COMMIT of step 1; with `shared`, both ranks use one node's local tier."""
    from faults import Fault, inject

    from checkpointing import CheckpointManager, CheckpointUploadError

    local = f"{base}/node0" if shared else f"{base}/node{rank}"
    with CheckpointManager(local, remote=url, storage_options=options, timeout_s=60, upload_part_bytes=5 * MiB) as mgr:
        if rank == 0:
            inject(mgr.remote_storage, Fault("put_object", "crash", path="*/COMMIT"))
        try:
            mgr.save(1, {"x": torch.full((1 << 18,), float(rank)), "w": torch.arange(1 << 16, dtype=torch.float32)}).wait()
        except CheckpointUploadError as exc:
            return str(exc)
    return "uploaded"


def restart_and_restore(rank: int, world: int, base: str, url: str, options: dict) -> tuple[int | None, dict[int, str]]:
    """A restart on `world` ranks, each on node<rank> (a new node starts empty): restore the replicated `w`."""
    from checkpointing import CheckpointManager

    with CheckpointManager(f"{base}/node{rank}", remote=url, storage_options=options, timeout_s=60, upload_part_bytes=5 * MiB) as mgr:
        w = torch.zeros(1 << 16)
        step = mgr.restore({"w": w}, only="w")
        assert step is None or torch.equal(w, torch.arange(1 << 16, dtype=torch.float32))
        mgr.wait()
        return step, mgr.tiers()


def upload_fails_on_one_rank(rank: int, world: int, base: str, url: str, options: dict, bad_rank: int) -> list[str]:
    """Rank `bad_rank` gets 403s from the remote tier: the step stays local everywhere, every rank names it."""
    from faults import Fault, inject

    from checkpointing import CheckpointUploadError

    x = torch.randn(1 << 18) + rank
    out = []
    with _manager(base, rank, url, options) as mgr:
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1)) if rank == bad_rank else None
        try:
            mgr.save(1, {"x": x}).wait()
            out.append("uploaded")
        except CheckpointUploadError as exc:
            out.append(str(exc))
        assert mgr.tiers() == {1: "local"}, mgr.tiers()
        if proxy is not None:
            proxy.faults.clear()
        stats = mgr.save(2, {"x": x + 1}).wait()  # uploads normally
        out.append(stats.tier)
        out.append(repr(mgr.tiers()))
        mgr.save(3, {"x": x + 2}).wait()  # tries step 1's upload again first (two uploads later: every rank knows it failed)
        out.append(repr(mgr.tiers()))
    return out


def uploads_tried_again(rank: int, world: int, base: str, url: str, options: dict) -> dict[str, Any]:
    """Rank 1 gets 403s for saves 1-5, then none: every rank tries the same failed uploads again, in step, each at
    most 3 times, each before the upload numbered two after its last try (test_tiered.py spells the sequence out).
    Step 7's upload fails too, and delete(7) means that save 8 does not try it again."""
    from faults import Fault, inject

    from checkpointing import CheckpointUploadError

    lines = _Lines()
    logging.getLogger("checkpointing").addHandler(lines)
    failed = []
    with _manager(base, rank, url, options, keep_local=None) as mgr:
        proxy = inject(mgr.remote_storage, Fault("*", "denied", times=-1)) if rank == 1 else None
        for step in range(1, 6):
            try:
                mgr.save(step, {"x": torch.full((1 << 16,), float(step + rank))}).wait()
            except CheckpointUploadError as exc:
                failed.append(exc.step)
        if proxy is not None:
            proxy.faults.clear()
        mgr.save(6, {"x": torch.full((1 << 16,), 6.0 + rank)}).wait()
        if proxy is not None:
            proxy.faults.append(Fault("*", "denied", times=-1))
        try:
            mgr.save(7, {"x": torch.zeros(1 << 16)}).wait()
        except CheckpointUploadError as exc:
            failed.append(exc.step)
        if proxy is not None:
            proxy.faults.clear()
        mgr.delete(7, allow_latest=True)  # a collective call: no rank tries step 7's upload again
        mgr.save(8, {"x": torch.ones(1 << 16)}).wait()
        mgr.wait()
        again = [int(m.split("step ")[1].split()[0]) for m in lines.lines if m.startswith("checkpointing: trying the failed upload")]
        return {"failed": failed, "again": again, "tiers": mgr.tiers(), "records": {s.step: (s.ok, s.upload_tries) for s in mgr.stats()}}


def crash_then_resume(rank: int, world: int, base: str, url: str, options: dict, phase: str) -> Any:
    """phase 'crash': rank 0 'dies' between the data and COMMIT; phase 'resume': new managers finish the upload."""
    from faults import Fault, inject

    from checkpointing import CheckpointUploadError

    with _manager(base, rank, url, options) as mgr:
        if phase == "crash":
            if rank == 0:
                inject(mgr.remote_storage, Fault("put_object", "crash", path="*/COMMIT"))
            try:
                mgr.save(1, {"x": torch.full((1 << 18,), float(rank))}).wait()
            except CheckpointUploadError as exc:
                return str(exc)
            return "uploaded"
        mgr.wait()  # the upload resumed at start-up
        x = {"x": torch.zeros(1 << 18)}
        assert mgr.restore(x) == 1 and torch.equal(x["x"], torch.full((1 << 18,), float(rank)))
        return mgr.tiers()


def uploads_out_of_order(rank: int, world: int, base: str, url: str, options: dict) -> str:
    """Steps 1 and 2 committed locally on both nodes; rank 0 reports step 1 as an upload's number, rank 1 step 2:
    rank 0 must fail that upload on every rank, never commit step 1 with rank 1's files missing."""
    from checkpointing import CheckpointManager
    from checkpointing.format.manifest import CommittedStep
    from checkpointing.tier import catalog

    with CheckpointManager(f"{base}/node{rank}", timeout_s=60, keep_local=None) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((1 << 16,), float(step + rank))}).wait()
        mine = 1 + rank
        committed = CommittedStep.of(*catalog.committed_manifest(mgr.storage, mine))
        remote = _remote(url, options)
        committer = mgr._coord.remote_committer(mgr.storage, remote)
        try:
            committer.commit(99, committed, None, 0.0)
            return "committed"
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            return f"{type(exc).__name__}: {exc}"


def _remote(url: str, options: dict) -> Any:
    from checkpointing.storage import FsspecStorage

    return FsspecStorage(url, storage_options=options)
