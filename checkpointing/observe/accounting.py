"""What saves cost the training loop, measured in the running manager (orchestration).

Glue between CheckpointManager and the pure steptime.StepClock / schedule.SaveSchedule:

- **Step marks.** By default the optimizer step pre-hook the manager already has marks one step
  boundary per ``optimizer.step()`` of the first optimizer seen (a second optimizer in the same
  loop, a GAN's discriminator, must not count twice). ``mgr.step(step)`` marks steps explicitly
  (loops without an optimizer, or several optimizers); from its first call on the hook marks none.
- **Save events.** save() entry and return, guard waits, and the background's "durable" (the
  SaveStats is made: committed locally, and uploaded when there is a remote tier).
- **Records.** A save's SaveStats goes into ``mgr.stats()`` when it is made; its step fields are
  filled in once its cost is final (after the steps that overlapped its background work), and
  only then is the complete record appended to metrics.jsonl and handed to ``on_metrics``: one
  line per save, as before, now with ``step_stall_s``, ``slowdown_s``, ``cost_s``,
  ``overhead_pct`` and ``step_time_s``. When no step is open (no marks, or between an explicit
  end and begin) the cost is final at once and the line is written before ``handle.wait()``
  returns, as it always was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from torch.optim import Optimizer

from checkpointing.errors import CheckpointConfigError
from checkpointing.observe.metrics import MetricsSink, SaveStats
from checkpointing.plan.schedule import SaveSchedule
from checkpointing.observe.steptime import RunSummary, SaveCost, StepClock

log = logging.getLogger("checkpointing")


Replace = Callable[[SaveStats, SaveStats], None]  # (old, new): a save's SaveStats gained its step fields


class SaveAccounting:
    """Step-time accounting and the records of one manager. Thread-safe where the docstrings say so."""

    def __init__(self, metrics_path: os.PathLike | str, *, on_metrics: Callable[[dict[str, Any]], Any] | None,
                 schedule: SaveSchedule | None) -> None:
        self.clock = StepClock()
        self.sink = MetricsSink(metrics_path, on_metrics)
        self.schedule = schedule
        self._t_created = time.perf_counter()
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[SaveStats, Replace]]] = {}  # step -> durable saves awaiting their cost
        self._first_durable_s: float | None = None
        self._explicit = False  # mgr.step() was called: the optimizer hook marks nothing
        self._optimizer: weakref.ref | None = None
        self.last_step: int | None = None  # the newest step known to have ended (emergency saves)
        self._open_step: int | None = None  # mgr.step(): the step begun and not ended

    # ------------------------------------------------------------------ step marks (training thread)

    def optimizer_step(self, optimizer: Optimizer) -> None:
        """From the optimizer step pre-hook: a boundary, for the first optimizer seen only."""
        if self._explicit:
            return
        ref = self._optimizer
        if ref is None or ref() is None:
            self._optimizer = weakref.ref(optimizer)
        elif ref() is not optimizer:
            return
        self.clock.boundary()
        if self.clock.has_results():
            self._drain(now=False)

    def begin(self, step: int) -> None:
        """mgr.step(step): step `step` begins (the step begun before it, if any, ends)."""
        self._explicit = True
        if self._open_step is not None:
            self.last_step = self._open_step
        self._open_step = step
        self.clock.begin_step(step)
        if self.clock.has_results():
            self._drain(now=False)

    def end(self, step: int) -> None:
        """The end of ``with mgr.step(step):``."""
        self.clock.end_step(step)
        self._open_step = None
        self.last_step = step
        if self.clock.has_results():
            self._drain(now=False)

    # ------------------------------------------------------------------ save events

    def issued(self, step: int, t: float) -> None:
        self.clock.save_issued(step, t)
        if self.schedule is not None:
            self.schedule.saved(step)

    def returned(self, step: int, t: float) -> None:
        try:
            self.clock.save_returned(step, t)
        except CheckpointConfigError:  # it failed, and was accounted, before save() returned
            pass

    def stall(self, step: int, seconds: float) -> None:
        if seconds > 0:
            self.clock.add_stall(step, seconds)

    def durable(self, stats: SaveStats, replace: Replace) -> SaveStats:
        """On a background thread, when a save's SaveStats is made; returns it (the run's first
        successful save gains time_to_first_durable_s). Once its cost is final (see settle), which
        may be at the next step mark, `replace(old, new)` is called on whichever thread finalizes
        it, with the SaveStats returned here and the one with the step fields."""
        with self._lock:
            if stats.ok and self._first_durable_s is None:
                self._first_durable_s = time.perf_counter() - self._t_created
                stats = dataclasses.replace(stats, time_to_first_durable_s=self._first_durable_s)
            self._pending.setdefault(stats.step, []).append((stats, replace))
        if self.schedule is not None and not stats.committed:
            self.schedule.failed()
        return stats

    def amend(self, old: SaveStats, new: SaveStats) -> bool:
        """A durable save's record changed (a later try of its failed upload ended): when its cost is not final yet,
        `new` is what gets it and is written then (True); else False (its record is written: the caller writes `new`)."""
        with self._lock:
            waiting = self._pending.get(old.step, [])
            for i, (stats, replace) in enumerate(waiting):
                if stats is old:
                    waiting[i] = (new, replace)
                    return True
        return False

    def settle(self, step: int, ok: bool) -> None:
        """After `durable` made the SaveStats visible: its background work is over (background thread)."""
        self.clock.save_durable(step, ok=ok)
        self._drain(now=True)

    def _drain(self, *, now: bool) -> None:
        for cost in self.clock.pop_results():
            with self._lock:
                waiting = self._pending.get(cost.step)
                if not waiting:
                    continue  # not recorded (a save that failed inside save(): raised there)
                stats, replace = waiting.pop(0)
                if not waiting:
                    del self._pending[cost.step]
            full = self._with_cost(stats, cost)
            if full is not stats:
                replace(stats, full)
            self.sink.emit(full.as_dict(), now=now)

    def _with_cost(self, stats: SaveStats, cost: SaveCost) -> SaveStats:
        if cost.baseline == "none":  # no step was ever marked: nothing to say about steps
            return stats
        full = dataclasses.replace(stats, **cost.as_metrics())  # type: ignore[arg-type]
        if self.schedule is not None and stats.committed:  # (an upload that failed does not change what the loop paid)
            # the C of checkpointing.advice, as `checkpointing report` computes it
            c = max(0.0, cost.step_stall_s - stats.wait_prev_s) + cost.slowdown_s
            before = self.schedule.every_steps
            proposed = self.schedule.observe(c, cost.step_time_s)
            a = self.schedule.advice
            if proposed is not None and proposed != before and a is not None:
                log.info("checkpointing: interval='auto': save cost %.3f s, MTBF %.0f s -> Daly interval %.1f s = every %d steps "
                         "of %.3f s", a.cost_s, a.mtbf_s, a.daly_s, proposed, a.step_time_s)
        return full

    # ------------------------------------------------------------------ the run

    def summary(self) -> RunSummary:
        """The run so far; time_to_first_durable_s counts from the manager's creation."""
        s = self.clock.summary()
        return dataclasses.replace(s, time_to_first_durable_s=self._ttfd())

    def _ttfd(self) -> float | None:
        with self._lock:
            return self._first_durable_s

    def close(self) -> None:
        """Every save is durable: finalize their costs (the open step is teardown, not a step),
        write what is left, stop the sink. Logs the run's summary."""
        self.clock.discard_open()
        self._drain(now=True)
        with self._lock:
            left = [item for items in self._pending.values() for item in items]
            self._pending.clear()
        for stats, _ in left:  # not durable (close() after a failed wait): write what is known
            self.sink.emit(stats.as_dict(), now=True)
        self.sink.close()
        s = self.summary()
        if s.steps and s.saves:
            log.info("checkpointing: run: %d steps in %.1f s, %d saves cost %.3f s (stall %.3f s + slowdown %.3f s) = %s of "
                     "training time; first durable save %s after start", s.steps, s.wall_s, s.saves, s.cost_s, s.stall_s,
                     s.slowdown_s, "n/a" if s.overhead_pct is None else f"{s.overhead_pct:.2f}%",
                     "none" if s.time_to_first_durable_s is None else f"{s.time_to_first_durable_s:.2f} s")
