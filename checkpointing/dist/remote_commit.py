"""Committing a step on the remote tier, with one rank or across ranks (I/O through the store).

Every rank uploads its own data files of a step (save/uploader.py), then calls
`commit(seq, committed, error, transfer_s)` of the committer its coordinator gives it
(`Coordinator.remote_committer`):

    one rank      write the manifest, then COMMIT (exclusive create), on the remote tier
    many ranks    through the torch.distributed store, per upload number `seq` (keys.py):
                    up/<seq>/<rank>    each rank's report: its files of the step it names are up, or its error
                    up/<seq>/status    rank 0's verdict after it committed the step (or why not)
                  rank 0 waits for every report, checks that every report names its step (else the
                  upload fails everywhere: a rank uploaded another step), that every data object is on the remote
                  tier with its size, copies its local manifest and COMMIT there, and publishes
                  the verdict; every rank waits for the verdict, so handle.wait() returns on each
                  rank only once the step is durable remotely.

Deadlines: rank 0 waits for the others' reports at most timeout_s + 2x its own transfer time after
its own upload finished (ranks upload similar shares in parallel); the others wait as long again
for the verdict. A rank that does not answer is named in the error. The committer uses a store
connection of its own: the save thread keeps using the coordinator's.
"""

from __future__ import annotations

import json
import logging
import time

from checkpointing.dist import keys
from checkpointing.dist.store import delete_keys, store_errors, wait_keys
from checkpointing.dist.types import StoreRoom
from checkpointing.errors import CheckpointError, CoordinationTimeout, UploadRanksFailed
from checkpointing.format.manifest import CommittedStep
from checkpointing.storage import Storage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")


def commit_remote(local: Storage, remote: Storage, committed: CommittedStep) -> None:
    """Check the step's data objects are on the remote tier (whole), then write its manifest and COMMIT there."""
    step = committed.step
    rank_of_file = {f.path: f.rank for f in committed.files}
    primary = [(f.path, f.primary_bytes) for f in committed.files if f.primary_bytes]
    for path, size, expected in catalog.size_mismatches(remote, primary):
        found = "missing" if size is None else f"{size} bytes"
        raise CheckpointError(
            f"step {step}: data object {remote.url}/{path} is {found}, {expected} expected "
            f"(rank {rank_of_file[path]}'s upload is incomplete, or something deleted it); not committing the step there"
        )
    catalog.copy_commit(local, remote, step)


class LocalTierCommitter:
    """One rank: commit right after the upload."""

    def __init__(self, local: Storage, remote: Storage) -> None:
        self.local, self.remote = local, remote

    def commit(self, seq: int, committed: CommittedStep, error: BaseException | None, transfer_s: float) -> None:
        if error is not None:
            raise error
        commit_remote(self.local, self.remote, committed)

    def close(self) -> None:
        pass


class StoreTierCommitter:
    """Many ranks: reports and rank 0's verdict travel through the store (see the module docstring)."""

    def __init__(self, coord: StoreRoom, local: Storage, remote: Storage) -> None:
        self.local, self.remote = local, remote
        self.rank, self.world_size, self.timeout_s = coord.rank, coord.world_size, coord.timeout_s
        self.store = coord.new_store_client()

    @store_errors
    def commit(self, seq: int, committed: CommittedStep, error: BaseException | None, transfer_s: float) -> None:
        report = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}", "step": committed.step}
        self.store.set(keys.upload(seq, self.rank), json.dumps(report))
        deadline = time.monotonic() + self.timeout_s + 2 * transfer_s
        if self.rank == 0:
            self._decide(seq, committed, deadline)
        status_key = keys.upload_status(seq)
        wait_keys(self.store, [status_key], deadline + self.timeout_s, f"step {committed.step}: waiting for rank 0's remote commit",
                  keys_rank=lambda k: 0, timeout_s=self.timeout_s)
        status = json.loads(self.store.get(status_key))
        if not status["ok"]:
            raise UploadRanksFailed({int(r): c for r, c in status["failures"].items()})

    def _decide(self, seq: int, committed: CommittedStep, deadline: float) -> None:
        reports = [keys.upload(seq, r) for r in range(self.world_size)]
        failures: dict[int, str] = {}
        try:
            wait_keys(self.store, reports, deadline, f"step {committed.step}: waiting for every rank's upload", timeout_s=self.timeout_s)
        except CoordinationTimeout as exc:
            failures = {r: str(exc) for r in exc.ranks}
        else:
            for r, raw in enumerate(self.store.multi_get(reports)):
                msg = json.loads(raw)
                if msg["step"] != committed.step:  # never commit a step some rank did not upload
                    failures[r] = (f"its upload #{seq} is step {msg['step']}, rank 0's is step {committed.step}: "
                                   "the ranks' uploads went out of order (a failed upload tried again on some ranks only)")
                elif not msg["ok"]:
                    failures[r] = msg["error"]
        if seq > 0:  # every rank is past the previous upload: it waited for that verdict
            self._forget(seq - 1)
        if not failures:
            try:
                commit_remote(self.local, self.remote, committed)
            except Exception as exc:  # noqa: BLE001 - the verdict carries it to every rank
                failures[0] = f"committing on the remote tier: {type(exc).__name__}: {exc}"
        verdict = {"ok": not failures, "failures": {str(r): c for r, c in failures.items()}}
        self.store.set(keys.upload_status(seq), json.dumps(verdict))

    def _forget(self, seq: int) -> None:
        delete_keys(self.store, keys.upload_all(seq, self.world_size))

    def close(self) -> None:
        pass

