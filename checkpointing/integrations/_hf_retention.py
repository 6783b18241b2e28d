"""TrainingArguments.save_total_limit as a retention policy of the manager (layer: integrations; no transformers import)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from checkpointing.plan.retention import RetentionPolicy, StepInfo


BEST_STEP = "trainer_best_checkpoint_step"  # saved with each step: the step of the Trainer's best_model_checkpoint, -1 if none


@dataclasses.dataclass(frozen=True)
class SaveTotalLimit(RetentionPolicy):
    """TrainingArguments.save_total_limit as a retention policy: the newest step and the best one are always
    kept, and the newest others up to `limit` steps in all. The best is the Trainer's own (its
    best_model_checkpoint, which the newest step records as BEST_STEP: it may be older than a step with a better
    metric that was evaluated but not saved); for steps saved without it, the best by `metric` among the steps
    (strictly better than every earlier one, as the Trainer tracks it)."""

    limit: int
    metric: str | None = None
    greater_is_better: bool = False

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset((BEST_STEP,))

    def kept(self, steps: Sequence[StepInfo]) -> frozenset[int]:
        ordered = sorted({s.step: s for s in steps}.values(), key=lambda s: s.step)
        if not ordered:
            return frozenset()
        protected = {ordered[-1].step}
        recorded = ordered[-1].metrics.get(BEST_STEP)
        best = self._best_by_metric(ordered) if recorded is None else (int(recorded) if recorded >= 0 else None)
        if best is not None and any(s.step == best for s in ordered):
            protected.add(best)
        others = [s.step for s in ordered if s.step not in protected]
        room = max(self.limit, len(protected)) - len(protected)
        return frozenset(protected | set(others[max(0, len(others) - room):] if room else ()))

    def _best_by_metric(self, ordered: Sequence[StepInfo]) -> int | None:
        best: tuple[int, float] | None = None
        for s in ordered if self.metric is not None else ():
            v = s.metrics.get(self.metric)  # type: ignore[arg-type]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                if best is None or (v > best[1] if self.greater_is_better else v < best[1]):
                    best = (s.step, float(v))
        return None if best is None else best[0]
