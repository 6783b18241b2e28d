"""The record of each finished save: its SaveStats in `mgr.stats()`, on the job, in the log (orchestration).

Called on the background threads: by the worker (ckpt-io) when a save without a remote tier is
committed or failed, and after each upload (ckpt-upload) once the step is on the remote tier too.
The record goes to metrics.jsonl and on_metrics once its step cost is final (observe/accounting.py),
which may be right away; its step fields then replace it in `stats()` and on the job.

At start-up (`recover`, from the manager, before any save): the saves an earlier process committed
but was killed before recording get a record written from their manifests (SaveStats.recovered);
one whose upload this process resumes gets it when that upload ends.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Any

from checkpointing.errors import CheckpointError, CheckpointUploadError
from checkpointing.format import naming
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.observe.metrics import SaveStats, failed_uploads, last_recorded_step, log_save
from checkpointing.save.job import SaveJob, UploadJob
from checkpointing.save.staging import StagingPool
from checkpointing.save.uploader import Uploader
from checkpointing.storage import Storage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")


KEPT = 10_000  # records stats() holds: a long run saving every few seconds must not grow without bound


class SaveRecords:
    """The last KEPT finished saves' SaveStats, oldest first (thread-safe; metrics.jsonl keeps every
    one). `local` and `remote` name the tiers in log lines (remote: its URL, "" without one)."""

    def __init__(self, acct: SaveAccounting, pool: StagingPool, *, rank: int, world_size: int, local: str, remote: str) -> None:
        self._acct = acct
        self._pool = pool
        self._rank, self._world_size = rank, world_size
        self._local, self._remote = local, remote
        self._lock = threading.Lock()
        self._stats: collections.deque[SaveStats] = collections.deque(maxlen=KEPT)
        self._storage: Storage | None = None  # the local tier, once recover() ran
        self._recovering: set[int] | None = None  # resumed uploads whose save has no record yet (None: before recover())
        self._early: dict[int, UploadJob] = {}  # resumed uploads that ended before recover()
        # saves recorded with their upload failed that a resumed upload (or a try of one) may make durable remotely:
        # step -> (that record, the upload's tries before this process's)
        self._upload_failed: dict[int, tuple[dict[str, Any], int]] = {}

    def all(self) -> list[SaveStats]:
        with self._lock:
            return list(self._stats)

    def record(self, job: SaveJob, upload: UploadJob | None = None) -> None:
        """The save's SaveStats into all() and the log; its record goes to metrics.jsonl and
        on_metrics once its step cost is final (accounting.py), which may be right now."""
        with job.staging.lock:  # the guard may still be adding its wait
            stats = stats_of(job, upload, staging_bytes=self._pool.capacity, rank=self._rank, world_size=self._world_size)
        stats = self._acct.durable(stats, functools.partial(self._replace, job))
        with self._lock:
            self._stats.append(stats)
            job.outcome.stats = stats
        log_save(stats, self._local if upload is None else f"{self._local} and {self._remote}")
        self._acct.settle(job.step, stats.ok)

    def upload_finished(self, upload: UploadJob) -> None:
        """After each upload (on the upload thread, before upload.done is set): its save's record; for a later try of
        a failed upload, or an upload resumed at start-up, a log line and, for a save recorded with its upload failed,
        another record of that save (SaveStats.upload_tries)."""
        if upload.error is not None:
            upload.error = CheckpointUploadError(upload.step, self._remote, upload.error)
        if upload.save is not None and upload.tries == 1:
            self.record(upload.save, upload)
            return
        if upload.error is not None:
            upload.error_reported = True  # no save() of this process waits for it: a later one tries again, or says it gave up
            log.error("checkpointing: %s", upload.error)
        else:
            log.info("checkpointing: %s of step %d finished (%.1f MB sent, %.1f MB were there already) -> %s",
                     "resumed upload" if upload.tries == 1 else f"upload (try {upload.tries})", upload.step,
                     upload.bytes_uploaded / 1e6, upload.bytes_present / 1e6, self._remote)
        if upload.save is not None:
            self._save_uploaded(upload.save, upload)
            return
        with self._lock:
            if self._recovering is None:
                self._early[upload.step] = upload
            else:
                self._resumed_ended(upload)

    def _save_uploaded(self, job: SaveJob, upload: UploadJob) -> None:
        """A later try of the failed upload of a save of this process ended: its record, amended with this try (on the
        remote tier now, or failed again), replaces the one in stats() and follows it in metrics.jsonl (unless its cost
        is not final yet: then it is the one written)."""
        fields = _tried(upload, upload.tries)
        with self._lock:
            old = job.outcome.stats
            if old is None:  # not recorded (never the case: the failed try recorded it)
                return
            if upload.error is None:
                job.outcome.retried = fields
            new = dataclasses.replace(old, **fields)
            self._swap(old, new)
            job.outcome.stats = new
        if not self._acct.amend(old, new):
            self._acct.sink.emit(new.as_dict(), now=True)

    def _resumed_ended(self, upload: UploadJob) -> None:
        """(Under the lock, once recover() ran.) A resumed upload, or a try of one, ended: the recovered record
        recover() left to it; or another record of a save recorded with its upload failed, for this try."""
        if upload.step in self._recovering:  # type: ignore[operator]
            self._recovering.discard(upload.step)  # type: ignore[union-attr]
            ok = upload.error is None
            stats = self._recovered(upload.step, ok=ok, tier="local+remote" if ok else "local", upload=upload,
                                    error=None if ok else f"{type(upload.error).__name__}: {upload.error}")
            if stats is not None and not ok:
                self._upload_failed[upload.step] = (stats.as_dict(), 0)
        elif upload.step in self._upload_failed:  # every try's record: the next process counts on from the last
            rec, tried = self._upload_failed[upload.step] if upload.error is not None else self._upload_failed.pop(upload.step)
            self._acct.sink.emit(dict(rec, **_tried(upload, tried + upload.tries)), now=True)

    def recover(self, storage: Storage, *, resumed: set[int], remote: Uploader | None) -> None:
        """At start: a record (SaveStats.recovered) for each step committed on the local tier (or on the
        remote tier, when local retention removed it since) after the last one this rank recorded there,
        whose process was killed before recording it; a step whose upload is resumed (`resumed`) gets it
        once the upload ends. `remote`: the remote tier's uploader (None: no remote tier), which knows the
        steps committed there. A rank with no record in the directory recovers nothing (nothing tells
        its saves from steps copied in)."""
        self._storage = storage
        last = last_recorded_step(self._acct.sink.path, self._rank)
        earlier = {s for s in resumed if last is not None and s <= last}  # recorded, perhaps with their upload failed
        failed = failed_uploads(self._acct.sink.path, self._rank, earlier) if earlier else {}
        with self._lock:
            self._recovering = {s for s in resumed if last is not None and s > last}
            self._upload_failed.update({s: (r, tries) for s, (r, tries) in failed.items()})
            early, self._early = self._early, {}
            for step in sorted(early):
                self._resumed_ended(early[step])
        if last is None:
            return
        remote_steps = None if remote is None else remote.remote_steps()
        local_steps = set(catalog.list_steps(storage).committed)
        for step in sorted(local_steps | (remote_steps or set())):  # a step local retention removed since: from the remote tier
            if step <= last or step in resumed:
                continue
            if remote_steps is None:
                self._recovered(step, ok=True, tier="local")
            elif step not in local_steps:
                assert remote is not None
                self._recovered(step, ok=True, tier="local+remote", where=remote.remote)
            elif step in remote_steps or step < max(remote_steps, default=-1):  # uploaded (and since pruned there)
                self._recovered(step, ok=True, tier="local+remote")
            else:
                self._recovered(step, ok=False, tier="local", error="CheckpointUploadError: not on the remote tier (its "
                                "process stopped before uploading it, and this job does not resume that upload)")

    def _recovered(self, step: int, *, ok: bool, tier: str, error: str | None = None, upload: UploadJob | None = None,
                   where: Storage | None = None) -> SaveStats | None:
        stats = recovered_stats(where or self._storage, step, rank=self._rank, world_size=self._world_size, ok=ok, tier=tier,
                                error=error, upload=upload)
        if stats is not None:
            self._acct.sink.emit(stats.as_dict(), now=True)
            log.info("checkpointing: step %d was committed by a process that stopped before recording it: recorded now "
                     "(recovered, from its manifest)", step)
        return stats

    def _replace(self, job: SaveJob, old: SaveStats, new: SaveStats) -> None:
        """A save's record gained its step fields (SaveAccounting)."""
        with self._lock:
            if job.outcome.retried is not None:  # its upload, tried again, succeeded meanwhile (_save_uploaded)
                old, new = job.outcome.stats or old, dataclasses.replace(new, **job.outcome.retried)
            self._swap(old, new)
            if job.outcome.stats is old:
                job.outcome.stats = new

    def _swap(self, old: SaveStats, new: SaveStats) -> None:
        """(Under the lock.) `new` in place of `old` in all()."""
        for i in range(len(self._stats) - 1, -1, -1):
            if self._stats[i] is old:
                self._stats[i] = new
                return


