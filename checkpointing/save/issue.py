"""The training thread's side of save(): wait for the previous save, flatten and plan, hand the job to the worker (orchestration).

save() returns once the training loop may go on: after the eager chunks are copied (and, for CUDA
state, once the compute stream is ordered after those copies). The rest of the snapshot overlaps
the next forward/backward; the guard (InFlight.guard, the optimizer step pre-hook) blocks the next
optimizer.step() until the snapshot no longer reads live parameters or optimizer state.

A save that fails inside save() with several ranks still goes through the coordinator (an empty
job carrying the error), so the other ranks, which are saving the same step, hear why.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import signal
import threading
import time
from typing import Any, Iterator, Mapping

import torch

from checkpointing.errors import CheckpointConfigError, CheckpointError, ManifestError
from checkpointing.format import naming
from checkpointing.format.decode import check_metrics
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.options import ManagerOptions
from checkpointing.save.inflight import InFlight
from checkpointing.save.job import SaveInputs, SaveJob
from checkpointing.save.planning import PackPlanner
from checkpointing.save.stepped import SteppedOptimizers
from checkpointing.save.uploader import Uploader
from checkpointing.save.worker import SaveWorker
from checkpointing.state.tree import FlatState, Owners, flatten_state
from checkpointing.storage import LocalStorage
from checkpointing.tier import catalog

log = logging.getLogger("checkpointing")


class SaveIssuer:
    """Issues the saves of one manager, in order; each gets the next `seq` (the same on every rank)."""

    def __init__(self, options: ManagerOptions, storage: LocalStorage, *, planner: PackPlanner, inflight: InFlight,
                 worker: SaveWorker, uploader: Uploader | None, acct: SaveAccounting, world_size: int,
                 stepped: SteppedOptimizers) -> None:
        self._options, self._storage = options, storage
        self._stepped = stepped
        self._planner, self._inflight, self._worker, self._uploader = planner, inflight, worker, uploader
        self._acct, self._world_size = acct, world_size
        self._seq = 0
        policies = (options.local_retention, options.remote_retention)
        self._ranked_by = frozenset().union(*(p.metric_names for p in policies if p is not None))  # KeepBest's metrics

    @property
    def current(self) -> SaveJob | None:
        """The newest save issued (it may be done)."""
        return self._inflight.current

    def committed_steps(self) -> set[int]:
        """Committed steps without asking the remote tier (save() must not wait on the network)."""
        steps = set(catalog.list_steps(self._storage).committed)
        if self._uploader is not None:
            steps |= self._uploader.remote_steps()
        return steps

    def issue(self, step: int, state: Mapping[str, Any], *, eager: bool | None = None,
              metrics: Mapping[str, Any] | None = None) -> SaveJob:
        """Snapshot `state` as `step` (CheckpointManager.save); returns once the training loop may go on."""
        t0 = time.perf_counter()
        wall = time.time()
        naming.check_step(step)
        waited = self._inflight.wait_previous()
        waited = self._worker.finish_previous() or waited  # its retention and re-verification, after its `done`
        wait_prev_s = time.perf_counter() - t0 if waited else 0.0
        seq = self._seq
        self._seq += 1
        try:
            checked = self._metrics(step, metrics)
            flat = self._flatten(step, state, eager)
            plan, regions = self._planner.plan_for(flat)
        except BaseException as exc:
            if self._world_size > 1:  # the other ranks are saving this step: tell them it failed here
                self._submit(SaveJob.failed(step, seq, exc, t_call=t0, wall_time=wall, wait_prev_s=wait_prev_s,
                                            with_upload=self._uploader is not None))
            raise
        start_event = None
        if any(leaf.tensor.is_cuda for leaf in flat.leaves):
            start_event = torch.cuda.Event()
            start_event.record(torch.cuda.current_stream())
        options = self._options
        inputs = SaveInputs(step, seq, flat, plan, regions, t0, wall, wait_prev_s, base=self._worker.take_base(), start_event=start_event,
                            watch_writes=options.incremental and options.change_detection == "auto", metrics=checked)
        job = SaveJob(inputs, with_upload=self._uploader is not None)
        with _interrupt_held():  # registered and queued, or neither
            self._inflight.add(job)
            self._acct.issued(step, t0)
            self._worker.submit(job)
        staging = job.staging
        staging.eager_staged.wait()
        if staging.eager_event is not None:
            torch.cuda.current_stream().wait_event(staging.eager_event)
        t_end = time.perf_counter()
        staging.call_s = t_end - t0 - wait_prev_s
        self._acct.returned(step, t_end)
        return job

    def _flatten(self, step: int, state: Mapping[str, Any], eager: bool | None) -> FlatState:
        if step in self.committed_steps():
            raise CheckpointError(
                f"step {step} is already committed in {self._storage.root}"
                f"{' or on the remote tier' if self._uploader is not None else ''}: checkpoints are immutable; save under "
                f"a new step number, or delete that step first with mgr.delete({step}) (the newest step: "
                f"mgr.delete({step}, allow_latest=True); a step some ranks no longer see, after a node was lost: add "
                f"missing_ok=True, on every rank; CLI: checkpointing rm DIR_OR_URL --step {step})"
            )
        eager = eager if eager is not None else self._options.snapshot == "eager"
        watched: Owners = {}
        # plain tensors of watched optimizers (state dicts) copy as late as the objects do (not a Mapping: flatten_state says what to pass)
        if not eager and isinstance(state, Mapping):
            self._stepped.saw_in(state)
            watched = self._stepped.storages()
        return flatten_state(state, codecs=self._options.codecs, eager=eager, watched=watched)

    def _metrics(self, step: int, metrics: Mapping[str, Any] | None) -> dict[str, int | float]:
        """save()'s metrics, checked; a warning (once) when a KeepBest policy's metric is missing."""
        checked = checked_metrics(step, metrics)
        missing = self._ranked_by - checked.keys()
        if missing:
            log.warning("checkpointing: step %d was saved without metrics %s, by which the retention (KeepBest) ranks steps: "
                        "only the other rules can keep it; pass save(step, state, metrics={...})", step, sorted(missing))
            self._ranked_by = frozenset()  # once
        return checked

    def _submit(self, job: SaveJob) -> None:
        self._inflight.add(job)
        self._worker.submit(job)


def checked_metrics(step: int, metrics: Mapping[str, Any] | None) -> dict[str, int | float]:
    """save(..., metrics=...) as the manifest records them: names to finite ints or floats (numpy
    scalars are converted; a tensor is refused: pass loss.item(), which save() should not wait for
    a device to compute)."""
    if metrics is None:
        return {}
    where = f"save(step={step}, metrics=...)"
    if not isinstance(metrics, Mapping):
        raise CheckpointConfigError(f"{where} takes a dict of names to numbers, e.g. metrics={{'loss': 0.31}}; got a {type(metrics).__name__}")
    out: dict[Any, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        else:
            hint = " (a tensor: pass loss.item())" if isinstance(value, torch.Tensor) else ""
            raise CheckpointConfigError(f"{where}: metric {name!r:.80} is a {type(value).__name__}{hint}; pass an int or a float")
        out[name] = value
    try:
        return check_metrics(out, where)
    except ManifestError as exc:
        raise CheckpointConfigError(str(exc)) from None


@contextlib.contextmanager
def _interrupt_held() -> Iterator[None]:
    """SIGINT (Ctrl-C) held back while a save is registered and handed to its thread, then handled: between the two,
    the KeyboardInterrupt that Python's handler (or a program's own) raises would leave the save registered but never
    run, and every later save, wait() and close() waiting for it for ever. Only in the main thread (where Python runs
    signal handlers), and only for a Python handler (a program's SIG_IGN or SIG_DFL raises nothing)."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    caught: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if caught:
        handler(*caught[0])  # Python's raises KeyboardInterrupt
