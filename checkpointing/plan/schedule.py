"""When to save: every N steps, or Daly's interval from the measured cost of saves. Pure logic.

`SaveSchedule` answers `due(step)` for `CheckpointManager.should_save`. With a whole number N it
is ``step % N == 0``. With ``"auto"`` it turns the measured cost of saves (stall without waiting
for the previous save, plus slowdown: the C of checkpointing.advice, as `checkpointing report`
computes it) and the job's MTBF into Daly's interval, and that into steps of the median step time:

- before any save in this run: due at once (the first opportunity; it also gives a measurement);
- after a save whose cost is not measured yet: not due (one rank: due again if it failed);
- a save committed locally is measured even when its upload failed (the loop paid for it all the same);
- then: due when ``step - last_save >= every_steps``, ``every_steps`` recomputed at each measured
  save from the median of the last `window` costs (the interval is flat near its optimum, so the
  median's robustness matters more than following every change).

Several ranks must take the same decisions: `adopt(every_steps, from_step)` installs a value
that every rank received (checkpointing.accounting distributes rank 0's), effective from a step
that no rank has passed; `observe` then only proposes.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Deque, Literal

from checkpointing.plan import advice

Interval = int | Literal["auto"]


@dataclasses.dataclass
class SaveSchedule:
    """Decisions of `should_save`; see the module docstring. Times in seconds."""

    interval: Interval
    mtbf_s: float | None = None
    window: int = 15
    follow: bool = True  # adopt observed intervals at once (one rank); False: wait for adopt()
    last_save: int | None = None
    every_steps: int | None = None  # "auto": the interval in steps in use (None before a measurement)
    from_step: int = 0  # "auto": every_steps applies to decisions for steps >= from_step
    proposed: int | None = None  # "auto": the newest interval computed here (what rank 0 publishes)
    saves: int = 0  # saves issued in this run: the period a value is adopted for (several ranks)
    adopted_period: int | None = None
    advice: advice.IntervalAdvice | None = None  # the newest computation
    _costs: Deque[float] = dataclasses.field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self._costs = collections.deque(self._costs, maxlen=self.window)

    def due(self, step: int) -> bool:
        if self.interval != "auto":
            return step % self.interval == 0
        if self.last_save is None:
            return True
        if self.every_steps is None or (not self.follow and self.adopted_period != self.saves):
            return False  # not measured yet; or (following rank 0) no value for this period yet
        return step >= max(self.last_save + self.every_steps, self.from_step)

    def saved(self, step: int) -> None:
        """A save of `step` was issued (by should_save's advice or not). Not following: the next
        decisions wait for a value adopted for the new period."""
        self.last_save = step
        self.saves += 1

    def failed(self) -> None:
        """A save was not committed. Before any measured interval (one rank), the next opportunity is
        due again: waiting for a measurement of a save that failed would never save again."""
        if self.interval == "auto" and self.follow and self.every_steps is None:
            self.last_save = None

    def observe(self, cost_s: float, step_time_s: float | None) -> int | None:
        """A save's measured cost and the current median step time; returns the proposed interval
        in steps (None while no step time is known), adopted at once when `follow`."""
        if self.interval != "auto" or self.mtbf_s is None:
            return None
        self._costs.append(max(0.0, cost_s))
        if step_time_s is None or step_time_s <= 0:
            return None
        self.advice = advice.advise(statistics.median(self._costs), self.mtbf_s, step_time_s=step_time_s)
        self.proposed = self.advice.every_steps
        if self.follow:
            self.adopt(self.proposed, 0)  # type: ignore[arg-type]
        return self.proposed

    def adopt(self, every_steps: int, from_step: int) -> None:
        """Use `every_steps` for decisions about steps >= `from_step`, in the current period."""
        self.every_steps = max(1, int(every_steps))
        self.from_step = from_step
        self.adopted_period = self.saves