def _tried(upload: UploadJob, tries: int) -> dict[str, Any]:
    """The fields a later try of a failed upload (the `tries`-th of the save's) changes in its save's record."""
    ok = upload.error is None
    return dict(upload_fields(upload), upload_tries=tries, ok=ok, tier="local+remote" if ok else "local",
                error=None if ok else f"{type(upload.error).__name__}: {upload.error}")


def upload_fields(upload: UploadJob) -> dict[str, Any]:
    """The SaveStats fields an upload gives its save's record."""
    rate = upload.bytes_uploaded / upload.transfer_s if upload.transfer_s > 0 else 0.0
    return dict(upload_s=upload.upload_s, bytes_uploaded=upload.bytes_uploaded, upload_bytes_per_s=rate,
                bytes_upload_reused=upload.bytes_present, upload_tries=upload.tries)


def stats_of(job: SaveJob, upload: UploadJob | None, *, staging_bytes: int, rank: int, world_size: int) -> SaveStats:
    """The SaveStats of a finished save and, with a remote tier, its upload."""
    inputs, staging, outcome = job.inputs, job.staging, job.outcome
    committed = outcome.error is None
    attempted = outcome.written  # the write's result (also when the commit then failed)
    written = attempted if committed else None
    ok = committed and (upload is None or upload.error is None)
    error = outcome.error if outcome.error is not None else None if upload is None else upload.error
    end = outcome.t_committed if committed else time.perf_counter()
    t_written = written.t_written if written is not None else 0.0
    write_s = max(0.0, t_written - staging.t_staged) if committed else 0.0
    remote = upload_fields(upload) if upload is not None else {}
    bytes_written = written.bytes_written if written is not None else 0
    return SaveStats(
        step=inputs.step, ok=ok, error=None if error is None else f"{type(error).__name__}: {error}",
        wait_prev_s=inputs.wait_prev_s, stall_s=staging.stall_s, guard_wait_s=staging.guard_wait_s,
        snapshot_s=max(0.0, staging.t_staged - inputs.t_call - inputs.wait_prev_s) if staging.t_staged else 0.0,
        write_s=write_s, commit_s=max(0.0, outcome.t_committed - t_written) if committed else 0.0,
        total_s=end - inputs.t_call - inputs.wait_prev_s,
        bytes_total=inputs.flat.nbytes, bytes_written=bytes_written,
        bytes_reused=written.bytes_reused if written is not None else 0,
        chunks_total=attempted.chunks_total if attempted is not None else 0,
        chunks_reused=written.chunks_reused if written is not None else 0,
        bytes_unwritten=written.bytes_unwritten if written is not None else 0,
        bytes_reverified=outcome.reverified.bytes, chunks_reverified=outcome.reverified.chunks,
        chunks_damaged=outcome.reverified.damaged,
        bytes_deferred=sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in inputs.flat.leaves if leaf.deferred),
        write_bytes_per_s=bytes_written / write_s if committed and write_s > 0 else 0.0,
        yielded_s=outcome.yielded_s if committed else None,
        staging_bytes=staging_bytes, time=inputs.wall_time, rank=rank, world_size=world_size,
        tier="local+remote" if ok and upload is not None else "local", committed=committed, **remote,
    )


