"""A sweep's trials from its search space: grid or random search (pure, no database).

A space maps each hyperparameter's name to either a list of values (`{"values": [...]}`) or,
for random search only, a range (`{"min": a, "max": b, "scale": "linear" | "log",
"integer": false}`).

- **grid**: every combination of the listed values, the first name varying slowest (in the
  space's order), the first `trials` of them (all when `trials` is None; `SweepCreate`
  refuses a grid of more than MAX_TRIALS combinations without `trials`), built lazily.
- **random**: `trials` independent draws seeded by the sweep's `seed` (Python's
  `random.Random(seed)`, so the same sweep draws the same trials): a listed parameter takes
  one of its values uniformly; a range a value uniform in `[min, max]` (`linear`) or whose
  logarithm is uniform in `[log min, log max]` (`log`), rounded to an integer when
  `integer`. The names are drawn in the space's order.
"""

import itertools
import math
import random
from typing import Any

Trial = dict[str, Any]


def grid(space: dict[str, dict[str, Any]], trials: int | None = None) -> list[Trial]:
    """The grid's combinations in order, the first `trials` of them (all: None).
    Raises ValueError for a range (a grid needs listed values)."""
    for name, item in space.items():
        if "values" not in item:
            raise ValueError(f"{name}: grid search needs a list of values, not a range")
    names = list(space)
    wanted = grid_size(space) if trials is None else min(trials, grid_size(space))
    # product() is lazy: only the `wanted` first combinations are ever built.
    combos = itertools.product(*(space[name]["values"] for name in names))
    return [dict(zip(names, combo, strict=True)) for combo in itertools.islice(combos, wanted)]


def grid_size(space: dict[str, dict[str, Any]]) -> int:
    """How many combinations the grid has."""
    return math.prod(len(item.get("values", ())) for item in space.values())


def draw(item: dict[str, Any], rng: random.Random) -> Any:
    """One value of one parameter: a listed value, or a point of its range."""
    if "values" in item:
        return item["values"][rng.randrange(len(item["values"]))]
    low, high = float(item["min"]), float(item["max"])
    if item.get("scale", "linear") == "log":
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
    else:
        value = rng.uniform(low, high)
    if item.get("integer"):
        return min(max(round(value), math.ceil(low)), math.floor(high))
    return value


def random_search(space: dict[str, dict[str, Any]], trials: int, seed: int) -> list[Trial]:
    """`trials` draws from the space, the same for the same seed."""
    rng = random.Random(seed)
    return [{name: draw(item, rng) for name, item in space.items()} for _ in range(trials)]


def expand(
    algorithm: str, space: dict[str, dict[str, Any]], trials: int | None, seed: int
) -> list[Trial]:
    """The sweep's planned trials, in submission order."""
    if algorithm == "grid":
        return grid(space, trials)
    return random_search(space, trials if trials is not None else 10, seed)
