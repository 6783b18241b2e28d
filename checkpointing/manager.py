"""CheckpointManager: the public entry point (orchestration only: it composes the objects that do the work).

Threads: the training thread calls save()/restore()/wait(); one background I/O thread per manager runs each save (stage -> write
-> commit -> retention -> metrics). Saves run one at a time: a save requested while the previous one still writes waits for it
(reported as wait_prev_s), because both would share the one staging pool. The guard (a global optimizer step pre-hook) blocks the
next optimizer.step() until the snapshot no longer reads live parameters or optimizer state.

Across ranks (a torch.distributed process group of more than one rank), every rank writes its own shards to its local tier and the
coordinator (dist/store_coordinator.py) commits the step through the store; construction, restore() and delete() are collective
calls, save() is not (it never waits on another rank).

The objects it composes: SaveIssuer (save/issue.py) makes each save on the training thread, and InFlight (save/inflight.py) holds
those not yet reported; SaveWorker (save/worker.py) runs them on the ckpt-io thread, SaveRecords (save/records.py) records each
finished one. With a remote tier (remote=...), the Uploader (save/uploader.py) uploads each step on a second background thread
once it is committed locally. save() does not wait for that upload, only for the one before it: at most one step uploads while the
next one is written, so a link slower than the checkpoint interval shows up as wait_prev_s instead of an unbounded backlog of
local steps. handle.wait() and wait() return once a step is durable on every tier.

Observability and the loop (training/loop.py, observe/accounting.py): optimizer.step() or mgr.step() marks steps; each save's
record is completed with what it cost the loop once the steps during its background work have ended, and written by a "ckpt-metrics"
thread that also runs on_metrics. With handle_preemption() a "ckpt-preempt" watchdog ends the process if the grace period runs out.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Sequence

from torch.optim.optimizer import Optimizer

from checkpointing.dist.coordinator import open_coordinator, resolve_group
from checkpointing.dist.types import Coordinator
from checkpointing.dist.writer import start_writing
from checkpointing.errors import CheckpointConfigError, CheckpointError
from checkpointing.format import naming
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.observe.metrics import SaveStats
from checkpointing.observe.steptime import RunSummary
from checkpointing.options import DEFAULT_CHUNK_BYTES, DEFAULT_YIELD_S, ChangeDetection, ManagerOptions, SnapshotMode
from checkpointing.peer.node import open_peers
from checkpointing.plan.retention import RetentionPolicy, tier_states
from checkpointing.plan.schedule import SaveSchedule
from checkpointing.restore.attempt import restore_clean
from checkpointing.restore.selection import Selection
from checkpointing.restore.step_choice import choose_step
from checkpointing.save.handle import SaveHandle
from checkpointing.save.inflight import InFlight
from checkpointing.save import live
from checkpointing.save.issue import SaveIssuer
from checkpointing.save.planning import PackPlanner
from checkpointing.save.records import SaveRecords
from checkpointing.save.staging import StagingPool
from checkpointing.save.stepped import SteppedOptimizers, register_guard
from checkpointing.save.uploader import PendingUploads, Uploader, start_uploader
from checkpointing.save.deletion import StepDeleter
from checkpointing.save.worker import AfterUpload, LocalRetention, SaveWorker
from checkpointing.state.codecs import Codec, codec_tuple
from checkpointing.storage import FsspecStorage
from checkpointing.tier import catalog, collect
from checkpointing.tier.lock import NotHeld
from checkpointing.tier.opening import open_local_tier, open_remote_tier
from checkpointing.training.loop import StepScope, TrainingLoop

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from checkpointing.save.job import UploadJob

__all__ = ["CheckpointManager", "SaveHandle", "StepScope"]

log = logging.getLogger("checkpointing")


class CheckpointManager:
    """Asynchronous, verified checkpoints of a training state in `local_dir`.

    One manager per directory and process. See README.md for a training-loop example and
    docs/design.md for the threads and the failure model. Step marks, should_save() and
    handle_preemption() are the training loop's side (training/loop.py, docs/observability.md).
    """

    def __init__(
        self,
        local_dir: str | os.PathLike,
        *,
        remote: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_local: int | RetentionPolicy | None = 2,
        keep_remote: int | RetentionPolicy | None = None,
        incremental: bool = True, reverify_every: int | None = 10, reverify_bytes_per_s: float = 200e6,
        background_yield_s: float | None = DEFAULT_YIELD_S,
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
        read_only: bool = False,
        peer_copies: int = 0, peer_bandwidth: float | None = None,
    ) -> None:
        if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir):
            raise CheckpointConfigError(f"local_dir={local_dir!r} is invalid: pass a directory path")
        self.options = ManagerOptions(
            keep_local=keep_local, keep_remote=keep_remote, snapshot=snapshot, staging_budget_bytes=staging_budget_bytes, chunk_bytes=chunk_bytes,
            write_block_bytes=write_block_bytes, direct_io=direct_io, fsync=fsync, reverify_every=reverify_every, reverify_bytes_per_s=reverify_bytes_per_s,
            incremental=incremental, change_detection=change_detection, background_yield_s=background_yield_s, remote=remote, storage_options=storage_options, codecs=codec_tuple(codecs),
            timeout_s=timeout_s, upload_concurrency=upload_concurrency, upload_part_bytes=upload_part_bytes, upload_bytes_per_s=upload_bytes_per_s,
            interval=interval, mtbf_s=mtbf_s, on_metrics=on_metrics, read_only=read_only, peer_copies=peer_copies, peer_bandwidth=peer_bandwidth,
        )
        group = resolve_group(process_group)
        self.remote_storage: FsspecStorage | None = open_remote_tier(self.options, local_dir)
        self.storage = open_local_tier(local_dir, read_only=read_only, direct=direct_io, fsync=fsync, remote=remote is not None)
        self.directory = self.storage.root
        self._coord: Coordinator = open_coordinator(self.storage, group, timeout_s=self.options.timeout_s, read_only=read_only)
        self.rank = self._coord.rank
        self.world_size = self._coord.world_size
        self._closed = False
        self._restore_calls = itertools.count()  # names each restore's exchange between the ranks (restore/attempt.py)
        # the leader rank of each local tier takes its writer lock and tidies it, before anyone writes there
        self._lock = NotHeld() if read_only else start_writing(self._coord, self.directory, tidy=lambda: collect.remove_incomplete(self.storage))
        self._peers = open_peers(self.options, self.storage, self._coord, release=self._lock.release)  # peer copies: checkpointing/peer/
        self._compose(group)
        self._hook = None if read_only else register_guard(self._on_optimizer_step)
        live.track(self.close, self._forked)  # closed at exit; disowned by a forked child (save/live.py)

    __init__.__doc__ = ManagerOptions.__doc__  # every option, kept beside its checks (options.py)

    def _compose(self, group: ProcessGroup | None) -> None:
        """The objects that do the work, wired together (see the module docstring)."""
        options, coord = self.options, self._coord
        self._pool = StagingPool()
        self._stepped = SteppedOptimizers()  # what the guard watches: state_dict() tensors defer like objects
        schedule = None if options.interval is None else SaveSchedule(options.interval, options.mtbf_s, follow=self.world_size == 1)
        self._acct = SaveAccounting(self.directory / naming.METRICS_NAME, on_metrics=options.on_metrics, schedule=schedule)
        self._inflight = InFlight(stall=self._acct.stall)
        self._records = SaveRecords(self._acct, self._pool, rank=self.rank, world_size=self.world_size, local=str(self.directory),
                                    remote=self._remote_url())
        pending = PendingUploads()
        writers = 1 if options.read_only else sum(1 for tier in coord.tiers if tier == coord.tiers[self.rank])  # ranks writing pack files here
        retention = LocalRetention(self.storage, options.local_retention, enabled=coord.leader, in_flight=self._inflight.steps, pending=pending,
                                   held=self._peers.held, spares=writers)
        self._uploader: Uploader | None = None
        resumed: list[UploadJob] = []
        if self.remote_storage is not None and not options.read_only:  # collective: the ranks agree on interrupted uploads to resume
            self._uploader, resumed = start_uploader(self.storage, self.remote_storage, coord, keep_remote=options.remote_retention,
                                                     on_finish=AfterUpload(self._records, retention), pending=pending, yield_s=options.yield_s)
            self._inflight.resumed(resumed, coord.world_size)
        if not options.read_only:  # a record for each save a killed process committed and did not record
            self._records.recover(self.storage, resumed={j.step for j in resumed}, remote=self._uploader)
        self._worker = SaveWorker(self.storage, self._pool, coord, write_block=options.write_block_bytes, incremental=options.incremental,
                                  records=self._records, retention=retention, uploader=self._uploader,
                                  reverify_every=options.reverify_every, reverify_bytes_per_s=options.reverify_bytes_per_s,
                                  after_local=self._peers.committed, yield_s=options.yield_s)
        planner = PackPlanner(coord, group, chunk_bytes=options.chunk_bytes, budget=options.staging_budget_bytes)
        self._saves = SaveIssuer(options, self.storage, planner=planner, inflight=self._inflight, worker=self._worker,
                                 uploader=self._uploader, acct=self._acct, world_size=self.world_size, stepped=self._stepped)
        self._loop = TrainingLoop(self._acct, self._saves, rank=self.rank, world_size=self.world_size, new_store=coord.new_store_client)
        self._deleter = StepDeleter(self.storage, self.remote_storage, coord, inflight=self._inflight, worker=self._worker, uploader=self._uploader)

    # ------------------------------------------------------------------ public API

    def save(self, step: int, state: Mapping[str, Any], *, eager: bool | None = None,
             metrics: Mapping[str, float] | None = None) -> SaveHandle:
        """Snapshot `state` as `step`; returns once the training loop may go on.

        `metrics` ({"loss": 0.31}: finite numbers by name) are stored with the step, in its manifest
        and COMMIT, for retention by metric (KeepBest) and `checkpointing ls`; with several ranks,
        rank 0's are recorded. Every rank calls save() with the same step; none waits for the others.
        """
        self._check_open("save()")
        for older in self._deleter.passed_over():  # restore(step=None) resumed from an older step than these
            self.delete(older, allow_latest=True, missing_ok=True)
        self._peers.wait_previous(self._saves.current)  # at most one step copies to the peers while the next is written
        job = self._saves.issue(step, state, eager=eager, metrics=metrics)
        self._loop.at_safe_point(step)
        return SaveHandle(job, stall=self._acct.stall, peer=self._peers.track(job.seq, step))

    def delete(self, step: int, *, allow_latest: bool = False, missing_ok: bool = False) -> None:
        """Delete committed `step` from every tier (the local tier, and the remote one if configured).

        Reference-safe: files of `step` whose chunks later (incremental) steps use stay until those
        steps go. The newest committed step needs allow_latest=True. To rewind: restore(step=k),
        delete the newer steps, then save k+1 on. Waits for the save and uploads in flight first.
        CheckpointNotFoundError when `step` is committed on no tier (missing_ok: delete it where it is, and
        from no tier is no error). With several ranks a collective call: every rank, the same step (save/deletion.py)."""
        self._check_open("delete()")
        self._peers.settle()
        self._deleter.delete(step, allow_latest=allow_latest, missing_ok=missing_ok)
        self._peers.delete(step)  # and the copies this node holds of other nodes' step

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save is durable on every configured tier, and the files of the steps local
        retention retired are removed; raise the error of a failed save (once). (A handle's wait() returns
        once its step is durable: the retired steps are unlisted then, their files may still be going.)"""
        self._inflight.wait(timeout)
        self._peers.wait(timeout)
        self._worker.settle(timeout)  # and the files of the steps retention retired are removed

    def wait_staged(self) -> None:
        """Block until the in-flight snapshot no longer reads live tensors: call it before mutating saved tensors outside optimizer.step() (guarded already)."""
        self._inflight.wait_staged()

    def restore(self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True,
                only: str | Sequence[str] | None = None, exclude: str | Sequence[str] | None = None) -> int | None:
        """Restore `step` (default: the newest committed one every rank can read) into `state` in place; returns
        the step, or None when there is none. With several ranks a collective call: the ranks agree on the step,
        and each reads only the chunks it needs (resharding DTensors when the world size, the mesh or the pipeline
        stages changed). only / exclude: glob patterns over the keys ("model", "optim/*"): restore just those (the
        rest of `state` keeps its values; a pattern matching nothing is an error). Names that differ only by wrappers
        (torch.compile's `_orig_mod.`) match, and an object and its state_dict() restore into each other. Every byte
        is verified before anything is applied; with step=None a step whose data is damaged on every copy is passed
        over for the next older one (a warning names it; restore/attempt.py). The newer steps it passes over are deleted at the
        next save(), so that training saves them again (save/deletion.py retire_newer)."""
        self._check_open(step=step)
        self._inflight.before_restore()
        remote, remote_steps = self.remote_storage, set(self._remote_steps() or ())
        if remote is None and not self._coord.tiers[self.rank]:  # read-only, no TIER file: it holds every primary copy
            remote, remote_steps = self.storage, set(catalog.list_steps(self.storage).committed)
        choose = functools.partial(choose_step, state, step, Selection.of(strict, only, exclude), local=self.storage, remote=remote, remote_steps=remote_steps,
                                   coord=self._coord, codecs=self.options.codecs, replicas=self._peers.before_restore(step, remote_steps))
        t0 = time.perf_counter()
        chosen, sources = restore_clean(state, step, choose, self._coord, name=f"restore-read-{next(self._restore_calls)}",
                                        before_read=self._worker.drop_base)  # a failed restore leaves no base for the next save
        if chosen is None or sources is None:
            return None
        if step is None and not self.options.read_only:
            self._deleter.retire_newer(chosen)
        if self.options.incremental:  # the next save writes only what changed since this step (all, if damaged here)
            self._worker.use_restored(chosen, clean=not sources.fallbacks)
        log.info("checkpointing: rank %d restored step %d in %.3f s: %s", self.rank, chosen, time.perf_counter() - t0,
                 sources.summary(str(self.directory), self._remote_url()))
        return chosen

    def steps(self) -> list[int]:
        """Committed steps this rank can see, ascending: on its local tier, or on the remote tier."""
        return sorted(self.tiers())

    def tiers(self) -> dict[int, str]:
        """Each committed step -> where it is durable: 'local', 'local+remote' or 'remote' (ascending); with
        peer_copies, '+peer' where every peer of this rank's node holds a committed copy ('local+peer+remote'; a replaced node's fetched-back step is 'local').

        Lists the remote tier (one request per step there); if it cannot be reached the answer is
        the local tier plus the steps this manager knows it uploaded, and a warning is logged.
        """
        return self._peers.tier_states(tier_states(self._peers.on_disk(catalog.list_steps(self.storage).committed), self._remote_steps()))

    def _remote_steps(self) -> list[int] | None:
        if self.remote_storage is None:
            return None
        try:
            return catalog.list_steps(self.remote_storage).committed
        except (OSError, CheckpointError) as exc:
            log.warning("checkpointing: cannot list the remote tier %s (%s); showing what this process uploaded", self._remote_url(), exc)
            return None if self._uploader is None else sorted(self._uploader.remote_steps())

    def latest_step(self) -> int | None:
        return max(self.steps(), default=None)

    def stats(self) -> list[SaveStats]:
        """Each finished save's SaveStats, oldest first (the last 10,000; metrics.jsonl keeps them all); the
        step fields (step_stall_s, slowdown_s, cost_s, overhead_pct, step_time_s) are filled in once the
        save's cost is final."""
        return self._records.all()

    @property
    def staging_bytes(self) -> int:
        """Bytes held by the staging pool (allocated once, reused by every save)."""
        return self._pool.capacity

    def close(self) -> None:
        """Wait for in-flight saves, stop the I/O thread, free the staging pool."""
        if self._closed:
            return
        try:
            self.wait(self._loop.at_close())  # a pending preemption's save first; then at most its grace
        finally:
            self._closed = True
            self._loop.stop()
            if self._hook is not None:
                self._hook.remove()
            self._worker.close()
            if self._uploader is not None:  # its queue is empty: wait() waited for every upload (unless it raised)
                self._uploader.close(records=self._acct.close)  # the records close() makes final, then their copy there
            else:
                self._acct.close()
            if self.remote_storage is not None:
                self.remote_storage.close(final=True)
            self._pool.release()
            self._coord.close()  # with several ranks: leave together (rank 0 may host the store)
            self._peers.close()  # every rank is closing: none copies to, fetches or lists this node's server any more
            self._lock.release()  # after the last write: another process may take the directory now

    # ------------------------------------------------------------------ the training loop's side (training/loop.py)

    def step(self, step: int) -> StepScope:
        """Mark the beginning of training step `step` (which ends the step begun before it).

        Not needed in loops with an optimizer: each optimizer.step() marks a step already. Call it
        at the top of every iteration, or wrap the iteration in ``with mgr.step(step):`` (which also
        marks its end). From the first call on, steps are marked only this way.
        """
        return self._loop.step(step)

    def should_save(self, step: int) -> bool:
        """Whether to save `step` now, by the manager's `interval` (every N steps, or "auto").

        Call it where you would save, after training step `step`: ``if mgr.should_save(step):
        mgr.save(step, state)``. With interval="auto" the first call of a run answers True, and
        later ones follow Daly's interval from the measured cost of saves (checkpointing/schedule.py).
        Every rank gets the same answers. After a preemption signal it is where the emergency
        save happens (handle_preemption).
        """
        return self._loop.should_save(step)

    @property
    def interval_steps(self) -> int | None:
        """The interval should_save() follows, in steps (None without one, or before "auto" measured a save)."""
        return self._loop.interval_steps

    def summary(self) -> RunSummary:
        """The run so far: steps, training wall time, what the saves cost in all and as a share of
        training time, the median step time, and seconds from this manager's creation to the first
        durable save (time_to_first_durable_s)."""
        return self._loop.summary()

    def handle_preemption(self, state: Mapping[str, Any], *, grace_s: float = 30.0,
                          signals: tuple[int, ...] | list[int] = (signal.SIGTERM,)) -> None:
        """On one of `signals`, save `state` at the next step boundary, commit it locally, and exit.

        Call it once, from the main thread, on every rank, with the state you pass to save().
        After the signal, the next ``mgr.should_save(step)``, ``mgr.save(step, ...)`` or
        ``mgr.step(step)`` (a point where `state` is that after a finished step) saves it as that
        step (a save of that step in flight is finished instead), waits until it is committed on
        the local tier (the remote upload may not finish; the next start resumes it), and exits
        with status 128 + signum, within `grace_s` seconds of the signal (after which the process
        exits anyway, leaving nothing half-visible). Several ranks agree on the step through the
        job's store. Details: checkpointing/preemption.py and docs/observability.md.
        """
        self._check_open("handle_preemption()")
        self._loop.handle_preemption(state, grace_s=grace_s, signals=signals)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except CheckpointError as err:
            if exc_type is None:
                raise
            log.error("checkpointing: %s", err)  # do not hide the exception already propagating

    def __repr__(self) -> str:
        remote = f", remote={self._remote_url()!r}, keep_remote={self.options.keep_remote}" if self.remote_storage is not None else ""
        return f"CheckpointManager({str(self.directory)!r}, keep_local={self.options.keep_local}{remote})"

    def _check_open(self, writes: str = "", step: int | None = None) -> None:
        naming.check_step(step, optional=True)
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one")
        if writes and self.options.read_only:
            raise CheckpointConfigError(f"this CheckpointManager was opened read_only=True: {writes} would change {self.directory}; "
                                        "open it without read_only (one writing manager per directory) to save or delete")

    def _remote_url(self) -> str:
        return self.remote_storage.url if self.remote_storage is not None else ""

    def _forked(self) -> None:
        """In a child forked from this process (save/live.py): closed, without waiting for the parent's saves or writing."""
        self._closed = True
        self._inflight.forked()  # a wait here returns at once
        if self._hook is not None:
            self._hook.remove()  # the child's optimizer steps wait for no snapshot

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._inflight.guard()
        self._stepped.saw(optimizer)
        self._loop.optimizer_step(optimizer)
