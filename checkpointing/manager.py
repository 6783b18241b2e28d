"""CheckpointManager: the public entry point (orchestration only; the work lives in the modules it calls).

Threads: the training thread calls save()/restore()/wait(); one background I/O thread per manager
runs each save (stage -> write -> commit -> retention -> metrics). Saves run one at a time: a save
requested while the previous one still writes waits for it (reported as wait_prev_s), because both
would share the one staging pool. The guard (a global optimizer step pre-hook) blocks the next
optimizer.step() until the snapshot no longer reads live parameters or optimizer state.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import catalog, layout
from .codecs import Codec
from .errors import CheckpointConfigError, CheckpointError, CheckpointSaveError
from .metrics import SaveStats, append_jsonl, log_save
from .options import ManagerOptions, SnapshotMode
from .plan import PackPlan, plan_pack
from .restore import restore_into
from .staging import StagingPool
from .storage import LocalStorage
from .tree import flatten_state
from .writer import SaveJob, run_save

log = logging.getLogger("checkpointing")


class SaveHandle:
    """A save in flight. `wait()` returns its SaveStats once committed, or raises its error."""

    def __init__(self, manager: "CheckpointManager", job: SaveJob) -> None:
        self._manager = manager
        self._job = job
        self.step = job.step

    def done(self) -> bool:
        return self._job.done.is_set()

    def wait_staged(self) -> None:
        """Block until the snapshot no longer reads live tensors (then they may be mutated)."""
        self._manager._guard(self._job)

    def wait(self, timeout: float | None = None) -> SaveStats:
        if not self._job.done.wait(timeout):
            raise CheckpointError(f"step {self.step} is not durable after {timeout} s; call wait() again or raise the timeout")
        self._manager._raise_job_error(self._job)
        return self._job_stats()

    def _job_stats(self) -> SaveStats:
        assert self._job.stats is not None
        return self._job.stats

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


class CheckpointManager:
    """Asynchronous, verified checkpoints of a training state in `local_dir`.

    One manager per directory and process. See README.md for a training-loop example and
    docs/design.md for the threads and the failure model.
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
        process_group: Any = None,
        snapshot: SnapshotMode = "async",
        staging_budget_bytes: int | None = None,
        chunk_bytes: int = 8 << 20,
        write_block_bytes: int = 32 << 20,
        direct_io: bool = True,
        fsync: bool = True,
        codecs: tuple[Codec, ...] | list[Codec] = (),
    ) -> None:
        if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir):
            raise CheckpointConfigError(f"local_dir={local_dir!r} is invalid: pass a directory path")
        self.options = ManagerOptions(
            keep_local=keep_local, keep_remote=keep_remote, snapshot=snapshot, staging_budget_bytes=staging_budget_bytes,
            chunk_bytes=chunk_bytes, write_block_bytes=write_block_bytes, direct_io=direct_io, fsync=fsync,
            incremental=incremental, remote=remote, storage_options=storage_options, codecs=tuple(codecs),
        )
        _check_single_rank(process_group)
        try:
            self.storage = LocalStorage(local_dir, direct=direct_io, fsync=fsync)
        except OSError as exc:
            raise CheckpointConfigError(f"cannot use {local_dir!s} as the checkpoint directory: {exc}") from exc
        self.directory = self.storage.root
        self._pool = StagingPool()
        self._plan_cache: tuple[tuple, PackPlan] | None = None
        self._current: SaveJob | None = None
        self._stats: list[SaveStats] = []
        self._lock = threading.Lock()
        self._closed = False
        self._remove_incomplete()
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._io_loop, name="ckpt-io", daemon=True)
        self._thread.start()
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        _LIVE.add(self)

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any], *, eager: bool | None = None) -> SaveHandle:
        """Snapshot `state` as `step`; returns once the training loop may go on."""
        t0 = time.perf_counter()
        wall = time.time()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= layout.MAX_STEP:
            raise CheckpointConfigError(f"step={step!r} is invalid: pass an int in 0..{layout.MAX_STEP}")
        prev = self._current
        if prev is not None:
            prev.done.wait()
            self._raise_job_error(prev)
        wait_prev_s = time.perf_counter() - t0 if prev is not None else 0.0
        if step in self.steps():
            raise CheckpointError(
                f"step {step} is already committed in {self.directory}: checkpoints are immutable; "
                "save under a new step number (or delete that step first)"
            )
        flat = flatten_state(state, codecs=self.options.codecs, eager=eager if eager is not None else self.options.snapshot == "eager")
        plan = self._plan_for(flat)
        start_event = None
        if any(leaf.tensor.is_cuda for leaf in flat.leaves):
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream())
        job = SaveJob(step, flat, plan, t0, wall, wait_prev_s, start_event=start_event)
        self._current = job
        self._queue.put(job)
        job.eager_staged.wait()
        if job.eager_event is not None:
            torch.cuda.current_stream().wait_event(job.eager_event)
        job.call_s = time.perf_counter() - t0 - wait_prev_s
        return SaveHandle(self, job)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save is durable; raise the error of a failed one (once)."""
        job = self._current
        if job is None:
            return
        if not job.done.wait(timeout):
            raise CheckpointError(f"step {job.step} is not durable after {timeout} s; call wait() again or raise the timeout")
        self._raise_job_error(job)

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot no longer reads live tensors.

        Call this before mutating saved tensors outside optimizer.step() (which is guarded already).
        """
        if self._current is not None:
            self._guard(self._current)

    def restore(self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Restore `step` (default: the newest committed) into `state` in place; None if there is none."""
        self._check_open()
        if self._current is not None:
            self._current.done.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        manifest = catalog.load_manifest(self.storage, step)
        t0 = time.perf_counter()
        restore_into(state, manifest, self.storage, codecs=self.options.codecs, strict=strict)
        log.info("checkpointing: restored step %d (%.1f MB) in %.3f s from %s", step, manifest.nbytes / 1e6, time.perf_counter() - t0, self.directory)
        return step

    def steps(self) -> list[int]:
        """Committed steps on the local tier, ascending."""
        return catalog.list_steps(self.storage).committed

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def stats(self) -> list[SaveStats]:
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
        try:
            self.wait()
        finally:
            self._closed = True
            self._hook.remove()
            self._queue.put(None)
            self._thread.join()
            self._pool.release()

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
        return f"CheckpointManager({str(self.directory)!r}, keep_local={self.options.keep_local})"

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")

    def _raise_job_error(self, job: SaveJob) -> None:
        if job.error is not None and not job.error_reported:
            job.error_reported = True
            if isinstance(job.error, CheckpointSaveError):
                raise job.error
            raise CheckpointSaveError(job.step, job.error) from job.error

    def _plan_for(self, flat: Any) -> PackPlan:
        sizes = [leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flat.leaves]
        deferred = [leaf.deferred for leaf in flat.leaves]
        key = (tuple(sizes), tuple(deferred))
        if self._plan_cache is None or self._plan_cache[0] != key:
            plan = plan_pack(sizes, deferred, chunk_bytes=self.options.chunk_bytes, budget=self.options.staging_budget_bytes)
            self._plan_cache = (key, plan)
        return self._plan_cache[1]

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        job = self._current
        if job is not None and not job.done.is_set():
            self._guard(job)

    def _guard(self, job: SaveJob) -> None:
        with job.lock:
            if not job.staged.is_set():
                t0 = time.perf_counter()
                job.staged.wait()
                job.guard_wait_s += time.perf_counter() - t0
            if job.staged_event is not None:
                torch.cuda.current_stream().wait_event(job.staged_event)

    def _remove_incomplete(self) -> None:
        for step in catalog.list_steps(self.storage).incomplete:
            log.info("checkpointing: removing incomplete step %d (a save that did not commit) from %s", step, self.directory)
            catalog.delete_step(self.storage, step)

    def _io_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                run_save(job, self._pool, self.storage, write_block=self.options.write_block_bytes)
            except BaseException as exc:  # reported at the next save()/wait()
                job.error = exc
            job.release_waiters()
            try:
                if job.error is None:
                    catalog.apply_retention(self.storage, self.options.keep_local, protect=job.step)
            except Exception as exc:  # retention is retried after the next commit; never stop the thread
                log.warning("checkpointing: retention after step %d failed: %s", job.step, exc)
            finally:
                self._finish(job)

    def _finish(self, job: SaveJob) -> None:
        try:
            self._record(job)
        finally:
            job.done.set()

    def _record(self, job: SaveJob) -> None:
        with job.lock:  # the guard may still be adding its wait
            ok = job.error is None
            end = job.t_committed if ok else time.perf_counter()
            write_s = max(0.0, job.t_written - job.t_staged) if ok else 0.0
            stats = SaveStats(
                step=job.step, ok=ok, error=None if ok else f"{type(job.error).__name__}: {job.error}",
                wait_prev_s=job.wait_prev_s, stall_s=job.stall_s, guard_wait_s=job.guard_wait_s,
                snapshot_s=max(0.0, job.t_staged - job.t_call - job.wait_prev_s) if job.t_staged else 0.0,
                write_s=write_s, commit_s=max(0.0, job.t_committed - job.t_written) if ok else 0.0,
                total_s=end - job.t_call - job.wait_prev_s,
                bytes_total=job.flat.nbytes, bytes_written=job.bytes_written if ok else 0, bytes_reused=0,
                write_bytes_per_s=job.bytes_written / write_s if ok and write_s > 0 else 0.0,
                staging_bytes=self._pool.capacity, time=job.wall_time,
            )
        with self._lock:
            self._stats.append(stats)
            job.stats = stats
        try:
            append_jsonl(self.directory / layout.METRICS_NAME, stats)
        except OSError as exc:
            log.warning("checkpointing: could not append metrics to %s: %s", self.directory, exc)
        log_save(stats, str(self.directory))


_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _finish_saves_at_exit() -> None:
    """A save issued just before the interpreter exits still becomes durable."""
    for mgr in list(_LIVE):
        try:
            mgr.close()
        except Exception as exc:  # noqa: BLE001 - exiting: report, do not raise
            log.error("checkpointing: at exit: %s", exc)


def _check_single_rank(process_group: Any) -> None:
    import torch.distributed as dist

    world = 1
    if process_group is not None:
        world = dist.get_world_size(process_group)
    elif dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if world > 1:
        raise CheckpointConfigError(
            f"this version checkpoints one rank; the process group has {world} ranks. "
            "Run with one process, or pass process_group=None outside torch.distributed"
        )
