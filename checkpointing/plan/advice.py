"""How often to checkpoint: Young's and Daly's optimum intervals, and what an interval costs.

Pure functions, no I/O. Every time is in **seconds** of wall-clock training time:

- ``cost_s`` (C): the training time one save costs, i.e. the time the loop is blocked by it (stall)
  plus the slowdown of the steps that run while its background work is in flight. Measure it with
  :mod:`checkpointing.steptime` or read it from ``checkpointing report``.
- ``mtbf_s`` (M): the mean time between failures of the whole job (for N nodes that each fail
  independently with MTBF m, the job's MTBF is about m / N).
- ``interval_s`` (tau): the compute time between the end of one save and the start of the next,
  i.e. the useful work a failure can destroy. Saves happen every tau + C seconds of wall time.
- ``restart_s`` (R): the time from a failure to training running again (rescheduling plus
  restore); it does not change the optimum interval, only the expected loss.

The model (Young 1974; Daly 2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22) assumes failures arrive as a Poisson process with mean M. Under it the
expected wall time to finish T_s seconds of work is::

    T_w(tau) = M * exp(R / M) * (exp((tau + C) / M) - 1) * T_s / tau

and the fraction of wall time that is not useful work is ``1 - T_s / T_w``
(:func:`expected_lost_fraction`). Young's first-order minimiser is ``sqrt(2 C M)``; Daly's higher
order estimate is closer to the true minimiser when C is not small against M.
"""

from __future__ import annotations

import dataclasses
import math

from checkpointing.errors import CheckpointConfigError

__all__ = [
    "IntervalAdvice",
    "advise",
    "daly_interval",
    "expected_lost_fraction",
    "interval_to_steps",
    "young_interval",
]


def _check(cost_s: float, mtbf_s: float) -> None:
    if not isinstance(mtbf_s, (int, float)) or not math.isfinite(mtbf_s) or mtbf_s <= 0:
        raise CheckpointConfigError(
            f"mean time between failures must be a positive, finite number of seconds, got {mtbf_s!r}; "
            "estimate it from your cluster's failure log (e.g. 24 h = 86400 s)"
        )
    if not isinstance(cost_s, (int, float)) or not math.isfinite(cost_s) or cost_s < 0:
        raise CheckpointConfigError(
            f"checkpoint cost must be a finite number of seconds >= 0, got {cost_s!r}; "
            "use the stall (+ slowdown) that `checkpointing report` measures"
        )


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between saves, in seconds: ``sqrt(2 * C * M)``.

    First order in C / M: good when a save costs much less than the MTBF. Raises
    :class:`CheckpointConfigError` for ``mtbf_s <= 0`` or ``cost_s < 0``.
    """
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between saves, in seconds.

    For C < 2M::

        tau = sqrt(2 C M) * (1 + (1/3) * sqrt(C / (2M)) + (1/9) * (C / (2M))) - C

    and tau = M otherwise (a save costs so much that saving once per expected failure is best).
    Always at most Young's interval for C < 2M (their difference is M x^2 (2x/9 - 4/3) with
    x = sqrt(C / 2M)); increasing in M and in C within that range. At C = 2M the formula drops
    from M to 8M/9: Daly's piecewise definition is discontinuous there, which only matters when a
    save costs as much as two MTBFs. Raises :class:`CheckpointConfigError` for bad inputs.
    """
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return float(mtbf_s)
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def expected_lost_fraction(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction (0..1) of wall time that is not useful work when saving every ``interval_s``.

    Under the Poisson failure model of the module docstring::

        lost = 1 - tau / (M * exp(R / M) * (exp((tau + C) / M) - 1))

    which covers the saves themselves, the work redone after each failure and the restarts. For
    small C, tau and R against M it is about ``C / tau + (tau + C) / (2 M) + R / M`` (the quantity
    Young minimises). ``interval_s`` must be > 0 and ``restart_s`` >= 0.
    """
    _check(cost_s, mtbf_s)
    if not isinstance(interval_s, (int, float)) or not math.isfinite(interval_s) or interval_s <= 0:
        raise CheckpointConfigError(f"checkpoint interval must be a positive number of seconds, got {interval_s!r}")
    if not isinstance(restart_s, (int, float)) or not math.isfinite(restart_s) or restart_s < 0:
        raise CheckpointConfigError(f"restart time must be a finite number of seconds >= 0, got {restart_s!r}")
    m = float(mtbf_s)
    # log of the wall time per unit of work, computed in logs so huge (tau + C) / M cannot overflow
    x = (interval_s + cost_s) / m
    log_growth = x + math.log1p(-math.exp(-x)) if x > 30 else math.log(math.expm1(x))
    log_ratio = math.log(m) + restart_s / m + log_growth - math.log(interval_s)
    return -math.expm1(-log_ratio) if log_ratio > 0 else 0.0


def interval_to_steps(interval_s: float, step_time_s: float) -> int:
    """Whole training steps closest to ``interval_s`` given the median ``step_time_s`` (>= 1).

    The expected loss is flat near its optimum, so rounding to the nearest step costs nothing
    measurable. Both arguments are in seconds; ``step_time_s`` must be > 0.
    """
    if not isinstance(step_time_s, (int, float)) or not math.isfinite(step_time_s) or step_time_s <= 0:
        raise CheckpointConfigError(f"step time must be a positive number of seconds, got {step_time_s!r}")
    if not isinstance(interval_s, (int, float)) or not math.isfinite(interval_s) or interval_s < 0:
        raise CheckpointConfigError(f"checkpoint interval must be a finite number of seconds >= 0, got {interval_s!r}")
    return max(1, round(interval_s / step_time_s))


@dataclasses.dataclass(frozen=True)
class IntervalAdvice:
    """A recommendation. Seconds unless named otherwise.

    cost_s, mtbf_s, restart_s: the inputs. young_s, daly_s: the two optimum intervals (compute time
    between saves). recommended_s: ``daly_s``. lost_fraction: expected lost fraction of wall time
    at ``recommended_s`` (0..1). step_time_s: the median step time given, or None.
    every_steps: ``recommended_s`` in whole steps (None without a step time).
    """

    cost_s: float
    mtbf_s: float
    restart_s: float
    young_s: float
    daly_s: float
    recommended_s: float
    lost_fraction: float | None
    step_time_s: float | None
    every_steps: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


def advise(cost_s: float, mtbf_s: float, step_time_s: float | None = None, restart_s: float = 0.0) -> IntervalAdvice:
    """Young's and Daly's intervals for a measured cost, with the expected loss and step count.

    ``lost_fraction`` is None when the cost is 0 (the optimum is then to save continuously: any
    positive interval is a choice, not an optimum).
    """
    young = young_interval(cost_s, mtbf_s)
    daly = daly_interval(cost_s, mtbf_s)
    lost = expected_lost_fraction(daly, cost_s, mtbf_s, restart_s) if daly > 0 else None
    steps = interval_to_steps(daly, step_time_s) if step_time_s is not None else None
    return IntervalAdvice(
        cost_s=float(cost_s), mtbf_s=float(mtbf_s), restart_s=float(restart_s), young_s=young, daly_s=daly,
        recommended_s=daly, lost_fraction=lost, step_time_s=step_time_s, every_steps=steps,
    )
