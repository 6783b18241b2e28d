"""CheckpointManager: the public entry point (orchestration only; the work lives in the modules it calls).

Threads: the training thread calls save()/restore()/wait(); one background I/O thread per manager
runs each save (stage -> write -> commit -> retention -> metrics). Saves run one at a time: a save
requested while the previous one still writes waits for it (reported as wait_prev_s), because both
would share the one staging pool. The guard (a global optimizer step pre-hook) blocks the next
optimizer.step() until the snapshot no longer reads live parameters or optimizer state.

Across ranks (a torch.distributed process group of more than one rank), every rank writes its own
shards to its local tier and the coordinator (coordinator.py) commits the step through the store;
construction and restore() are collective calls, save() is not (it never waits on another rank).

The background half (the I/O thread's work per save, and what follows each upload) is in
background.py. With a remote tier (remote=...), a second background thread (tiering.py) uploads
each step once it is committed locally. save() does not wait for that upload, only for the one
before it: at most one step uploads while the next one is written, so a link slower than the
checkpoint interval shows up as wait_prev_s instead of an unbounded backlog of local steps.
handle.wait() and wait() return once a step is durable on every tier.

Observability (loop.py, accounting.py): optimizer.step() or mgr.step() marks steps; each save's
record is completed with what it cost the loop once the steps during its background work have
ended, and written by a "ckpt-metrics" thread that also runs the on_metrics callback. With
handle_preemption() a "ckpt-preempt" watchdog thread ends the process if the grace period runs out.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Literal, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from checkpointing.tier import catalog
from checkpointing.tier import collect
from checkpointing.format import naming
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.plan.assign import UNIQUE, LeafInfo, assign_regions
from checkpointing.state.codecs import Codec
from checkpointing.dist.coordinator import LocalCoordinator, StoreCoordinator, new_namespace
from checkpointing.errors import CheckpointConfigError, CheckpointError, CheckpointSaveError
from checkpointing.save.worker import BackgroundSaves
from checkpointing.observe.metrics import SaveStats
from checkpointing.training.loop import LoopHooks, StepScope  # noqa: F401 - StepScope is what mgr.step() returns
from checkpointing.options import DEFAULT_CHUNK_BYTES, ChangeDetection, ManagerOptions, SnapshotMode
from checkpointing.plan.pack import PackPlan, plan_pack
from checkpointing.training.preemption import Preemption
from checkpointing.restore.step_choice import choose_step
from checkpointing.restore.planner import execute
from checkpointing.plan.schedule import SaveSchedule
from checkpointing.plan.retention import tier_states
from checkpointing.plan.reuse import ReuseBase, base_after_restore
from checkpointing.save.staging import StagingPool
from checkpointing.storage import FsspecStorage, LocalStorage, open_storage
from checkpointing.save.uploader import Uploader, UploadJob, start_uploader
from checkpointing.state.tree import FlatState, flatten_state
from checkpointing.save.writer import SaveJob

log = logging.getLogger("checkpointing")


class SaveHandle:
    """A save in flight. `wait()` returns its SaveStats once committed, or raises its error."""

    def __init__(self, manager: "CheckpointManager", job: SaveJob, upload: UploadJob | None = None) -> None:
        self._manager = manager
        self._job = job
        self._upload = upload
        self.step = job.step

    def done(self) -> bool:
        """Durable on every configured tier (or failed)."""
        return self._job.done.is_set() and (self._upload is None or self._upload.done.is_set())

    def local_done(self) -> bool:
        """Committed on the local tier (or failed); with a remote tier the upload may still run."""
        return self._job.done.is_set()

    def wait_staged(self) -> None:
        """Block until the snapshot no longer reads live tensors (then they may be mutated)."""
        self._manager._guard(self._job)

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the step is durable on every configured tier; return its SaveStats or raise its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._job.done.wait(timeout):
            raise CheckpointError(f"step {self.step} is not durable after {timeout} s; call wait() again or raise the timeout")
        self._manager._raise_job_error(self._job)
        if self._upload is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._upload.done.wait(left):
                raise CheckpointError(f"step {self.step} is committed locally but not yet on the remote tier after {timeout} s; "
                                      "call wait() again or raise the timeout")
            self._manager._raise_upload_error(self._upload)
        return self._job_stats()

    def _job_stats(self) -> SaveStats:
        assert self._job.stats is not None
        return self._job.stats

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


class CheckpointManager(BackgroundSaves, LoopHooks):
    """Asynchronous, verified checkpoints of a training state in `local_dir`.

    One manager per directory and process. See README.md for a training-loop example and
    docs/design.md for the threads and the failure model. Step marks, should_save() and
    handle_preemption() are in loop.py (docs/observability.md).
    """

    def __init__(
        self,
        local_dir: str | os.PathLike,
        *,
        remote: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_local: int | None = 2,
        keep_remote: int | None = None,
        incremental: bool = True,
        change_detection: ChangeDetection = "auto",
        process_group: Any = None,
        snapshot: SnapshotMode = "async",
        staging_budget_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        write_block_bytes: int = 32 << 20,
        direct_io: bool = True,
        fsync: bool = True,
        codecs: tuple[Codec, ...] | list[Codec] = (),
        timeout_s: float = 600.0,
        upload_concurrency: int = 8,
        upload_part_bytes: int = 64 << 20,
        upload_bytes_per_s: float | None = None,
        interval: int | Literal["auto"] | None = None,
        mtbf_s: float | None = None,
        on_metrics: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir):
            raise CheckpointConfigError(f"local_dir={local_dir!r} is invalid: pass a directory path")
        self.options = ManagerOptions(
            keep_local=keep_local, keep_remote=keep_remote, snapshot=snapshot, staging_budget_bytes=staging_budget_bytes,
            chunk_bytes=chunk_bytes, write_block_bytes=write_block_bytes, direct_io=direct_io, fsync=fsync,
            incremental=incremental, change_detection=change_detection, remote=remote, storage_options=storage_options, codecs=tuple(codecs),
            timeout_s=timeout_s, upload_concurrency=upload_concurrency, upload_part_bytes=upload_part_bytes,
            upload_bytes_per_s=upload_bytes_per_s, interval=interval, mtbf_s=mtbf_s, on_metrics=on_metrics,
        )
        group = _resolve_group(process_group)
        self.remote_storage: FsspecStorage | None = None
        if remote is not None:  # credentials stay inside the storage: never in messages, logs or files
            opened = open_storage(remote, storage_options, max_concurrency=upload_concurrency, part_bytes=upload_part_bytes,
                                  max_bytes_per_s=upload_bytes_per_s)
            assert isinstance(opened, FsspecStorage)
            self.remote_storage = opened
        try:
            self.storage = LocalStorage(local_dir, direct=direct_io, fsync=fsync)
        except OSError as exc:
            raise CheckpointConfigError(f"cannot use {local_dir!s} as the checkpoint directory: {exc}") from exc
        self.directory = self.storage.root
        self._group = group
        if group is None:
            self._coord: LocalCoordinator | StoreCoordinator = LocalCoordinator(self.storage)
        else:
            self._coord = StoreCoordinator(self.storage, group, timeout_s=self.options.timeout_s, namespace=new_namespace(_group_name(group)))
        self.rank = self._coord.rank
        self.world_size = self._coord.world_size
        self._pool = StagingPool()
        self._plan_cache: tuple[tuple, tuple[PackPlan, list[int]]] | None = None
        self._base: ReuseBase | None = None  # the last committed save's chunks (incremental saves)
        self._current: SaveJob | None = None
        self._seq = 0
        self._stats: list[SaveStats] = []
        self._lock = threading.Lock()
        self._closed = False
        if self._coord.leader:  # one rank per local tier tidies it, before anyone writes there
            self._remove_incomplete()
        self._coord.barrier("started")
        self._retention_lock = threading.Lock()
        self._uploads: list[UploadJob] = []  # not yet waited for and reported, in upload order
        self._upload_of: dict[SaveJob, UploadJob] = {}
        self._uploader: Uploader | None = None
        if self.remote_storage is not None:  # collective: the ranks agree on interrupted uploads to resume
            self._uploader, resumed = start_uploader(self.storage, self.remote_storage, self._coord,
                                                     keep_remote=self.options.keep_remote, on_finish=self._upload_finished)
            self._uploads.extend(resumed)
        schedule = None if interval is None else SaveSchedule(interval, mtbf_s, follow=self.world_size == 1)
        self._acct = SaveAccounting(self.directory / naming.METRICS_NAME, on_metrics=on_metrics, schedule=schedule,
                                    replace=self._replace_stats)
        self._preemption: Preemption | None = None
        self._marks_steps = False  # should_save()/step() are called: safe points for an emergency save
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._io_loop, name="ckpt-io", daemon=True)
        self._thread.start()
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        _LIVE.add(self)

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any], *, eager: bool | None = None) -> SaveHandle:
        """Snapshot `state` as `step`; returns once the training loop may go on.

        With several ranks every rank calls save() with the same step; none waits for the others.
        """
        t0 = time.perf_counter()
        wall = time.time()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= naming.MAX_STEP:
            raise CheckpointConfigError(f"step={step!r} is invalid: pass an int in 0..{naming.MAX_STEP}")
        prev = self._current
        if prev is not None:
            prev.done.wait()
            self._raise_job_error(prev)
        older = self._uploads[:-1]  # every upload but the newest: done on every rank once waited for
        for up in older:
            up.done.wait()
        if older:
            self._uploads = self._uploads[-1:]
            for up in older:
                self._raise_upload_error(up)
        wait_prev_s = time.perf_counter() - t0 if prev is not None or older else 0.0
        seq = self._seq
        self._seq += 1
        try:
            if step in self._committed_fast():
                raise CheckpointError(
                    f"step {step} is already committed in {self.directory}: checkpoints are immutable; "
                    "save under a new step number (or delete that step first)"
                )
            flat = flatten_state(state, codecs=self.options.codecs, eager=eager if eager is not None else self.options.snapshot == "eager")
            plan, regions = self._plan_for(flat)
        except BaseException as exc:
            if self.world_size > 1:  # the other ranks are saving this step: tell them it failed here
                self._fail_without_saving(step, seq, exc, t0, wall, wait_prev_s)
            raise
        start_event = None
        if any(leaf.tensor.is_cuda for leaf in flat.leaves):
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream())
        job = SaveJob(step, flat, plan, regions, t0, wall, wait_prev_s, start_event=start_event, seq=seq, base=self._base,
                       watch_writes=self.options.incremental and self.options.change_detection == "auto")
        self._base = None  # the pool is about to change: only this save's own success sets a new base
        upload = None
        if self._uploader is not None:
            upload = self._upload_of[job] = UploadJob(step, save=job)
            self._uploads.append(upload)
        self._current = job
        self._acct.issued(step, t0)
        self._queue.put(job)
        job.eager_staged.wait()
        if job.eager_event is not None:
            torch.cuda.current_stream().wait_event(job.eager_event)
        t_end = time.perf_counter()
        job.call_s = t_end - t0 - wait_prev_s
        self._acct.returned(step, t_end)
        if self._preemption is not None:
            self._preemption.check(step)
        return SaveHandle(self, job, upload)

    def _fail_without_saving(self, step: int, seq: int, exc: BaseException, t0: float, wall: float, wait_prev_s: float) -> None:
        """Run a save that failed inside save() through the coordinator, so the other ranks hear why."""
        job = SaveJob(step, FlatState({"dict": []}, []), plan_pack([], [], chunk_bytes=4096, budget=None), [], t0, wall, wait_prev_s, seq=seq)
        job.error = exc
        job.error_reported = True  # raised right now, in save()
        job.release_waiters()
        if self._uploader is not None:  # keep the list of uploads the same on every rank
            self._uploads.append(UploadJob(step, save=job))
            self._uploads[-1].done.set()
        self._current = job
        self._queue.put(job)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save is durable on every configured tier; raise the error of a failed one (once)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self._current
        if job is not None:
            if not job.done.wait(timeout):
                raise CheckpointError(f"step {job.step} is not durable after {timeout} s; call wait() again or raise the timeout")
            self._raise_job_error(job)
        uploads = list(self._uploads)
        for up in uploads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not up.done.wait(left):
                raise CheckpointError(f"step {up.step} is not on the remote tier after {timeout} s; call wait() again or raise the timeout")
        self._uploads = [u for u in self._uploads if u not in uploads]
        for up in uploads:
            self._raise_upload_error(up)

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot no longer reads live tensors.

        Call this before mutating saved tensors outside optimizer.step() (which is guarded already).
        """
        if self._current is not None:
            self._guard(self._current)

    def restore(self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Restore `step` (default: the newest committed one every rank can read) into `state` in place.

        Returns the step, or None when there is none. With several ranks this is a collective call:
        the ranks agree on the step first, and each reads only the chunks it needs (resharding
        DTensors when the world size or the sharding changed).
        """
        self._check_open()
        if self._current is not None:
            self._current.done.wait()
        remote = set(self._remote_steps() or ())
        chosen, plans = choose_step(state, step, strict, local=self.storage, remote=self.remote_storage, remote_steps=remote,
                                    coord=self._coord, codecs=self.options.codecs)
        if chosen is None:
            return None
        plan, sources = plans[chosen]
        t0 = time.perf_counter()
        execute(plan, state, sources)
        if self.options.incremental:  # the next save writes only what changed since this step
            self._base = self._base_after_restore(chosen)
        origin = str(self.directory) if sources.local is not None else ""
        if sources.remote_bytes:
            origin += f"{' and ' if origin else ''}{self._remote_url()} ({sources.remote_bytes / 1e6:.1f} MB from the remote tier)"
        log.info("checkpointing: rank %d restored step %d (%.1f MB in the checkpoint) in %.3f s from %s",
                 self.rank, chosen, plan.manifest.nbytes / 1e6, time.perf_counter() - t0, origin or str(self.directory))
        return chosen

    def _base_after_restore(self, step: int) -> ReuseBase | None:
        """The restored step as the next save's base, from this rank's local tier; None when that tier
        cannot serve it (not committed there, its manifest damaged). The save checks that the step is
        still committed and its files still there before it takes any chunk from them."""
        try:
            manifest, digest = catalog.committed_manifest(self.storage, step)
        except (CheckpointError, OSError) as exc:
            log.debug("checkpointing: step %d cannot be the next save's base: %s", step, exc)
            return None
        return base_after_restore(manifest, digest, self.rank, self._coord.tiers[self.rank])

    def steps(self) -> list[int]:
        """Committed steps this rank can see, ascending: on its local tier, or on the remote tier."""
        return sorted(self.tiers())

    def tiers(self) -> dict[int, str]:
        """Each committed step -> where it is durable: 'local', 'local+remote' or 'remote' (ascending).

        Lists the remote tier (one request per step there); if it cannot be reached the answer is
        the local tier plus the steps this manager knows it uploaded, and a warning is logged.
        """
        return tier_states(catalog.list_steps(self.storage).committed, self._remote_steps())

    def _remote_steps(self) -> list[int] | None:
        if self.remote_storage is None or self._uploader is None:
            return None
        try:
            return catalog.list_steps(self.remote_storage).committed
        except (OSError, CheckpointError) as exc:
            log.warning("checkpointing: cannot list the remote tier %s (%s); showing what this process uploaded", self._remote_url(), exc)
            return sorted(self._uploader.remote_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def stats(self) -> list[SaveStats]:
        """Each finished save's SaveStats, oldest first; the step fields (step_stall_s, slowdown_s,
        cost_s, overhead_pct, step_time_s) are filled in once the save's cost is final."""
        with self._lock:
            return list(self._stats)

    @property
    def staging_bytes(self) -> int:
        """Bytes held by the staging pool (allocated once, reused by every save)."""
        return self._pool.capacity

    def close(self) -> None:
        """Wait for in-flight saves, stop the I/O thread, free the staging pool."""
        if self._closed:
            return
        preemption = self._preemption
        try:
            if preemption is not None:
                preemption.at_close(self._acct.last_step)
            self.wait(preemption.remaining() if preemption is not None and preemption.requested else None)
        finally:
            self._closed = True
            if preemption is not None:
                preemption.stop()
            self._hook.remove()
            self._queue.put(None)
            self._thread.join()
            if self._uploader is not None:
                self._uploader.close()  # its queue is empty: wait() waited for every upload (unless it raised)
            if self.remote_storage is not None:
                self.remote_storage.close()
            self._pool.release()
            self._acct.close()
            self._coord.close()  # with several ranks: leave together (rank 0 may host the store)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as err:  # do not hide the exception already propagating
            log.error("checkpointing: %s", err)

    def __repr__(self) -> str:
        remote = f", remote={self._remote_url()!r}, keep_remote={self.options.keep_remote}" if self.remote_storage is not None else ""
        return f"CheckpointManager({str(self.directory)!r}, keep_local={self.options.keep_local}{remote})"

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")

    def _raise_upload_error(self, upload: UploadJob) -> None:
        if upload.error is not None and not upload.error_reported:
            upload.error_reported = True
            raise upload.error

    def _remote_url(self) -> str:
        return self.remote_storage.url if self.remote_storage is not None else ""

    def _committed_fast(self) -> set[int]:
        """Committed steps without asking the remote tier (save() must not wait on the network)."""
        steps = set(catalog.list_steps(self.storage).committed)
        if self._uploader is not None:
            steps |= self._uploader.remote_steps()
        return steps

    def _raise_job_error(self, job: SaveJob) -> None:
        if job.error is not None and not job.error_reported:
            job.error_reported = True
            if isinstance(job.error, CheckpointSaveError):
                raise job.error
            raise CheckpointSaveError(job.step, job.error) from job.error

    def _plan_for(self, flat: FlatState) -> tuple[PackPlan, list[int]]:
        """The pack plan and each leaf's region; cached while the state's shape does not change."""
        sizes = [leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flat.leaves]
        deferred = [leaf.deferred for leaf in flat.leaves]
        holders = [None if leaf.layout is None else self._group_ranks(leaf.layout.replicas) for leaf in flat.leaves]
        keys = [leaf.key for leaf in flat.leaves]
        cache_key = (tuple(sizes), tuple(deferred), tuple(keys), tuple(holders), self._coord.per_rank_keys)
        if self._plan_cache is None or self._plan_cache[0] != cache_key:
            budget = self.options.staging_budget_bytes
            if budget is not None and budget < sum(sizes):
                regions = [UNIQUE] * len(sizes)  # a ring streams the pack in order: each rank writes all it holds
            else:
                infos = [LeafInfo(k, n, h) for k, n, h in zip(keys, sizes, holders)]
                regions = assign_regions(infos, rank=self.rank, tiers=self._coord.tiers, per_rank_keys=self._coord.per_rank_keys)
            plan = plan_pack(sizes, deferred, chunk_bytes=self.options.chunk_bytes, budget=budget, regions=regions)
            self._plan_cache = (cache_key, (plan, regions))
        return self._plan_cache[1]

    def _group_ranks(self, global_ranks: tuple[int, ...]) -> tuple[int, ...]:
        """Ranks of the process group for the global ranks a DTensor mesh names."""
        if self._group is None:
            return (0,) if global_ranks else ()
        import torch.distributed as dist

        return tuple(sorted(dist.get_group_rank(self._group, r) for r in global_ranks))

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        job = self._current
        if job is not None and not job.done.is_set():
            self._guard(job)
        self._acct.optimizer_step(optimizer)
        if self._preemption is not None and not self._marks_steps:
            self._preemption.at_optimizer_step()

    def _guard(self, job: SaveJob) -> None:
        with job.lock:
            if not job.staged.is_set():
                t0 = time.perf_counter()
                job.staged.wait()
                waited = time.perf_counter() - t0
                job.guard_wait_s += waited
                self._acct.stall(job.step, waited)
            if job.staged_event is not None:
                torch.cuda.current_stream().wait_event(job.staged_event)

    def _remove_incomplete(self) -> None:
        """Saves that did not commit (this is the directory's one writer, so every pin is a crashed save's)."""
        result = collect.collect(self.storage, pin_ttl_s=0)
        for step in sorted({naming.parse_step_dir(g.path.split("/")[0]) for g in result.garbage if g.reason.startswith("incomplete")}):
            log.info("checkpointing: removed incomplete step %d (a save that did not commit) from %s", step, self.directory)
        for p in result.problems:
            log.warning("checkpointing: not tidying %s: %s", self.directory, p)


_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _finish_saves_at_exit() -> None:
    """A save issued just before the interpreter exits still becomes durable."""
    for mgr in list(_LIVE):
        try:
            mgr.close()
        except Exception as exc:  # noqa: BLE001 - exiting: report, do not raise
            log.error("checkpointing: at exit: %s", exc)


def _resolve_group(process_group: Any) -> Any:
    """The process group to coordinate over, or None for a single rank."""
    import torch.distributed as dist

    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    try:
        world = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointConfigError(f"process_group={process_group!r} is not usable: {exc}") from exc
    if rank < 0:
        raise CheckpointConfigError("this process is not a member of process_group: create the manager on its ranks only")
    return None if world == 1 else process_group


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name else "world"
