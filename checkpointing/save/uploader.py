"""The remote tier: upload each committed step in the background and commit it there (orchestration).

Thread: one `ckpt-upload` thread per manager (only with remote=...). The save thread hands it a step
once the step is committed on the local tier; uploads then run one step at a time, in commit order
(the same order on every rank, so each upload has the same number `seq` everywhere). Per step:

1. Upload this rank's data: the first `primary_bytes` of each pack file the manifest says this rank
   wrote (`FileEntry.rank`; an upload resumed at start-up: the files plan/resume.py gives this rank). Every primary copy lies in that prefix, so a tensor several ranks hold
   goes up once in total; replicas kept for other local tiers stay local. Files go up from the
   local copy (os.pread of part-sized ranges): the staging pool is free for the next save already.
   A resumed upload skips objects that are already on the remote tier with their exact size
   (objects appear whole: a multipart upload is invisible until completed).
2. Commit (dist/remote_commit.py): rank 0 writes the manifest, then COMMIT with a conditional create.
3. Tidy: rank 0 applies keep_remote (a retention policy) on the remote tier (tier/collect.apply_retention); then the
   uploader's `on_finish` (save/worker.AfterUpload) records the save and applies keep_local (steps
   still waiting for their upload, `PendingUploads`, are never deleted locally).

Priority: with `cpu` (background_yield_s, save/yielding.py) an upload runs at SCHED_IDLE while nothing
waits for it: the ckpt-upload thread, the transfer pool's threads and the remote tier's own event
loop thread (the manager opens it with own_loop: storage/ioloop.py), which together do the
upload's CPU work (about 3 CPU-s per GB: docs/benchmarks.md). Each upload lowers them as it starts
(with a fresh deadline of background_yield_s); anything that waits for an upload (wait(), a save()
waiting for the upload before last, a handle's wait(), delete(), close()) raises them again.

Failures: a permanent error (or transient ones past the retry budget) fails this step's upload
only: it is raised as CheckpointUploadError at the next save()/wait(), the local step stays
committed, and later steps upload normally. Nothing of a failed upload is ever visible as a step
on the remote tier: without COMMIT it is an incomplete step (removed by retention or `gc`).
The next save() submits failed uploads again before its own step, in step order. With one process:
those still committed locally, tried at most RETRIES times, that keep_remote would keep beside the
newer steps, and only once the remote tier answers again (the newest upload succeeded): during an
outage each save pays its own upload's retry budget, not every failed upload's. With several ranks
(which must submit the same uploads in the same order, as each has its number `seq`) by what every
rank knows alike: rank 0's verdict failed it, delete() (a collective call) did not remove the step,
it was tried at most RETRIES times since it first failed, and it is numbered two or more before the
upload being queued (the verdict of the one just before may reach the ranks at different moments:
it is tried a save later). Each rank's report names its step, and rank 0 fails an upload whose
reports name different steps rather than commit it (dist/remote_commit.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from checkpointing.save import metrics_copy
from checkpointing.save.pending_uploads import PendingUploads
from checkpointing.save.serial import SerialThread
from checkpointing.save.yielding import CpuYield
from checkpointing.tier import catalog
from checkpointing.tier import collect, pins
from checkpointing.format import naming
from checkpointing.dist.types import Coordinator, TierCommitter
from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.format.manifest import CommittedStep
from checkpointing.plan.resume import ResumeOffer, resume_plan
from checkpointing.plan.retention import RetentionPolicy, StepInfo
from checkpointing.save.job import UploadJob
from checkpointing.storage import FsspecStorage, LocalStorage

log = logging.getLogger("checkpointing")

RETRIES = 3  # the times a failed upload is tried again


class Uploader:
    """The upload thread and its queue; `on_finish(job)` runs on that thread after each job (once
    it has left `pending`)."""

    def __init__(
        self,
        local: LocalStorage,
        remote: FsspecStorage,
        committer: TierCommitter,
        *,
        rank: int,
        keep_remote: RetentionPolicy | None,
        on_finish: Callable[[UploadJob], None],
        pending: PendingUploads,
        cpu: CpuYield | None = None,
        world_size: int = 1,
    ) -> None:
        self.local, self.remote, self.committer = local, remote, committer
        self._cpu = cpu if cpu is not None and cpu.enabled else None
        if self._cpu is not None:
            remote.on_io_thread(self._cpu.enter)  # the loop's thread, and the pools' threads as they start
        self.rank, self.keep_remote, self.on_finish = rank, keep_remote, on_finish
        self.pending = pending
        self._world_size = world_size
        self._lock = threading.Lock()
        self._seq = 0
        self._remote_steps: set[int] = set()  # committed on the remote tier, as far as this rank knows (under _lock)
        self._base: tuple[int, str, frozenset[str]] | None = None  # newest step committed there: (step, manifest sha256, its files)
        self._closing = False  # close() waits for what is queued: nothing is lowered from then on
        self._uploaded = False  # an upload of this process succeeded: the remote tier is worth a metrics copy at close
        self._answering = True  # the newest finished upload succeeded: failed ones are worth trying again (one process)
        self._litter = True  # the remote tier may hold a failed upload's files (at start: an earlier process's): sweep it
        self._thread: SerialThread[UploadJob] = SerialThread("ckpt-upload", self._run, cpu=self._cpu)

    def submit(self, job: UploadJob) -> None:
        """Queue `job`, after the failed uploads tried again (see the module docstring)."""
        for failed in self._due_retries(job.step):
            if self._world_size > 1 and failed.tries > RETRIES:
                if self.rank == 0:
                    log.error("checkpointing: the upload of step %d to %s failed %d times: not tried again while this job runs "
                              "(local retention may remove the step now; a manager started on this directory resumes the upload "
                              "if it is newer than the newest remote step)", failed.step, self.remote.url, failed.tries)
                continue
            log.warning("checkpointing: trying the failed upload of step %d to %s again", failed.step, self.remote.url)
            self._submit(UploadJob(failed.step, save=failed.save, committed=failed.committed, t_local=failed.t_local, sends=failed.sends,
                                   tries=failed.tries + 1))
        self._submit(job)

    def _due_retries(self, new_step: int) -> list[UploadJob]:
        """The failed uploads to try again now. With several ranks only those numbered two or more before the one
        about to be queued: every rank knows their verdicts (this waits for them; save() has mostly waited already,
        for the upload before last), whereas a later one's may reach the ranks at different moments."""
        if self._world_size == 1:
            return self._due_alone(new_step)
        with self._lock:
            settled = self._seq - 2
        for earlier in self.pending.through(settled):
            earlier.done.wait()
        return self.pending.take_failed(through_seq=settled)

    def _due_alone(self, new_step: int) -> list[UploadJob]:
        """One process: the failed uploads still committed locally, tried at most RETRIES times, that keep_remote keeps
        beside the newer steps; tried again only once the remote tier answered since (the newest upload succeeded), so
        that an outage costs each save its own upload's retry budget, not every failed one's. The rest wait."""
        failed = self.pending.take_failed()
        if not failed:
            return []
        local = set(catalog.list_steps(self.local).committed)
        worth = [j for j in failed if j.step in local and j.tries <= RETRIES]
        for j in failed:
            if j.step in local and j not in worth:
                log.error("checkpointing: the upload of step %d to %s failed %d times: not tried again while this job runs",
                          j.step, self.remote.url, j.tries)
        if self.keep_remote is not None and worth:
            kept = self._kept_remotely({j.step for j in worth} | {new_step} | self.remote_steps(), local)
            for j in [j for j in worth if j.step not in kept]:
                log.warning("checkpointing: the failed upload of step %d to %s is not tried again: keep_remote would not keep "
                            "it beside the newer steps", j.step, self.remote.url)
            worth = [j for j in worth if j.step in kept]
        if not self._answering:
            for j in worth:
                self.pending.fail(j)
            return []
        return worth

    def _kept_remotely(self, steps: set[int], local: set[int]) -> set[int]:
        """What keep_remote keeps of `steps` (metrics from the COMMITs of those committed `local`ly); all of them when
        they cannot be read."""
        assert self.keep_remote is not None
        try:
            infos = catalog.step_infos(self.local, sorted(steps & local), metrics=bool(self.keep_remote.metric_names))
            return set(self.keep_remote.kept(infos + [StepInfo(s) for s in sorted(steps - local)]))
        except (OSError, CheckpointError):
            return steps

    def forget(self, step: int) -> None:
        """delete() removed `step`: its failed upload is not tried again (every rank forgets it alike)."""
        self.pending.forget(step)

    def _submit(self, job: UploadJob) -> None:
        with self._lock:
            job.seq = self._seq
            self._seq += 1
            job.hurry = self._cpu.hurry if self._cpu is not None else None
            self.pending.add(job)
        self._thread.put(job)

    def remote_steps(self) -> set[int]:
        """Steps committed on the remote tier as this rank last saw them (no request: for save()'s checks)."""
        with self._lock:
            return set(self._remote_steps)

    def saw_remote(self, *, added: Iterable[int] = (), removed: Iterable[int] = ()) -> None:
        """Record steps this rank committed on (or removed from) the remote tier."""
        with self._lock:
            self._remote_steps |= set(added)
            self._remote_steps -= set(removed)

    def close(self, records: Callable[[], None] = lambda: None) -> None:
        """Stop the thread once its queue is empty; then `records` (the final metrics written) and, after an
        upload of this process, their copy on the remote tier."""
        self._closing = True
        if self._cpu is not None:
            self._cpu.close()  # what is still queued runs at normal priority: close() waits for it
        self._thread.close()
        records()
        if self._uploaded:
            self._mirror_metrics()
        self.committer.close()

    def _run(self, job: UploadJob) -> None:
        """Upload, commit, tidy; never raises (the error is kept on the job)."""
        assert job.committed is not None
        if self._cpu is not None:
            self._cpu.waited = lambda: job.waited or self._closing  # lowered only while nothing waits for this upload
            self._cpu.hurry()  # at normal priority first, so that lower() starts its deadline timer from a normal thread
            self._cpu.lower()
        try:
            error: BaseException | None = None
            try:
                self._upload_own(job)
            except BaseException as exc:  # noqa: BLE001 - reported through the committer, then kept
                error = exc
            self.committer.commit(job.seq, job.committed, error, job.transfer_s)
            self.saw_remote(added={job.step})
            self._base = (job.step, job.committed.digest, frozenset(f.path for f in job.committed.files))
        except BaseException as exc:  # noqa: BLE001 - raised at the next save()/wait()
            job.error = exc
        self._answering = job.error is None
        if job.error is not None:
            self._litter = True
            self.pending.fail(job)
        elif job.save is not None and job.save.upload is not None and job.save.upload is not job:
            job.save.upload.error = None  # a later try made the step durable: the save's handle no longer raises  # its only copy stays (local retention) until it is tried again
        pins.remove_pin(self.remote, job.pin)
        job.t_done = time.perf_counter()
        if job.error is None and self.rank == 0:
            self._retain(job.step)
        self.pending.remove(job)
        try:
            self.on_finish(job)
            if job.error is None:
                self._uploaded = True
                self._mirror_metrics()
        finally:
            job.done.set()

    def _mirror_metrics(self) -> None:
        """Rank 0: the local tier's metrics.jsonl to the remote tier, for `checkpointing report URL` (best
        effort: it lags the local file by the records not yet final)."""
        if self.rank == 0:
            metrics_copy.mirror(self.local, self.remote)

    def _upload_own(self, job: UploadJob) -> None:
        """Send this rank's files of the step. Files of earlier steps (an incremental save's) that
        the newest remote step lists are there already: the pin, then the check that the step is
        still committed, keep a concurrent gc from removing them (collect.py)."""
        assert job.committed is not None
        t0 = time.perf_counter()
        try:
            mine = [f for f in job.committed.files if f.primary_bytes > 0 and
                    (f.path in job.sends if job.sends is not None else f.rank == self.rank)]
            own_dir = naming.step_dir(job.step) + "/"
            earlier = [f.path for f in mine if not f.path.startswith(own_dir)]
            job.pin = pins.write_pin(self.remote, job.step, self.rank, naming.new_token(), earlier)
            there = self._protected_files() if earlier else frozenset()
            for f in mine:
                if f.path in there or (job.resumed and self.remote.exists_with_size(f.path, f.primary_bytes)):
                    job.bytes_present += f.primary_bytes
                    continue
                path = Path(self.local.root, f.path)
                try:
                    have = os.stat(path).st_size
                except FileNotFoundError:
                    have = -1
                if have < f.primary_bytes:
                    raise CheckpointError(
                        f"step {job.step}: the local copy {path} is {'missing' if have < 0 else f'{have} bytes'}, "
                        f"{f.primary_bytes} bytes must go to the remote tier"
                    )
                self.remote.upload_file(path, f.path, f.primary_bytes)
                job.bytes_uploaded += f.primary_bytes
        finally:
            job.transfer_s = time.perf_counter() - t0

    def _protected_files(self) -> frozenset[str]:
        """The files of the newest step committed on the remote tier, if it still is (after our pin)."""
        if self._base is None:
            newest = max(self.remote_steps(), default=None)
            if newest is None:
                return frozenset()
            try:
                manifest, digest = catalog.committed_manifest(self.remote, newest)
            except (CheckpointError, OSError):
                return frozenset()
            self._base = (newest, digest, frozenset(f.path for f in manifest.files))
        step, digest, files = self._base
        return files if pins.still_committed(self.remote, step, digest) else frozenset()

    def _retain(self, step: int) -> None:
        """Rank 0 after a remote commit: keep_remote (never `step`, the newest step there, or an upload in
        flight; a KeepBest reads the remote COMMITs' metrics), and what no remote step or upload in flight references:
        swept after a failed upload (and the first time) only, as the sweep lists every step there (a request each)."""
        try:
            retired = collect.apply_retention(self.remote, self.keep_remote, protect=step, in_flight=self.pending.steps(),
                                              sweep=self._litter, where=f"on the remote tier {self.remote.url}")
            self._litter = self.pending.retrying()  # its files are kept while it may be tried again: swept after
            self.saw_remote(removed=retired)
        except Exception as exc:  # noqa: BLE001 - retried after the next upload; never stop the thread
            log.warning("checkpointing: retention on the remote tier after step %d failed: %s", step, exc)


