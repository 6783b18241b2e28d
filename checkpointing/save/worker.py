"""What runs on the background threads after save() returns: each save, and what follows each upload (orchestration).

`SaveWorker` is the ckpt-io thread. Per save: write this rank's part (writer.run_save), commit
through the coordinator, remove the pin, local retention (the retired steps' COMMIT markers), then
either hand the step to the uploader (with a remote tier) or record its stats (records.py) (and
with peer copies, hand the step to `after_local`: checkpointing/peer/), which releases the save's
waiters; then the retired steps' files go (mgr.wait() and delete() wait for that), and last a share
of the chunks the step borrows is re-verified (save/scrub.py), while no save waits. `AfterUpload` runs on the
ckpt-upload thread (uploader.py) after each upload: record the stats (metrics.jsonl, log line),
then local retention again (the step may now be pruned locally). `LocalRetention` is keep_local on
this rank's local tier, for both. None of them ever raises: errors are kept on the jobs and raised
at the next save()/wait(). Once a save is staged, the ckpt-io thread (and the write-behind one)
yield the CPU to the training loop until something waits for the save (save/yielding.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from checkpointing.save.serial import SerialThread
from checkpointing.dist.types import Coordinator
from checkpointing.errors import CheckpointError
from checkpointing.format import naming
from checkpointing.format.gcpause import gc_paused
from checkpointing.format.manifest import ChunkRef, CommittedStep
from checkpointing.plan import scrub
from checkpointing.plan.retention import RetentionPolicy
from checkpointing.plan.reuse import ReuseBase, base_after_restore, base_after_save
from checkpointing.save.job import SaveJob, UploadJob
from checkpointing.save.records import SaveRecords
from checkpointing.save.scrub import Reverifier
from checkpointing.save.staging import StagingPool
from checkpointing.save.pending_uploads import PendingUploads
from checkpointing.save.uploader import Uploader
from checkpointing.save.writer import run_save
from checkpointing.save.yielding import CpuYield
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog, collect, pins

log = logging.getLogger("checkpointing")

LEADER_WAIT_S = 5.0  # the most a non-leader's wait() waits for its tier's leader to retire steps (LocalRetention.settle)


class LocalRetention:
    """keep_local (a retention policy, plan/retention.py) on this rank's local tier, applied by its
    leader only (`enabled`): never the newest committed step, a step whose upload is not finished
    (`pending`), nor the save in flight (`in_flight`). Runs on the ckpt-io thread after a commit and
    on the ckpt-upload thread after an upload, one at a time."""

    def __init__(self, storage: LocalStorage, keep: RetentionPolicy | None, *, enabled: bool, in_flight: Callable[[], set[int]],
                 pending: PendingUploads | None, held: Callable[[], set[int]] | None = None, spares: int = 1) -> None:
        self._storage, self._keep, self._enabled = storage, keep, enabled
        self._spares = spares  # retired pack files kept for the next saves to write over: one per rank writing here
        self._kept_spares = False
        self._in_flight, self._pending, self._held = in_flight, pending, held  # held: steps being copied to peers
        self._lock = threading.Lock()
        self._collected = threading.Event()  # clear from a retirement until its files are removed
        self._collected.set()

    def after_commit(self, newest: int) -> None:
        """`newest` was just committed here: retire the steps keep_local does not keep (their COMMIT
        markers go, so no listing sees them); `collect()` removes their files after the save's
        waiters are released (unlinking a large file takes a good part of a second on some disks)."""
        if self._enabled:
            self._apply(newest, files=False)

    def collect(self) -> None:
        """Remove the files of the steps after_commit retired."""
        if self._collected.is_set():
            return
        try:
            with self._lock:
                collect.collect_retired(self._storage, in_flight=self._in_flight(), spare=self._keep_spare)
        except Exception as exc:  # retried after the next commit; never stop the thread
            log.warning("checkpointing: removing retired steps' files failed: %s", exc)
        finally:
            self._collected.set()

    def _keep_spare(self, path: str) -> bool:
        kept = self._spares > 0 and self._storage.keep_spare(path, self._spares)
        self._kept_spares |= kept
        return kept

    def drop_spares(self) -> None:
        """No more saves from this manager: the spare pack files it kept go (the tier holds only
        checkpoints again). One that saved nothing leaves alone what another process keeps there."""
        if not self._kept_spares:
            return
        with self._lock:
            for name in self._storage.list(naming.SPARES_DIR):
                if naming.is_spare(name):
                    self._storage.delete(f"{naming.SPARES_DIR}/{name}")
            self._storage.remove_dir(naming.SPARES_DIR)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the files of every retired step are removed (mgr.wait(), delete()); False on timeout.
        A rank that shares its tier with a leader waits (a bounded while) until the leader retired what
        keep_local does not keep, so that its steps() then lists what the leader's does."""
        if not self._enabled and self._keep is not None:
            self._await_leader(LEADER_WAIT_S if timeout is None else min(timeout, LEADER_WAIT_S))
        return self._collected.wait(timeout)

    def _await_leader(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                committed = catalog.list_steps(self._storage).committed
                if not committed or not collect.to_retire(self._storage, self._keep, protect={committed[-1]} | self._protected()):
                    return
            except (OSError, CheckpointError):
                return  # a listing race with the leader's deletes: steps() will say what is there
            if time.monotonic() >= deadline:
                return  # the leader protects something this rank does not know of (a copy to a peer): its listing goes on
            time.sleep(0.02)

    def after_upload(self) -> None:
        """An upload finished: its step may go now (if keep_local does not keep it)."""
        if self._enabled:
            newest = catalog.list_steps(self._storage).committed
            if newest:
                self._apply(newest[-1])

    def _protected(self) -> set[int]:
        """Steps retention leaves alone besides the newest: uploads not finished, copies to peers, saves in flight."""
        pending = self._pending.steps() if self._pending is not None else set()
        return pending | (self._held() if self._held is not None else set()) | self._in_flight()

    def _apply(self, newest: int, *, files: bool = True) -> None:
        protect = {newest} | self._protected()
        try:
            with self._lock:
                if files:
                    collect.apply_retention(self._storage, self._keep, protect=protect, in_flight=self._in_flight())
                elif collect.retire_by_policy(self._storage, self._keep, protect=protect):
                    self._collected.clear()
        except Exception as exc:  # retention is retried after the next commit; never stop the thread
            log.warning("checkpointing: retention after step %d failed: %s", newest, exc)


class AfterUpload:
    """The uploader's `on_finish`: the save's record (or a resumed upload's log line), then keep_local."""

    def __init__(self, records: SaveRecords, retention: LocalRetention) -> None:
        self._records, self._retention = records, retention

    def __call__(self, upload: UploadJob) -> None:
        self._records.upload_finished(upload)
        self._retention.after_upload()


class SaveWorker:
    """The ckpt-io thread: runs the saves submitted to it, one at a time, in order.

    `base` is the newest committed save's chunks for the next incremental save to take from: the
    worker sets it after each commit (before the save's `done`), save() takes it for its job
    (`take_base`), restore() replaces it (`use_restored`), delete() drops it (`forget`); those only
    while no save runs.
    Chunks that re-verification found damaged are dropped from a save's base when it starts (on
    this thread, so that one found after save() took the base still counts).
    """

    def __init__(self, storage: LocalStorage, pool: StagingPool, coord: Coordinator, *,
                 write_block: int, incremental: bool, records: SaveRecords, retention: LocalRetention,
                 uploader: Uploader | None, reverify_every: int | None = scrub.DEFAULT_EVERY,
                 reverify_bytes_per_s: float = scrub.DEFAULT_BYTES_PER_S,
                 after_local: Callable[[int, int, CommittedStep | None], None] | None = None,
                 yield_s: float | None = None) -> None:
        self._storage, self._pool, self._coord = storage, pool, coord
        self._cpu = CpuYield(yield_s)  # background_yield_s: this thread and the write-behind ones (save/yielding.py)
        self._after_local = after_local  # (seq, step, what was committed, or None): peer copies (checkpointing/peer/)
        self._write_block, self._incremental = write_block, incremental
        self._records, self._retention, self._uploader = records, retention, uploader
        self._base: ReuseBase | None = None
        self._waited = threading.Event()  # save() waits for this thread to finish what it does after earlier saves
        self._thread: SerialThread[SaveJob] = SerialThread("ckpt-io", self._run, cpu=self._cpu, lazy=True)
        self._scrub = Reverifier(storage, every=reverify_every if incremental else None, bytes_per_s=reverify_bytes_per_s,
                                 busy=lambda: self._thread.pending() or self._waited.is_set())

    def finish_previous(self) -> bool:
        """Before a save is issued: let the thread finish what it still does after earlier saves'
        `done` (retention, re-verification, which then reads only the chunks due now, at full
        speed), at normal priority; whether there was any. The new save would wait for it anyway,
        queued behind it: this way the wait is the previous save's (`wait_prev_s`), not the new
        one's stall."""
        if not self._thread.busy():
            return False
        self._waited.set()
        self._cpu.hurry()
        self._scrub.interrupt()
        try:
            self._thread.wait_idle()
        finally:
            self._waited.clear()
        return True

    def submit(self, job: SaveJob) -> None:
        job.outcome.hurry = self._cpu.hurry
        self._cpu.hurry()  # the copy at normal priority (the guard waits for it), and what the thread still does for the previous save before it
        self._thread.put(job)
        self._scrub.interrupt()  # a paced re-verification stops waiting: this save goes first

    def take_base(self) -> ReuseBase | None:
        """The base for the save being issued; none for the next one until this one commits."""
        base, self._base = self._base, None
        return base

    def drop_base(self) -> None:
        """The next save has no base (restore() is about to overwrite the state, and may fail)."""
        self._base = None

    def forget(self, step: int) -> None:
        """delete() removed `step`: it is no base for the next save (which then writes every chunk).
        A base of another step stays: the files it borrows from are kept while it is committed."""
        if self._base is not None and self._base.step == step:
            self._base = None

    def use_restored(self, step: int, *, clean: bool = True) -> None:
        """restore() read `step`: the next save's base is that step on this rank's local tier; none when
        that tier cannot serve it (not committed there, its manifest damaged) or when the restore found
        damage there (`clean` False: it read some chunks from the remote tier instead), so the next
        save writes everything. The save checks that the step is still committed and its files
        still there before it takes any chunk from them."""
        if not clean:
            log.warning("checkpointing: step %d was damaged on %s: the next save writes every chunk anew", step, self._storage.root)
            self._base = None
            return
        try:
            manifest, digest = catalog.committed_manifest(self._storage, step)
        except (CheckpointError, OSError) as exc:
            log.debug("checkpointing: step %d cannot be the next save's base: %s", step, exc)
            self._base = None
            return
        self._base = base_after_restore(manifest, digest, self._coord.rank, self._coord.tiers[self._coord.rank])

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until local retention removed the files of the steps it retired; False on timeout."""
        self._cpu.hurry()
        return self._retention.settle(timeout)

    def close(self) -> None:
        """Stop the thread once the saves submitted so far have run; the spare pack files go."""
        self._cpu.hurry()
        self._thread.close()
        self._cpu.close()
        try:
            self._retention.drop_spares()
        except OSError as exc:  # only space is at stake: `checkpointing gc` removes them too
            log.warning("checkpointing: could not remove the spare pack files in %s: %s", self._storage.root, exc)

    def _run(self, job: SaveJob) -> None:
        """Write this rank's part, commit through the coordinator, retain, record. Never raises.

        With the cyclic collector paused (format/gcpause.py): a save makes thousands of objects that
        live until it ends (chunk records, digests, the report, the manifest). A collection while
        they live, one of this thread's or one the training thread's allocations set off, moves them
        to older generations, where they die and pile up until a full collection walks the whole
        heap, holding the GIL for 0.2 s in a process with a 0.7 GB transformer (every ~60 saves,
        measured: docs/benchmarks.md). Paused, they die young by reference counting; cyclic garbage
        the training loop makes meanwhile is collected once the save is done."""
        with gc_paused():
            self._save(job)

    def _save(self, job: SaveJob) -> None:
        outcome = job.outcome
        if outcome.error is None:  # not a save that failed inside save(): it is recorded
            outcome.reverified = self._scrub.take_counts()
        self._cpu.committed()  # not this save's: the time low after the previous one
        self._cpu.waited = lambda: outcome.waited  # lowered only while nothing waits for this save
        base = self._scrub.screen(job.inputs.base)
        if base is not job.inputs.base:
            job.inputs = dataclasses.replace(job.inputs, base=base)
        try:
            self._write_and_commit(job)
        except BaseException as exc:  # reported at the next save()/wait()
            if not outcome.error_reported:
                outcome.error = exc
            elif exc is not outcome.error:
                log.error("checkpointing: rank %d, step %d: %s", self._coord.rank, job.step, exc)
        pins.remove_pin(self._storage, outcome.pin)  # committed (the manifest protects its files now) or failed
        if outcome.error is not None:
            pins.remove_failed_step_dir(self._storage, job.step)
        job.staging.release()
        if outcome.error is None:
            self._retention.after_commit(job.step)
        if self._after_local is not None:
            self._after_local(job.seq, job.step, outcome.committed if outcome.error is None else None)
        self._hand_on(job)
        self._retention.collect()  # the waiters are released: now the retired steps' files
        if outcome.error is None and outcome.written is not None:
            try:
                self._scrub.after_commit(job.step, _borrowed(outcome.written.refs, naming.pack_name(job.step, self._coord.rank, job.token)))
            except Exception as exc:  # noqa: BLE001 - never stop the thread; the next round tries again
                log.warning("checkpointing: re-verification after step %d failed: %s", job.step, exc)

    def _write_and_commit(self, job: SaveJob) -> None:
        coord = self._coord
        try:
            if job.outcome.error is not None:
                raise job.outcome.error  # it failed inside save(): the other ranks must hear of it
            part, written = run_save(job, self._pool, self._storage, write_block=self._write_block, rank=coord.rank, exchange=coord,
                                     cpu=self._cpu)
            job.outcome.written = written
        except BaseException as exc:
            job.staging.release()
            coord.fail(job.inputs.ref, exc)  # with several ranks: waits for rank 0's verdict, which names every failing rank
            raise
        try:
            committed = coord.commit(job.inputs.ref, part)
        except BaseException:
            if catalog.committed_digest(self._storage, job.step) is None:  # e.g. a COMMIT linked, then an error: keep its data
                self._storage.delete(part.file)  # nothing will ever reference this pack
            raise
        job.outcome.committed = committed
        job.outcome.t_committed = time.perf_counter()
        low = self._cpu.committed()
        job.outcome.yielded_s = low if self._cpu.enabled else None
        plan = job.inputs.plan
        if self._incremental and written.refs and not plan.ring:
            self._base = base_after_save(plan, self._pool.allocations, committed, written.digests, written.refs, written.keys)

    def _hand_on(self, job: SaveJob) -> None:
        """Committed: to the uploader (which records it once uploaded), or recorded now; then `done`."""
        outcome, upload = job.outcome, job.upload
        if outcome.error_reported:  # failed inside save(): raised there, nothing to record
            outcome.done.set()
        elif upload is not None and outcome.error is None:
            upload.committed, upload.t_local = outcome.committed, outcome.t_committed
            assert self._uploader is not None
            try:
                self._uploader.submit(upload)  # records the stats once the step is on the remote tier
            except Exception as exc:  # noqa: BLE001 - a bug of ours: the upload fails, its waiters never hang
                upload.error = exc
                try:
                    self._uploader.on_finish(upload)
                finally:
                    upload.done.set()
            outcome.done.set()  # the next save may start: the upload reads the local files, not the staging pool
        else:
            try:
                self._records.record(job)
            finally:
                outcome.done.set()
        if upload is not None and not upload.done.is_set() and outcome.error is not None:
            upload.done.set()  # nothing to upload: the save failed (its error is the save's)


def _borrowed(refs: list[ChunkRef | None], pack: str) -> list[ChunkRef]:
    """The chunks a save took from earlier files (not from its own pack)."""
    return [r for r in refs if r is not None and r.file != pack]