def recovered_stats(storage: Storage | None, step: int, *, rank: int, world_size: int, ok: bool, tier: str,
                    error: str | None = None, upload: UploadJob | None = None) -> SaveStats | None:
    """What the manifest of committed `step` tells of `rank`'s save of it (SaveStats.recovered); None
    when it cannot be read or another number of ranks saved it."""
    if storage is None:
        return None
    try:
        manifest, _ = catalog.committed_manifest(storage, step)
        when = storage.mtime(naming.commit_name(step))
    except (CheckpointError, OSError):
        return None
    if manifest.world_size != world_size:
        return None
    own = naming.step_dir(step) + "/"
    mine = {f.path: f for f in manifest.files if f.rank == rank}
    refs = [c for t in manifest.tensors for sh in t.shards for chunks in (sh.chunks, *sh.replicas) for c in chunks if c.file in mine]
    reused = [c for c in refs if not c.file.startswith(own)]
    remote = upload_fields(upload) if upload is not None else {}
    return SaveStats(
        step=step, ok=ok, error=error,
        wait_prev_s=None, stall_s=None, guard_wait_s=None, snapshot_s=None, write_s=None, commit_s=None,  # type: ignore[arg-type]
        total_s=None, bytes_total=sum(c.length for c in refs), bytes_reused=sum(c.length for c in reused),  # type: ignore[arg-type]
        bytes_written=sum(f.nbytes for p, f in mine.items() if p.startswith(own)), write_bytes_per_s=None,  # type: ignore[arg-type]
        staging_bytes=None, tier=tier, time=when, rank=rank, world_size=world_size, chunks_total=len(refs),  # type: ignore[arg-type]
        chunks_reused=len(reused), committed=True, recovered=True, **remote,
    )
