"""The record of each finished save: its SaveStats in `mgr.stats()`, on the job, in the log (orchestration).

Called on the background threads: by the worker (ckpt-io) when a save without a remote tier is
committed or failed, and after each upload (ckpt-upload) once the step is on the remote tier too.
The record goes to metrics.jsonl and on_metrics once its step cost is final (observe/accounting.py),
which may be right away; its step fields then replace it in `stats()` and on the job.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any

from checkpointing.errors import CheckpointUploadError
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.observe.metrics import SaveStats, log_save
from checkpointing.save.job import SaveJob, UploadJob
from checkpointing.save.staging import StagingPool

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
        """After each upload (on the upload thread, before upload.done is set): its save's record,
        or a log line for an upload resumed at start-up."""
        if upload.error is not None:
            upload.error = CheckpointUploadError(upload.step, self._remote, upload.error)
        if upload.save is not None:
            self.record(upload.save, upload)
        elif upload.error is not None:
            upload.error_reported = True  # a resumed upload: no save() of this process waits for it
            log.error("checkpointing: %s", upload.error)
        else:
            log.info("checkpointing: resumed upload of step %d finished (%.1f MB sent, %.1f MB were there already) -> %s",
                     upload.step, upload.bytes_uploaded / 1e6, upload.bytes_present / 1e6, self._remote)

    def _replace(self, job: SaveJob, old: SaveStats, new: SaveStats) -> None:
        """A save's record gained its step fields (SaveAccounting)."""
        with self._lock:
            for i in range(len(self._stats) - 1, -1, -1):
                if self._stats[i] is old:
                    self._stats[i] = new
                    break
            if job.outcome.stats is old:
                job.outcome.stats = new


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
    remote: dict[str, Any] = {}
    if upload is not None:
        rate = upload.bytes_uploaded / upload.transfer_s if upload.transfer_s > 0 else 0.0
        remote = dict(upload_s=upload.upload_s, bytes_uploaded=upload.bytes_uploaded, upload_bytes_per_s=rate,
                      bytes_upload_reused=upload.bytes_present)
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