def start_uploader(
    local: LocalStorage, remote: FsspecStorage, coord: Coordinator, *, keep_remote: RetentionPolicy | None,
    on_finish: Callable[[UploadJob], None], pending: PendingUploads, yield_s: float | None = None,
) -> tuple[Uploader, list[UploadJob]]:
    """Start the upload thread, and resume the uploads an earlier process did not finish (a collective call).

    Resumed: the steps committed on every rank's local tier, newer than the newest step on the
    remote tier, whose files the ranks hold between them (plan/resume.py; they agree through the
    store). At another world size than the save's, the ranks holding a file send it.
    """
    try:
        listing = catalog.list_steps(remote)
    except (OSError, CheckpointError) as exc:
        raise CheckpointConfigError(f"cannot use the remote tier {remote.url}: {exc}") from None
    uploader = Uploader(local, remote, coord.remote_committer(local, remote), rank=coord.rank, keep_remote=keep_remote, on_finish=on_finish, pending=pending,
                        cpu=CpuYield(yield_s), world_size=coord.world_size)
    uploader.saw_remote(added=set(listing.committed))
    if coord.rank == 0:  # before the collective call below: no rank of this job has appended a record yet
        metrics_copy.adopt(local, remote)
    mine = resume_offers(local, listing.committed)
    stale = _pins_quietly(remote, mine) if coord.rank == 0 else {}  # before agreeing: no upload of this job has pinned yet
    offers = [{int(s): ResumeOffer.from_json(o) for s, o in got.items()}
              for got in coord.gather("resume", {str(s): o.to_json() for s, (o, _) in mine.items()})]
    plan = resume_plan(offers)
    for step, why in plan.left.items():
        if coord.rank == min(r for r, o in enumerate(offers) if step in o):  # said once
            log.warning("checkpointing: step %d is committed locally but not on %s, and its upload cannot resume: %s "
                        "(local retention may remove it; copy it with `checkpointing import`)", step, remote.url, why)
    agreed = sorted(plan.sends)
    if coord.rank == 0:  # one job per prefix: a pin no upload of ours will remove is a crashed upload's
        try:
            collect.collect(remote, protect=set(agreed), pin_ttl_s=0, scan_committed=False)
            for path in (p for step in agreed for p in stale.get(step, ())):  # the killed uploads' pins of the steps resumed
                remote.delete(path)
        except OSError as exc:
            log.warning("checkpointing: could not tidy the remote tier %s: %s", remote.url, exc)
    resumed = []
    for step in agreed:
        log.info("checkpointing: step %d is committed locally but not on %s: resuming its upload", step, remote.url)
        offer = offers[0][step]  # a rank without the step (a node added since) sends nothing and takes part in its commit
        committed = mine[step][1] if step in mine else CommittedStep(step, offer.digest, offer.world_size, ())
        job = UploadJob(step, committed=committed, t_local=time.perf_counter(), sends=plan.sends[step][coord.rank])
        uploader.submit(job)
        resumed.append(job)
    return uploader, resumed


