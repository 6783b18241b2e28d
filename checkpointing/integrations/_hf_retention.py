"""TrainingArguments.save_total_limit as a retention policy of the manager (layer: integrations; no transformers import)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from checkpointing.plan.retention import RetentionPolicy, StepInfo


@dataclasses.dataclass(frozen=True)
class SaveTotalLimit(RetentionPolicy):
    """TrainingArguments.save_total_limit as a retention policy: the newest step and the best one
    (by `metric`, strictly better than every earlier step, as the Trainer tracks it) are always kept,
    and the newest others up to `limit` steps in all."""

    limit: int
    metric: str | None = None
    greater_is_better: bool = False

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset() if self.metric is None else frozenset((self.metric,))

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        ordered = sorted({s.step: s for s in steps}.values(), key=lambda s: s.step)
        if not ordered:
            return frozenset()
        protected = {ordered[-1].step}
        best: tuple[int, float] | None = None
        for s in ordered if self.metric is not None else ():
            v = s.metrics.get(self.metric)  # type: ignore[arg-type]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                if best is None or (v > best[1] if self.greater_is_better else v < best[1]):
                    best = (s.step, float(v))
        if best is not None:
            protected.add(best[0])
        others = [s.step for s in ordered if s.step not in protected]
        room = max(self.limit, len(protected)) - len(protected)
        return frozenset(protected | set(others[max(0, len(others) - room):] if room else ()))
