"""What the training loop calls besides save() and restore(): step marks, should_save, preemption
handling, the run's summary (orchestration).

A mixin of CheckpointManager, like background.py, so that manager.py stays the save/restore
path. The measuring is in accounting.py (glue) and steptime.py / schedule.py (pure).

Several ranks and interval="auto": every rank must answer should_save() the same. Rank 0's
schedule decides; after each save, rank 0 publishes the interval in steps that applies from then
on (``auto/<n>`` in the job's store, n = saves issued in this run), taking effect from the step
after the one where it published: no rank can have passed that step yet when ranks synchronise
every step (the argument of preemption.py). Until a rank has the value for the current period,
should_save() answers False, and it polls the store (one round trip) at each call until the
value arrives, usually the step after the save's cost is measured on rank 0.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Any, Mapping

from checkpointing.format import naming
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.errors import CheckpointConfigError
from checkpointing.observe.metrics import SaveStats
from checkpointing.options import PreemptionOptions
from checkpointing.training.preemption import Preemption
from checkpointing.plan.schedule import SaveSchedule
from checkpointing.observe.steptime import RunSummary
from checkpointing.save.writer import SaveJob


class LoopHooks:
    """The training loop's side of CheckpointManager; the attributes below are set by its constructor."""

    rank: int
    world_size: int
    _coord: Any
    _acct: SaveAccounting
    _preemption: Preemption | None
    _marks_steps: bool
    _lock: threading.Lock
    _stats: list[SaveStats]
    _store: Any = None  # the training thread's own store client (several ranks), made when first needed

    def _check_open(self) -> None:
        raise NotImplementedError

    def step(self, step: int) -> "StepScope":
        """Mark the beginning of training step `step` (which ends the step begun before it).

        Not needed in loops with an optimizer: each optimizer.step() marks a step already. Call it
        at the top of every iteration, or wrap the iteration in ``with mgr.step(step):`` (which also
        marks its end). From the first call on, steps are marked only this way.
        """
        self._check_step(step)
        self._marks_steps = True
        self._acct.begin(step)
        if self._preemption is not None:
            self._preemption.check(self._acct.last_step)
        return StepScope(self, step)

    def should_save(self, step: int) -> bool:
        """Whether to save `step` now, by the manager's `interval` (every N steps, or "auto").

        Call it where you would save, after training step `step`: ``if mgr.should_save(step):
        mgr.save(step, state)``. With interval="auto" the first call of a run answers True, and
        later ones follow Daly's interval from the measured cost of saves (checkpointing/schedule.py).
        Every rank gets the same answers. After a preemption signal it is where the emergency
        save happens (handle_preemption).
        """
        self._check_step(step)
        schedule = self._acct.schedule
        if schedule is None:
            raise CheckpointConfigError("should_save() needs a schedule: create the manager with interval=N (every N steps) "
                                        "or interval='auto' with mtbf_s=...")
        self._acct.last_step = step
        self._marks_steps = True
        if self._preemption is not None:
            self._preemption.check(step)
        if schedule.interval == "auto" and self.world_size > 1:
            self._agree_interval(schedule, step)
        return schedule.due(step)

    @property
    def interval_steps(self) -> int | None:
        """The interval should_save() follows, in steps (None without one, or before "auto" measured a save)."""
        schedule = self._acct.schedule
        if schedule is None:
            return None
        return schedule.interval if schedule.interval != "auto" else schedule.every_steps

    def summary(self) -> RunSummary:
        """The run so far: steps, training wall time, what the saves cost in all and as a share of
        training time, the median step time, and seconds from this manager's creation to the first
        durable save (time_to_first_durable_s)."""
        return self._acct.summary()

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
        self._check_open()
        options = PreemptionOptions(grace_s=grace_s, signals=tuple(signals) if isinstance(signals, (tuple, list)) else signals)
        if not isinstance(state, Mapping):
            raise CheckpointConfigError(f"handle_preemption(state=...) needs the dict you pass to save(), got a {type(state).__name__}")
        if self._preemption is not None:
            self._preemption.stop()
        self._preemption = Preemption(self, state, options, store=self._training_store())
        self._preemption.install()

    # ------------------------------------------------------------------ internals

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= naming.MAX_STEP:
            raise CheckpointConfigError(f"step={step!r} is invalid: pass an int in 0..{naming.MAX_STEP}")

    def _replace_stats(self, job: SaveJob, old: SaveStats, new: SaveStats) -> None:
        """A save's record gained its step fields (SaveAccounting)."""
        with self._lock:
            for i in range(len(self._stats) - 1, -1, -1):
                if self._stats[i] is old:
                    self._stats[i] = new
                    break
            if job.stats is old:
                job.stats = new

    def _training_store(self) -> Any:
        """A store connection for the training thread (several ranks), or None (one rank)."""
        if self.world_size > 1 and self._store is None:
            self._store = self._coord.new_store_client()
        return self._store

    def _agree_interval(self, schedule: SaveSchedule, step: int) -> None:
        """Several ranks, interval="auto": take rank 0's interval for the current period (module docstring)."""
        n = schedule.saves
        if schedule.last_save is None or schedule.adopted_period == n:
            return
        store = self._training_store()
        key = f"auto/{n}"
        if self.rank == 0:
            if schedule.proposed is None:
                return
            value = {"every_steps": schedule.proposed, "from_step": step + 1}
            store.set(key, json.dumps(value))
            if n >= 2:
                try:
                    store.delete_key(f"auto/{n - 2}")
                except Exception:  # noqa: BLE001 - a leftover key costs a few bytes
                    pass
        else:
            if not store.check([key]):
                return
            value = json.loads(store.get(key))
        schedule.adopt(value["every_steps"], value["from_step"])


class StepScope:
    """What mgr.step(step) returns: ``with mgr.step(step):`` also marks the step's end."""

    def __init__(self, manager: LoopHooks, step: int) -> None:
        self._manager, self.step = manager, step

    def __enter__(self) -> "StepScope":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._manager._acct.end(self.step)
            if self._manager._preemption is not None:
                self._manager._preemption.check(self.step)
