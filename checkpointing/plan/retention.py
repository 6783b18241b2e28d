"""Retention policies: which committed steps a tier keeps, and tier states (pure).

A policy is a small frozen value that answers one question, `kept(steps)`: of these committed
steps (each a `StepInfo`: its number and the metrics save() recorded with it), which does it keep?
The policies compose by union: `KeepLatest(2) | KeepEvery(1000)` keeps a step that either keeps.

- `KeepLatest(n)`: the newest n steps (what `keep_local=n` means).
- `KeepEvery(n)`: every step whose number is a multiple of n (milestones).
- `KeepBest(n, metric, mode="min")`: the n steps with the lowest ("min") or highest ("max") value of
  `metric`; a step without it (or with NaN) is never among the best; of equal values the newer wins.
- `KeepSteps(steps)`: exactly these steps.

`steps_to_delete` adds the rules every tier follows whatever its policy: the newest committed
step is always kept (a run must be able to resume from its last checkpoint), and so is every
step the caller protects (a save or an upload in flight, the step just committed).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Collection, Iterable, Literal, Mapping, Sequence

from checkpointing.errors import CheckpointConfigError

LOCAL, REMOTE, BOTH = "local", "remote", "local+remote"


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A committed step as retention sees it: its number and the metrics save() recorded with it."""

    step: int
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", types.MappingProxyType(dict(self.metrics)))


class RetentionPolicy:
    """Which committed steps a tier keeps. Subclasses are frozen dataclasses; `a | b` is their union."""

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        """The step numbers this policy keeps, of `steps` (in any order)."""
        raise NotImplementedError

    @property
    def metric_names(self) -> frozenset[str]:
        """The metrics this policy reads (retention reads the steps' metrics only when there are some)."""
        return frozenset()

    def __or__(self, other: object) -> "KeepAny":
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return KeepAny((self, other))


def _whole(value: object, what: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise CheckpointConfigError(f"{what}={value!r} is invalid: pass a whole number >= {lo}")
    return value


@dataclasses.dataclass(frozen=True)
class KeepLatest(RetentionPolicy):
    """The newest `n` steps."""

    n: int

    def __post_init__(self) -> None:
        _whole(self.n, "KeepLatest(n)", 1)

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        return frozenset(sorted({s.step for s in steps})[-self.n:])


@dataclasses.dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Every step whose number is a multiple of `n` (step 0 included)."""

    n: int

    def __post_init__(self) -> None:
        _whole(self.n, "KeepEvery(n)", 1)

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        return frozenset(s.step for s in steps if s.step % self.n == 0)


@dataclasses.dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """The `n` steps with the best value of `metric` (passed as save(..., metrics={metric: value})):
    the lowest with mode="min", the highest with mode="max". Steps without the metric, or with a
    NaN, are never among the best; between equal values the newer step wins."""

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _whole(self.n, "KeepBest(n)", 1)
        if not isinstance(self.metric, str) or not self.metric:
            raise CheckpointConfigError(f"KeepBest(metric={self.metric!r}) is invalid: pass the name of a metric given to save(..., metrics=...)")
        if self.mode not in ("min", "max"):
            raise CheckpointConfigError(f"KeepBest(mode={self.mode!r}) is invalid: use 'min' (lower is better, a loss) or 'max' (an accuracy)")

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset((self.metric,))

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        scored: dict[int, float] = {}
        for s in steps:
            v = s.metrics.get(self.metric)
            if isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and not math.isnan(v):
                scored[s.step] = v if self.mode == "min" else -v
        ranked = sorted(scored, key=lambda step: (scored[step], -step))  # best first; of equals, newer first
        return frozenset(ranked[: self.n])


@dataclasses.dataclass(frozen=True)
class KeepSteps(RetentionPolicy):
    """Exactly the steps named (those that are committed)."""

    steps: Iterable[int]  # any collection of step numbers; kept as a frozenset

    def __post_init__(self) -> None:
        steps = self.steps
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise CheckpointConfigError(f"KeepSteps({steps!r}) is invalid: pass a collection of step numbers, e.g. KeepSteps([1000, 5000])")
        object.__setattr__(self, "steps", frozenset(_whole(s, "KeepSteps step", 0) for s in steps))

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        return frozenset(s.step for s in steps if s.step in self.steps)

    def __repr__(self) -> str:
        return f"KeepSteps({sorted(self.steps)})"


@dataclasses.dataclass(frozen=True)
class KeepAny(RetentionPolicy):
    """The union of `policies`: a step is kept if any of them keeps it (written `a | b | ...`)."""

    policies: tuple[RetentionPolicy, ...]

    def __post_init__(self) -> None:
        flat: list[RetentionPolicy] = []
        for p in self.policies:
            if not isinstance(p, RetentionPolicy):
                raise CheckpointConfigError(f"KeepAny: {p!r} is not a retention policy (KeepLatest, KeepEvery, KeepBest, KeepSteps)")
            flat.extend(p.policies if isinstance(p, KeepAny) else (p,))
        object.__setattr__(self, "policies", tuple(dict.fromkeys(flat)))

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset().union(*(p.metric_names for p in self.policies))

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        return frozenset().union(*(p.kept(steps) for p in self.policies))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies)) if self.policies else "KeepAny(())"


def as_policy(keep: int | RetentionPolicy | None) -> RetentionPolicy | None:
    """A tier's retention as a policy: a whole number n means KeepLatest(n); None keeps every step."""
    if keep is None or isinstance(keep, RetentionPolicy):
        return keep
    return KeepLatest(keep)


def steps_to_delete(committed: Iterable[int | StepInfo], keep: int | RetentionPolicy, *,
                    protect: int | Collection[int] | None = None) -> list[int]:
    """The committed steps to retire (oldest first): those `keep` (a policy, or n for the newest n)
    does not keep, except the newest committed step and those in `protect`, which always stay."""
    policy = as_policy(keep)
    assert policy is not None
    infos = [c if isinstance(c, StepInfo) else StepInfo(c) for c in committed]
    if not infos:
        return []
    kept = set(policy.kept(infos))
    kept.add(max(s.step for s in infos))
    kept |= set() if protect is None else {protect} if isinstance(protect, int) else set(protect)
    return sorted({s.step for s in infos} - kept)


def tier_states(local: Collection[int], remote: Collection[int] | None) -> dict[int, str]:
    """Each committed step -> where it is durable: 'local', 'local+remote' or 'remote' (ascending steps)."""
    remote = remote or ()
    both = set(local) | set(remote)
    return {s: BOTH if s in local and s in remote else LOCAL if s in local else REMOTE for s in sorted(both)}
