"""One save as the threads share it: frozen inputs, staging progress, the outcome, and its upload (orchestration).

A `SaveJob` holds four parts, each with its writers named:

- `inputs` (SaveInputs, frozen): what save() decided on the training thread (save/issue.py).
- `staging` (Staging): the snapshot's progress, written by the writer on the ckpt-io thread
  (save/writer.py), waited for by the training thread, which adds what waiting cost it.
- `outcome` (SaveOutcome): what became of the save, written by the ckpt-io thread (the writer's
  pin, then save/worker.py: the write's result, the commit, the error, `done`), and read by
  everyone once `done` is set.
- `upload` (UploadJob, None without a remote tier): the step's way to the remote tier, run by the
  ckpt-upload thread (save/uploader.py) once the worker hands it over.

Errors are raised once: the first caller of `raise_error()` (handle.wait(), save(), wait()) raises
it, later ones do not; a background thread that has reported it elsewhere marks it reported.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch

from checkpointing.dist.types import SaveRef
from checkpointing.errors import CheckpointSaveError
from checkpointing.format import naming
from checkpointing.format.manifest import ChunkRef, CommittedStep, Metrics
from checkpointing.observe.metrics import SaveStats
from checkpointing.plan.pack import PackPlan, plan_pack
from checkpointing.plan.reuse import PlaceKey, ReuseBase
from checkpointing.state.tree import FlatState

log = logging.getLogger("checkpointing")

Stall = Callable[[int, float], None]  # (step, seconds the training thread waited): SaveAccounting.stall


@dataclasses.dataclass(frozen=True, eq=False)
class SaveInputs:
    """What save() decided (training thread); nothing changes it once the job is queued."""

    step: int
    seq: int  # this save's number among the manager's saves: the same on every rank
    flat: FlatState
    plan: PackPlan
    regions: list[int]  # per leaf: assign.UNIQUE / PRIMARY / TIER / OTHER
    t_call: float  # perf_counter when save() was entered
    wall_time: float  # time.time() then
    wait_prev_s: float  # save() waited this long for the previous save (and older uploads)
    token: str = dataclasses.field(default_factory=naming.new_token)  # names this attempt's files
    base: ReuseBase | None = None  # the previous save's chunks this one may take instead of writing (incremental)
    start_event: torch.cuda.Event | None = None  # CUDA: recorded on the compute stream in save()
    watch_writes: bool = False  # ask the kernel which pages were written since the last save (writewatch.py)
    metrics: Metrics = dataclasses.field(default_factory=dict)  # save(..., metrics=...), checked (rank 0's go into the manifest)

    @property
    def ref(self) -> SaveRef:
        """Which save this is, as the coordinator is told (dist/types.py)."""
        return SaveRef(self.step, self.seq, self.token, self.metrics)


class Staging:
    """The snapshot's progress. The writer (ckpt-io thread) sets the events and CUDA events and
    `t_staged`; the training thread waits for them and writes `call_s` (save(), once) and
    `guard_wait_s` (under `lock`, which the worker also takes to read it for the save's stats)."""

    def __init__(self) -> None:
        self.eager_staged = threading.Event()  # the eager chunks are copied: save() may return
        self.staged = threading.Event()  # every chunk is copied: live tensors may change
        self.eager_event: torch.cuda.Event | None = None  # CUDA: the eager copies' completion, for the compute stream to wait on
        self.staged_event: torch.cuda.Event | None = None  # CUDA: every copy's completion
        self.t_staged = 0.0
        self.lock = threading.Lock()  # guard accounting vs the save's stats
        self.call_s = 0.0  # time inside save() after wait_prev_s
        self.guard_wait_s = 0.0  # the guard's waits for `staged`

    @property
    def stall_s(self) -> float:
        return self.call_s + self.guard_wait_s

    def release(self) -> None:
        """Nothing more will be copied (staging ended, or the save failed): wake every waiter."""
        self.eager_staged.set()
        self.staged.set()

    def wait(self, step: int, stall: Stall) -> None:
        """The guard: block until live tensors may change; the wait counts as the save's stall."""
        with self.lock:
            if not self.staged.is_set():
                t0 = time.perf_counter()
                self.staged.wait()
                waited = time.perf_counter() - t0
                self.guard_wait_s += waited
                stall(step, waited)
            if self.staged_event is not None:
                torch.cuda.current_stream().wait_event(self.staged_event)


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What writing this rank's part produced (writer.run_save returns it; the worker keeps it)."""

    t_written: float  # perf_counter when the pack data was durable
    bytes_written: int  # the pack file's size
    bytes_reused: int  # taken from earlier steps instead of written
    bytes_unwritten: int  # not written since the previous save: neither compared nor copied
    chunks_reused: int
    chunks_total: int
    digests: list[str]  # per placement
    refs: list[ChunkRef | None]  # per placement: where this save stores it (None: a peer does)
    keys: list[PlaceKey]  # per placement (reuse.ReuseBase.keys)


@dataclasses.dataclass(frozen=True)
class Reverified:
    """Borrowed chunks read back and digested since the previous save (save/scrub.py), and how many
    of them were damaged (this save wrote those anew)."""

    bytes: int = 0
    chunks: int = 0
    damaged: int = 0


class Signal(threading.Event):
    """An Event that also calls hooks once set (`when_set`): what a SaveHandle's Future state follows, with no
    thread of its own. A hook runs on the thread that sets the event, after it is set: it must be short and never raise."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks: list[Callable[[], None]] = []
        self._hooks_lock = threading.Lock()

    def when_set(self, hook: Callable[[], None]) -> None:
        """Call `hook()` once set: now, if it is."""
        with self._hooks_lock:
            if not self.is_set():
                self._hooks.append(hook)
                return
        hook()

    def set(self) -> None:
        with self._hooks_lock:
            super().set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - whoever sets the event (the writer) goes on
                log.exception("checkpointing: a hook of a save's event failed")


class SaveOutcome:
    """What became of the save. The ckpt-io thread writes it: `pin` (the writer, while writing),
    `written`, `committed`, `t_committed` and `yielded_s` (the worker, from what
    the coordinator returns), then `done`; `reverified` (the worker, before the write); `hurry` (the
    worker, when the job is submitted; `wait()` calls it). `error` is the worker's (or save()'s, for
    a save that failed inside it); `stats` is the SaveRecords' (save/records.py); whoever raises or
    logs the error sets `error_reported`. Waiters call `wait()`, not `done.wait()`."""

    def __init__(self) -> None:
        self.done = Signal()  # committed locally or failed; the next save may start
        self.pin: str | None = None  # this rank's pin while the save is in flight (tier/pins.py)
        self.written: WriteResult | None = None
        self.reverified = Reverified()  # the worker's, before the write: re-verification since the previous save
        self.committed: CommittedStep | None = None  # the step as committed (its manifest's digest and file table)
        self.t_committed = 0.0
        self.stats: SaveStats | None = None  # once recorded; replaced when its step fields are final
        self.retried: dict[str, Any] | None = None  # its upload, tried again, succeeded: the record's fields it changed
        self.error: BaseException | None = None
        self.error_reported = False
        self.yielded_s: float | None = None  # the worker's: seconds its threads gave the CPU away (save/yielding.py)
        self.hurry: Callable[[], None] | None = None  # the worker's (at submit): ends that yielding
        self.waited = False  # something waited for it: its threads are not lowered again (CpuYield.waited)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `done` (False on timeout). A save waited for stops yielding the CPU (save/yielding.py)."""
        if not self.done.is_set() and self.hurry is not None:
            self.waited = True  # before hurry(): see CpuYield.waited
            self.hurry()
        return self.done.wait(timeout)


