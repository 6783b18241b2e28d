"""What runs on a manager's background threads: each save after save() returns (orchestration).

A mixin of CheckpointManager, kept apart so that manager.py reads as the training thread's side.
ckpt-io thread, per save: write this rank's part (writer.run_save), commit through the coordinator,
local retention, then either hand the step to the uploader (with a remote tier) or record its
stats. ckpt-upload thread (tiering.Uploader), after each upload: record the stats (metrics.jsonl,
log line), local retention again (the step may now be pruned locally). Neither thread ever raises:
errors are kept on the jobs and raised at the next save()/wait().
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from checkpointing.tier import catalog
from checkpointing.tier import collect, pins
from checkpointing.dist.coordinator import LocalCoordinator, StoreCoordinator
from checkpointing.errors import CheckpointUploadError
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.observe.metrics import SaveStats, log_save, stats_of
from checkpointing.plan.reuse import ReuseBase, base_after_save
from checkpointing.save.staging import StagingPool
from checkpointing.storage import LocalStorage
from checkpointing.save.uploader import Uploader, UploadJob
from checkpointing.save.writer import SaveJob, run_save

log = logging.getLogger("checkpointing")


class BackgroundSaves:
    """The background half of CheckpointManager; the attributes below are set by its constructor."""

    storage: LocalStorage
    directory: Any
    options: Any
    rank: int
    world_size: int
    _coord: LocalCoordinator | StoreCoordinator
    _pool: StagingPool
    _queue: queue.Queue
    _uploader: Uploader | None
    _upload_of: dict[SaveJob, UploadJob]
    _retention_lock: threading.Lock
    _lock: threading.Lock
    _stats: list[SaveStats]
    _acct: SaveAccounting
    _base: ReuseBase | None
    _current: SaveJob | None

    def _remote_url(self) -> str:
        raise NotImplementedError

    def _io_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: SaveJob) -> None:
        """Write this rank's part, commit through the coordinator, retain, record. Never raises."""
        coord = self._coord
        try:
            try:
                if job.error is not None:
                    raise job.error  # it failed inside save(): the other ranks must hear of it
                part = run_save(job, self._pool, self.storage, write_block=self.options.write_block_bytes, rank=self.rank, exchange=coord)
            except BaseException as exc:
                job.release_waiters()
                coord.fail(job, exc)
                if self.world_size > 1:
                    coord.finish(job)  # rank 0 still coordinates; every rank waits for the verdict
                raise
            try:
                job.manifest = coord.commit(job, part)
            except BaseException:
                if catalog.committed_digest(self.storage, job.step) is None:  # e.g. a COMMIT linked, then an error: keep its data
                    self.storage.delete(part.file)  # nothing will ever reference this pack
                raise
            job.t_committed = time.perf_counter()
            if self.options.incremental and job.refs and not job.plan.ring:
                self._base = base_after_save(job.plan, self._pool.allocations, job.manifest, job.manifest_digest,
                                             job.digests, job.refs, job.keys)
        except BaseException as exc:  # reported at the next save()/wait()
            if not job.error_reported:
                job.error = exc
            elif exc is not job.error:
                log.error("checkpointing: rank %d, step %d: %s", self.rank, job.step, exc)
        pins.remove_pin(self.storage, job.pin)  # committed (the manifest protects its files now) or failed
        job.release_waiters()
        if job.error is None and coord.leader:
            self._retain_local(job.step)
        upload = self._upload_of.pop(job, None)
        if job.error_reported:  # failed inside save(): raised there, nothing to record
            job.done.set()
        elif upload is not None and job.error is None:
            upload.manifest, upload.manifest_digest, upload.t_local = job.manifest, job.manifest_digest, job.t_committed
            assert self._uploader is not None
            self._uploader.submit(upload)  # records the stats once the step is on the remote tier
            job.done.set()  # the next save may start: the upload reads the local files, not the staging pool
        else:
            self._finish(job)
        if upload is not None and not upload.done.is_set() and job.error is not None:
            upload.done.set()  # nothing to upload: the save failed (its error is the save's)

    def _retain_local(self, newest: int) -> None:
        """keep_local on this local tier (its leader only); never a step whose upload is not finished."""
        pending = self._uploader.pending_steps() if self._uploader is not None else set()
        current = self._current
        in_flight = {current.step} if current is not None and not current.done.is_set() else set()
        try:
            with self._retention_lock:
                collect.apply_retention(self.storage, self.options.keep_local, protect={newest} | pending, in_flight=in_flight)
        except Exception as exc:  # retention is retried after the next commit; never stop the thread
            log.warning("checkpointing: retention after step %d failed: %s", newest, exc)

    def _finish(self, job: SaveJob, upload: UploadJob | None = None) -> None:
        try:
            self._record(job, upload)
        finally:
            job.done.set()

    def _upload_finished(self, upload: UploadJob) -> None:
        """On the upload thread, after each upload (before upload.done is set)."""
        if upload.error is not None:
            upload.error = CheckpointUploadError(upload.step, self._remote_url(), upload.error)
        if upload.save is not None:
            self._record(upload.save, upload)
        elif upload.error is not None:
            upload.error_reported = True  # a resumed upload: no save() of this process waits for it
            log.error("checkpointing: %s", upload.error)
        else:
            log.info("checkpointing: resumed upload of step %d finished (%.1f MB sent, %.1f MB were there already) -> %s",
                     upload.step, upload.bytes_uploaded / 1e6, upload.bytes_present / 1e6, self._remote_url())
        if self._coord.leader:
            newest = catalog.list_steps(self.storage).committed
            if newest:
                self._retain_local(newest[-1])

    def _record(self, job: SaveJob, upload: UploadJob | None = None) -> None:
        """The save's SaveStats into stats() and the log; its record goes to metrics.jsonl and
        on_metrics once its step cost is final (accounting.py), which may be right now."""
        with job.lock:  # the guard may still be adding its wait
            stats = stats_of(job, upload, staging_bytes=self._pool.capacity, rank=self.rank, world_size=self.world_size)
        stats = self._acct.durable(job, stats)
        with self._lock:
            self._stats.append(stats)
            job.stats = stats
        log_save(stats, str(self.directory) if upload is None else f"{self.directory} and {self._remote_url()}")
        self._acct.settle(job.step, stats.ok)
