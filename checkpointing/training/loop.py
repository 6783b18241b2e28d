"""What the training loop calls besides save() and restore(): step marks, should_save, preemption
handling, the run's summary (orchestration).

`TrainingLoop` is the manager's helper for these: CheckpointManager holds one and forwards its
public methods to it (step, should_save, interval_steps, summary, handle_preemption), and tells it
of the safe points it sees (save(), the optimizer step pre-hook, close()). The measuring is in
observe/accounting.py (glue) and observe/steptime.py / plan/schedule.py (pure).

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
from typing import Any, Callable, Mapping

from torch.optim import Optimizer

from checkpointing.dist import keys
from checkpointing.dist.store import delete_keys
from checkpointing.dist.types import Store
from checkpointing.errors import CheckpointConfigError
from checkpointing.format import naming
from checkpointing.observe.accounting import SaveAccounting
from checkpointing.observe.steptime import RunSummary
from checkpointing.options import PreemptionOptions
from checkpointing.plan.schedule import SaveSchedule
from checkpointing.training.preemption import Preemption, SavePath


class TrainingLoop:
    """The training loop's side of one manager (training thread only).

    `saves` is the manager's save path (for an emergency save); `new_store` opens a connection to
    the job's store for this thread (None with one rank), made when first needed.
    """

    def __init__(self, acct: SaveAccounting, saves: SavePath, *, rank: int, world_size: int,
                 new_store: Callable[[], Store | None]) -> None:
        self._acct, self._saves = acct, saves
        self._rank, self._world_size = rank, world_size
        self._new_store = new_store
        self._store: Store | None = None
        self.preemption: Preemption | None = None
        self.marks_steps = False  # should_save()/step() are called: safe points for an emergency save

    def step(self, step: int) -> StepScope:
        """Mark the beginning of training step `step` (CheckpointManager.step)."""
        naming.check_step(step)
        self.marks_steps = True
        self._acct.begin(step)
        self.at_safe_point(self._acct.last_step)
        return StepScope(self, step)

    def should_save(self, step: int) -> bool:
        """Whether to save `step` now, by the manager's `interval` (CheckpointManager.should_save)."""
        naming.check_step(step)
        schedule = self._acct.schedule
        if schedule is None:
            raise CheckpointConfigError("should_save() needs a schedule: create the manager with interval=N (every N steps) "
                                        "or interval='auto' with mtbf_s=...")
        self._acct.last_step = step
        self.marks_steps = True
        self.at_safe_point(step)
        if schedule.interval == "auto" and self._world_size > 1:
            self._agree_interval(schedule, step)
        due = schedule.due(step)
        return due and (self.preemption is None or self.preemption.saved != step)  # an emergency save saved it just now

    @property
    def interval_steps(self) -> int | None:
        """The interval should_save() follows, in steps (None without one, or before "auto" measured a save)."""
        schedule = self._acct.schedule
        if schedule is None:
            return None
        return schedule.interval if schedule.interval != "auto" else schedule.every_steps

    def summary(self) -> RunSummary:
        return self._acct.summary()

    def handle_preemption(self, state: Mapping[str, Any], *, grace_s: float, signals: tuple[int, ...] | list[int]) -> None:
        """Install the handling of preemption signals (CheckpointManager.handle_preemption)."""
        options = PreemptionOptions(grace_s=grace_s, signals=tuple(signals) if isinstance(signals, (tuple, list)) else signals)
        if not isinstance(state, Mapping):
            raise CheckpointConfigError(f"handle_preemption(state=...) needs the dict you pass to save(), got a {type(state).__name__}")
        if self.preemption is not None:
            self.preemption.stop()
        self.preemption = Preemption(self._saves, state, options, rank=self._rank, world_size=self._world_size,
                                     store=self._training_store())
        self.preemption.install()

    # ------------------------------------------------------------------ what the manager reports

    def at_safe_point(self, step: int | None) -> None:
        """The state is that after step `step` (save(), a step mark): where an emergency save may happen."""
        if self.preemption is not None:
            self.preemption.check(step)

    def step_ended(self, step: int) -> None:
        """The end of ``with mgr.step(step):``."""
        self._acct.end(step)
        self.at_safe_point(step)

    def optimizer_step(self, optimizer: Optimizer) -> None:
        """The optimizer step pre-hook (after the guard): a step boundary, and for a loop that
        marks no step the point where a preemption finishes the in-flight save."""
        self._acct.optimizer_step(optimizer)
        if self.preemption is not None and not self.marks_steps:
            self.preemption.at_optimizer_step()

    def at_close(self) -> float | None:
        """close() begins: a pending signal's emergency save (one rank); returns how long close()
        may wait for the saves in flight (None: no limit; a stop was requested: its grace)."""
        preemption = self.preemption
        if preemption is None:
            return None
        preemption.at_close(self._acct.last_step)
        return preemption.remaining() if preemption.requested and not preemption.went_on else None

    def stop(self) -> None:
        """close() ends: the signal handlers go back."""
        if self.preemption is not None:
            self.preemption.stop()

    # ------------------------------------------------------------------ internals

    def _training_store(self) -> Store | None:
        """A store connection for the training thread (several ranks), or None (one rank)."""
        if self._world_size > 1 and self._store is None:
            self._store = self._new_store()
        return self._store

    def _agree_interval(self, schedule: SaveSchedule, step: int) -> None:
        """Several ranks, interval="auto": take rank 0's interval for the current period (module docstring)."""
        n = schedule.saves
        if schedule.last_save is None or schedule.adopted_period == n:
            return
        store = self._training_store()
        assert store is not None
        key = keys.auto_interval(n)
        if self._rank == 0:
            if schedule.proposed is None:
                return
            value = {"every_steps": schedule.proposed, "from_step": step + 1}
            store.set(key, json.dumps(value))
            if n >= 2:
                delete_keys(store, [keys.auto_interval(n - 2)])
        else:
            if not store.check([key]):
                return
            value = json.loads(store.get(key))
        schedule.adopt(value["every_steps"], value["from_step"])


class StepScope:
    """What mgr.step(step) returns: ``with mgr.step(step):`` also marks the step's end."""

    def __init__(self, loop: TrainingLoop, step: int) -> None:
        self._loop, self.step = loop, step

    def __enter__(self) -> StepScope:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._loop.step_ended(self.step)