@dataclasses.dataclass(eq=False)
class UploadJob:
    """One step on its way to the remote tier. The worker fills in `committed` and `t_local` before
    it hands the job over; the uploader writes `seq` (at submit) and the rest; `done` is set last."""

    step: int
    save: SaveJob | None = None  # the save it continues (None: an upload resumed at start-up)
    committed: CommittedStep | None = None  # as committed on the local tier
    seq: int = -1  # upload number, the same on every rank (set by Uploader.submit)
    t_local: float = 0.0  # perf_counter when the step was committed locally
    t_done: float = 0.0
    transfer_s: float = 0.0  # this rank's own data transfer
    bytes_uploaded: int = 0
    bytes_present: int = 0  # already on the remote tier (earlier steps' files, or a resumed upload's)
    pin: str | None = None  # this rank's pin on the remote tier while the upload runs (collect.py)
    sends: tuple[str, ...] | None = None  # a resumed upload's files this rank sends (plan/resume.py); None: the files it wrote
    error: BaseException | None = None
    error_reported: bool = False
    tries: int = 1  # this upload of the step is its tries-th (save/uploader.py: failed uploads are tried again)
    done: Signal = dataclasses.field(default_factory=Signal)
    hurry: Callable[[], None] | None = None  # the uploader's (at submit): its threads back at normal priority
    waited: bool = False  # something waited for it: its threads are not lowered again (CpuYield.waited)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `done` (False on timeout). An upload waited for stops yielding the CPU (save/uploader.py)."""
        if not self.done.is_set() and self.hurry is not None:
            self.waited = True  # before hurry(): see CpuYield.waited
            self.hurry()
        return self.done.wait(timeout)

    @property
    def resumed(self) -> bool:
        """Resumed at start-up, or tried again: objects of an earlier try may be on the remote tier already."""
        return self.save is None or self.tries > 1

    @property
    def upload_s(self) -> float:
        return max(0.0, self.t_done - self.t_local)

    def raise_error(self) -> None:
        """Raise the upload's error, once."""
        if self.error is not None and not self.error_reported:
            self.error_reported = True
            raise self.error


