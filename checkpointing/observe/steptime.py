"""What saves cost the training loop, measured from step timestamps. Pure logic, no I/O.

A :class:`StepClock` is fed ``time.perf_counter()`` timestamps of step boundaries and of save
events, and turns them into one :class:`SaveCost` per save and a :class:`RunSummary`:

- **stall** (``step_stall_s``): the time the training thread was blocked by the save: from entering
  ``save()`` to its return (this includes any wait for the previous save) plus guard waits before
  the next ``optimizer.step()``.
- **slowdown** (``slowdown_s``): the save's background work (``save()`` return to durable) competes
  with training for CPU, memory bandwidth and PCIe. For every step that overlaps that window, the
  excess of its *net* step time (step time minus the stall inside it) over the baseline, clipped at
  0, summed. A step that overlaps the background work of k saves gives each 1/k of its excess.
- **baseline** (``step_time_s``): the median net time of recent steps during which no save was in
  flight; when there are none, the median of all recent steps (``baseline == "all"``; it then
  includes the slowdown itself, so the slowdown is underestimated).
- **cost** = stall + slowdown: the training time the save cost, the C of :mod:`checkpointing.advice`.

The sum of clipped excesses counts step-time noise above the median too, so on a noisy loop a save
with no real slowdown still shows a small positive one; compare it with the spread of step times.

Intended calls from the manager (all thread-safe; timestamps default to ``time.perf_counter()``)::

    clock = StepClock()
    # 1. step boundaries: explicit, or one boundary() per optimizer.step() pre-hook
    clock.begin_step(step); ...; clock.end_step(step)        # or: clock.boundary()
    # 2. in save(): around the blocking part
    clock.save_issued(step); ...; clock.save_returned(step)
    #    in the guard before the next optimizer.step(), if it waited:
    clock.add_stall(step, guard_wait_s)
    # 3. in the background thread, when the save is durable (committed) or failed:
    clock.save_durable(step, ok=ok)
    #    (if save() itself raises after save_issued: save_durable(step, ok=False) on that path)
    # any time: finished results (each returned once) and the run so far
    for cost in clock.pop_results(): record.update(cost.as_metrics())
    clock.summary()

A save's cost is final once every step that overlaps its background work has ended, so a result
appears at the first ``end_step``/``boundary`` after the save is durable (or at once when the save
becomes durable between steps). Memory is bounded: step times are kept in a rolling window of the
last ``window`` steps, final results in a window of the last ``keep_results`` saves.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time
from typing import Deque, Literal

from checkpointing.errors import CheckpointConfigError

__all__ = ["RunSummary", "SaveCost", "StepClock", "StepSample"]

Baseline = Literal["clean", "all", "none"]


@dataclasses.dataclass(frozen=True)
class SaveCost:
    """What one save cost the training loop. Times in seconds.

    step: the save's step number. ok: False when the save failed (its cost still counts).
    issued_s: when ``save()`` was entered, seconds since the first step began (timeline position).
    step_stall_s: training thread blocked by the save (``save()`` call incl. waiting for the
        previous save, plus guard waits). background_s: ``save()`` return to durable.
    slowdown_s: summed clipped excess of the steps overlapping the background work.
    cost_s: step_stall_s + slowdown_s. steps_overlapped: steps that overlapped the background work.
    step_time_s: the baseline step time used (None before any step ended).
    baseline: "clean" (median of steps with no save in flight), "all" (no such step: median of all
        recent steps) or "none" (no step yet: slowdown is 0).
    interval_s: time from the previous save's ``save()`` entry (or the first step) to this one's.
    overhead_pct: cost_s / interval_s * 100 (None when interval_s is 0), the share of the training
        time of this checkpoint period spent on the checkpoint.
    """

    step: int
    ok: bool
    issued_s: float
    step_stall_s: float
    background_s: float
    slowdown_s: float
    cost_s: float
    steps_overlapped: int
    step_time_s: float | None
    baseline: Baseline
    interval_s: float
    overhead_pct: float | None

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def as_metrics(self) -> dict[str, object]:
        """The fields a metrics record carries (the names ``checkpointing report`` reads)."""
        return {"step_stall_s": self.step_stall_s, "slowdown_s": self.slowdown_s, "cost_s": self.cost_s,
                "overhead_pct": self.overhead_pct, "step_time_s": self.step_time_s}


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The run so far. Times in seconds.

    steps: steps ended. wall_s: first step begin to the last step end (training wall time).
    saves: saves with a final cost; pending: saves issued whose cost is not final yet.
    stall_s, slowdown_s, cost_s: sums over the final saves. overhead_pct: cost_s / wall_s * 100
    (None before any step ended). step_time_s, baseline: the current baseline (see SaveCost).
    time_to_first_durable_s: first step begin to the first successful durable save (None if none).
    """

    steps: int
    wall_s: float
    saves: int
    pending: int
    stall_s: float
    slowdown_s: float
    cost_s: float
    overhead_pct: float | None
    step_time_s: float | None
    baseline: Baseline
    time_to_first_durable_s: float | None

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One ended step. begin_wall: its start as ``time.time()`` (the clock of metrics records'
    ``time``); seconds: its duration; net_s: duration minus the save stall inside it; clean: no
    save was in flight during it."""

    step: int
    begin_wall: float
    seconds: float
    net_s: float
    clean: bool


@dataclasses.dataclass
class _Save:
    step: int
    issued: float
    returned: float | None = None
    durable: float | None = None
    ok: bool = True
    stall: float = 0.0
    interval: float = 0.0
    overlaps: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (net step s, share)
    folded_slowdown: float = 0.0  # excess of overlaps beyond the window, folded with the baseline then
    overlapped: int = 0


class StepClock:
    """Step-time accounting for saves; see the module docstring for the calls and definitions.

    ``window``: how many recent step times to keep (the baseline's sample; >= 1).
    ``keep_results``: how many final save costs to keep for ``pop_results``/``results`` (>= 1).
    Events must arrive in time order per thread; ``save_durable`` may come from another thread.
    """

    def __init__(self, window: int = 1000, keep_results: int = 1000) -> None:
        for name, v in (("window", window), ("keep_results", keep_results)):
            if not isinstance(v, int) or v < 1:
                raise CheckpointConfigError(f"StepClock {name} must be an int >= 1, got {v!r}")
        self.window = window
        self.keep_results = keep_results
        self._lock = threading.Lock()
        self._wall_offset = time.time() - time.perf_counter()
        self._clean: Deque[float] = collections.deque(maxlen=window)
        self._all: Deque[float] = collections.deque(maxlen=window)
        self._samples: Deque[StepSample] = collections.deque(maxlen=window)
        self._results: Deque[SaveCost] = collections.deque(maxlen=keep_results)
        self._unpopped = 0
        self._saves: list[_Save] = []  # issued, cost not final yet
        self._origin: float | None = None  # first step begin
        self._last_end: float | None = None
        self._last_issue: float | None = None
        self._open: tuple[int, float] | None = None  # (step, begin)
        self._open_stall = 0.0
        self._open_dirty = False
        self._steps = 0
        self._final_saves = 0
        self._total_stall = 0.0
        self._total_slowdown = 0.0
        self._first_durable: float | None = None

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: int, t: float | None = None) -> None:
        """A training step begins at ``t`` (perf_counter seconds). Ends an open step first."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            self._begin(step, t)

    def _begin(self, step: int, t: float) -> None:
        if self._open is not None:
            self._end(t)
        if self._origin is None:
            self._origin = t
        self._open = (step, t)
        self._open_stall = 0.0
        self._open_dirty = any(s.durable is None or s.durable > t for s in self._saves)
        self._finalize()

    def end_step(self, step: int | None = None, t: float | None = None) -> None:
        """The open step ends at ``t`` (``step`` is for symmetry and not checked). Without an open
        step this does nothing."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            if self._open is not None:
                self._end(t)
            self._finalize()

    def boundary(self, t: float | None = None) -> None:
        """End the open step and begin the next one at the same instant (one call per step, e.g.
        from an ``optimizer.step()`` pre-hook). Step numbers count up from 0."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            self._begin(self._open[0] + 1 if self._open is not None else self._steps, t)

    def _end(self, t: float) -> None:
        assert self._open is not None
        step, begin = self._open
        self._open = None
        seconds = max(0.0, t - begin)
        net = max(0.0, seconds - self._open_stall)
        windows = [s for s in self._saves if s.returned is not None and s.returned < t and (s.durable is None or s.durable > begin)]
        clean = not self._open_dirty and not windows
        for s in windows:
            s.overlapped += 1
            s.overlaps.append((net, 1.0 / len(windows)))
            if len(s.overlaps) > self.window:  # bounded: fold the oldest with today's baseline
                old_net, share = s.overlaps.pop(0)
                base = self._baseline()[0]
                s.folded_slowdown += share * max(0.0, old_net - base) if base is not None else 0.0
        self._all.append(net)
        if clean:
            self._clean.append(net)
        self._samples.append(StepSample(step, begin + self._wall_offset, seconds, net, clean))
        self._steps += 1
        self._last_end = t

    # ------------------------------------------------------------------ saves

    def save_issued(self, step: int, t: float | None = None) -> None:
        """``save(step, ...)`` was entered at ``t``."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            start = self._last_issue if self._last_issue is not None else (self._origin if self._origin is not None else t)
            self._saves.append(_Save(step=step, issued=t, interval=max(0.0, t - start)))
            self._last_issue = t
            if self._open is not None:
                self._open_dirty = True

    def save_returned(self, step: int, t: float | None = None) -> None:
        """``save(step, ...)`` returned at ``t``: the time since ``save_issued`` is stall."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            s = self._find(step)
            s.returned = t
            s.stall += max(0.0, t - s.issued)
            if self._open is not None:  # the part of the call inside the open step
                self._open_stall += max(0.0, t - max(s.issued, self._open[1]))

    def add_stall(self, step: int, seconds: float) -> None:
        """Add ``seconds`` of blocking caused by save ``step`` (a guard wait) to it and to the open step."""
        if seconds < 0:
            raise CheckpointConfigError(f"stall must be >= 0 seconds, got {seconds!r}")
        with self._lock:
            s = self._find(step, default=None)
            if s is not None:  # a guard runs inside a step that began before the save was durable,
                s.stall += seconds  # so the save cannot be final yet; if it is, only the step gains
            if self._open is not None:
                self._open_stall += seconds

    def save_durable(self, step: int, t: float | None = None, ok: bool = True) -> None:
        """Save ``step``'s background work ended at ``t``: durable (``ok``) or failed."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            s = self._find(step)
            if s.returned is None:
                s.returned = t  # failed inside save(): no background phase
            s.durable = t
            s.ok = ok
            if ok and (self._first_durable is None or t < self._first_durable):
                self._first_durable = t
            self._finalize()

    def _find(self, step: int, default: object = KeyError) -> _Save:
        for s in reversed(self._saves):
            if s.step == step:
                return s
        if default is KeyError:
            raise CheckpointConfigError(f"StepClock: no save of step {step} in flight; call save_issued({step}) first")
        return default  # type: ignore[return-value]

    # ------------------------------------------------------------------ results

    def _baseline(self) -> tuple[float | None, Baseline]:
        if self._clean:
            return statistics.median(self._clean), "clean"
        if self._all:
            return statistics.median(self._all), "all"
        return None, "none"

    def _finalize(self) -> None:
        ready = [s for s in self._saves if s.durable is not None and (self._open is None or self._open[1] >= s.durable)]
        if not ready:
            return
        base, kind = self._baseline()
        for s in ready:
            origin = self._origin if self._origin is not None else s.issued
            self._saves.remove(s)
            slow = s.folded_slowdown
            if base is not None:
                slow += sum(share * max(0.0, net - base) for net, share in s.overlaps)
            cost = s.stall + slow
            self._results.append(SaveCost(
                step=s.step, ok=s.ok, issued_s=s.issued - origin, step_stall_s=s.stall,
                background_s=max(0.0, s.durable - s.returned) if s.returned is not None else 0.0,  # type: ignore[operator]
                slowdown_s=slow, cost_s=cost, steps_overlapped=s.overlapped, step_time_s=base, baseline=kind,
                interval_s=s.interval, overhead_pct=cost / s.interval * 100.0 if s.interval > 0 else None,
            ))
            self._unpopped = min(self._unpopped + 1, self.keep_results)
            self._final_saves += 1
            self._total_stall += s.stall
            self._total_slowdown += slow

    def discard_open(self) -> None:
        """Forget the open step without recording it (the run ends inside it: at ``close()`` the
        time since the last boundary is teardown, not training) and finalize every durable save."""
        with self._lock:
            self._open = None
            self._open_stall = 0.0
            self._finalize()

    def has_results(self) -> bool:
        """Whether ``pop_results`` has something (a cheap check without the lock, for hot paths)."""
        return self._unpopped > 0

    @property
    def steps(self) -> int:
        """Steps ended so far."""
        return self._steps

    def pop_results(self) -> list[SaveCost]:
        """Save costs that became final since the last call, oldest first."""
        with self._lock:
            n, self._unpopped = self._unpopped, 0
            return list(self._results)[len(self._results) - n:] if n else []

    def results(self) -> list[SaveCost]:
        """The last ``keep_results`` final save costs, oldest first."""
        with self._lock:
            return list(self._results)

    def step_samples(self) -> list[StepSample]:
        """The last ``window`` ended steps, oldest first (for ``report.plot(step_times=...)``)."""
        with self._lock:
            return list(self._samples)

    def summary(self) -> RunSummary:
        """Totals over the run so far (final saves only; see ``pending``)."""
        with self._lock:
            base, kind = self._baseline()
            wall = (self._last_end - self._origin) if self._origin is not None and self._last_end is not None else 0.0
            saves, stall, slow = self._final_saves, self._total_stall, self._total_slowdown
            ttfd = None
            if self._first_durable is not None and self._origin is not None:
                ttfd = max(0.0, self._first_durable - self._origin)
            return RunSummary(
                steps=self._steps, wall_s=wall, saves=saves, pending=len(self._saves), stall_s=stall,
                slowdown_s=slow, cost_s=stall + slow, overhead_pct=(stall + slow) / wall * 100.0 if wall > 0 else None,
                step_time_s=base, baseline=kind, time_to_first_durable_s=ttfd,
            )
