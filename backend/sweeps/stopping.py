"""The median stopping rule: which running trial of a sweep to stop early (pure, no database).

From Golovin et al., "Google Vizier: A Service for Black-Box Optimization", KDD 2017,
section 3.2.2 (automated early stopping): a trial is stopped at step `s` if its best
objective so far is strictly worse than the median of the other trials' running averages
of the objective up to step `s`. Here the step is the epoch: a trial's curve is its
objective metric at each epoch end (`val_loss`, `val_accuracy`, ...).

For a running trial whose newest epoch is `e`: its best value over epochs <= `e` is
compared with the median, over every other trial (running or ended) that has reported
epoch `e`, of that trial's mean over its epochs <= `e`. It is stopped when it is worse
(greater when minimising, less when maximising) and

- it has reported at least `min_epochs` epochs (default 2: no trial is judged on its first
  epoch alone), and
- at least `min_trials` other trials have reported epoch `e` (default 3: a median of fewer
  says little).
"""

import statistics
from dataclasses import dataclass

DEFAULT_MIN_TRIALS = 3
DEFAULT_MIN_EPOCHS = 2

Curve = dict[int, float]
"""A trial's objective at each epoch it reported (epoch -> value)."""


@dataclass(frozen=True)
class Verdict:
    """A trial to stop: its best value by `epoch`, the median it is worse than, and how
    many other trials' running averages that median is of."""

    epoch: int
    best: float
    median: float
    others: int

    def reason(self, metric: str, goal: str) -> str:
        """The cancellation's reason, naming the rule and the figures."""
        side = "above" if goal == "min" else "below"
        return (
            f"stopped early by the median stopping rule (Golovin et al., Google Vizier, KDD "
            f"2017): best {metric} {self.best:.6g} by epoch {self.epoch} is {side} the median "
            f"{self.median:.6g} of {self.others} other trials' running averages at that epoch "
            f"(goal: {goal})"
        )


def running_average(curve: Curve, epoch: int) -> float:
    """The mean of the curve over its epochs up to `epoch`."""
    return statistics.fmean(v for e, v in curve.items() if e <= epoch)


def best_so_far(curve: Curve, epoch: int, goal: str) -> float:
    """The curve's best value over its epochs up to `epoch`."""
    values = [v for e, v in curve.items() if e <= epoch]
    return min(values) if goal == "min" else max(values)


def should_stop(
    curve: Curve,
    others: list[Curve],
    *,
    goal: str,
    min_trials: int = DEFAULT_MIN_TRIALS,
    min_epochs: int = DEFAULT_MIN_EPOCHS,
) -> Verdict | None:
    """The verdict on a running trial with `curve` given the other trials' `others`
    (running or ended), or None to let it run."""
    if len(curve) < max(min_epochs, 1):
        return None
    epoch = max(curve)
    averages = [running_average(other, epoch) for other in others if epoch in other]
    if len(averages) < max(min_trials, 1):
        return None
    median = statistics.median(averages)
    best = best_so_far(curve, epoch, goal)
    worse = best > median if goal == "min" else best < median
    return Verdict(epoch, best, median, len(averages)) if worse else None


def objective(curve: Curve, goal: str) -> float | None:
    """A trial's objective: its best value over every epoch it reported (None: none yet)."""
    if not curve:
        return None
    return min(curve.values()) if goal == "min" else max(curve.values())