class SaveJob:
    """One save: `inputs`, `staging`, `outcome` and (with a remote tier) `upload`; see the module docstring."""

    def __init__(self, inputs: SaveInputs, *, with_upload: bool = False) -> None:
        self.inputs = inputs
        self.staging = Staging()
        self.outcome = SaveOutcome()
        self.upload = UploadJob(inputs.step, save=self) if with_upload else None

    @classmethod
    def failed(cls, step: int, seq: int, error: BaseException, *, t_call: float, wall_time: float, wait_prev_s: float,
               with_upload: bool) -> SaveJob:
        """A save that failed inside save() (raised there): run through the coordinator all the
        same, so that the other ranks hear why; its upload (kept for the same list of uploads on
        every rank) is done at once."""
        empty = plan_pack([], [], chunk_bytes=4096, budget=None)
        job = cls(SaveInputs(step, seq, FlatState({"dict": []}, []), empty, [], t_call, wall_time, wait_prev_s), with_upload=with_upload)
        job.outcome.error = error
        job.outcome.error_reported = True  # raised right now, in save()
        job.staging.release()
        if job.upload is not None:
            job.upload.done.set()
        return job

    @property
    def step(self) -> int:
        return self.inputs.step

    @property
    def seq(self) -> int:
        return self.inputs.seq

    @property
    def token(self) -> str:
        return self.inputs.token

    def wait_staged(self, stall: Stall) -> None:
        """Block until the snapshot no longer reads live tensors (the guard)."""
        self.staging.wait(self.step, stall)

    def raise_error(self) -> None:
        """Raise the save's error (as a CheckpointSaveError), once."""
        error = self.outcome.error
        if error is not None and not self.outcome.error_reported:
            self.outcome.error_reported = True
            if isinstance(error, CheckpointSaveError):
                raise error
            raise CheckpointSaveError(self.step, error) from error

    def __repr__(self) -> str:
        return f"SaveJob(step={self.step}, seq={self.seq}, done={self.outcome.done.is_set()})"
