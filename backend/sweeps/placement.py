"""Where a sweep's next trial runs: on the groups that finish it soonest while the others are
busy (pure, no database; docs/architecture.md, "Sweeps").

With a plan's performance model (`backend.plans.performance`) for the sweep's code version,
every non-empty subset `S` of the plan's candidate groups (each at the workers the plan asked
for) is a choice. Each group `g` is busy for `busy_s[g]` more seconds with the sweep's
trials already running there (0: free). A trial on `S` can start once every group of `S` is
free and then takes the model's predicted time on `S`:

    finish(S) = max(busy_s[g] for g in S) + predict(S).finish_s

The trial goes to the `S` with the earliest finish (ties: fewer workers, then fewer groups,
then the candidates' order). So a trial takes the fastest set when the pools are free, and
a pool another trial holds for long is left out for a free one that finishes sooner: the
earliest-finish-time rule of list scheduling, one trial at a time in submission order.
Subsets whose workers exceed the global batch, or whose memory cannot hold the task
(`DoesNotFit`), are not choices. Without a plan the trial runs on the sweep's own groups.
"""

from dataclasses import dataclass

from backend.plans import performance


@dataclass(frozen=True)
class TrialPlacement:
    """The chosen groups' prediction, when the trial can start (`start_s`, seconds from now)
    and when it is predicted to finish (`finish_s`)."""

    prediction: performance.Prediction
    start_s: float
    finish_s: float


def place_trial(
    model: performance.PerformanceModel,
    busy_s: dict[str, float],
    *,
    global_batch_size: int,
    epochs: int,
    split_policy: str,
    guard: bool = True,
) -> TrialPlacement:
    """The subset of the model's groups that finishes the trial soonest, given how long each
    group is still busy (`busy_s`, missing: free). Raises ValueError when no subset can hold
    the task."""
    asked = {g.name: g.workers for g in model.groups}
    order = {name: i for i, name in enumerate(asked)}
    best: tuple[tuple[float, int, int, list[int]], TrialPlacement] | None = None
    for subset in performance.subsets(list(asked)):
        workers = {name: asked[name] for name in subset}
        if not performance.fits_batch(model, workers, global_batch_size):
            continue
        try:
            prediction = performance.predict(
                model,
                workers,
                global_batch_size=global_batch_size,
                epochs=epochs,
                split_policy=split_policy,
                guard=guard,
            )
        except ValueError:  # DoesNotFit, or an exchange the trial did not time
            continue
        start = max(max(busy_s.get(name, 0.0), 0.0) for name in subset)
        found = TrialPlacement(prediction, start, start + prediction.finish_s)
        key = (found.finish_s, sum(workers.values()), len(subset), [order[n] for n in subset])
        if best is None or key < best[0]:
            best = (key, found)
    if best is None:
        raise ValueError("no set of the plan's groups can hold the trial")
    return best[1]