def _pins_quietly(remote: FsspecStorage, steps: Iterable[int]) -> dict[int, list[str]]:
    try:
        return pins.pins_in(remote, steps)
    except OSError as exc:  # their pins then stay until the steps are retired (tier/collect.py G1)
        log.warning("checkpointing: could not list the pins of the uploads to resume on %s: %s", remote.url, exc)
        return {}


def resume_offers(local: LocalStorage, remote_committed: list[int]) -> dict[int, tuple[ResumeOffer, CommittedStep]]:
    """This rank's offer (plan/resume.py) for each local committed step newer than the newest remote one."""
    newest = max(remote_committed, default=-1)
    out: dict[int, tuple[ResumeOffer, CommittedStep]] = {}
    for step in catalog.list_steps(local).committed:
        if step <= newest:
            continue
        try:
            manifest, digest = catalog.committed_manifest(local, step)
        except CheckpointError as exc:
            log.warning("checkpointing: not uploading step %d: %s", step, exc)
            continue
        need = [f for f in manifest.files if f.primary_bytes]
        have = frozenset(f.path for f in need if _local_size(local, f.path) >= f.primary_bytes)
        out[step] = (ResumeOffer(digest, manifest.world_size, tuple((f.path, f.rank) for f in need), have), CommittedStep.of(manifest, digest))
    return out


def _local_size(local: LocalStorage, path: str) -> int:
    try:
        return local.size(path)
    except FileNotFoundError:
        return -1
