"""bench.stats: the counterbalanced order of paired rounds and the bootstrap interval."""

import pytest

from bench.stats import median_ci, paired_ratios, paired_rounds, summary


def test_rounds_alternate_the_order_of_the_arms() -> None:
    order: list[str] = []
    arms = {name: (lambda n=name: order.append(n) or 1.0) for name in ("a", "b")}
    values = paired_rounds(arms, 4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert values == {"a": [1.0] * 4, "b": [1.0] * 4}


def test_interval_brackets_the_median_and_narrows_with_agreement() -> None:
    spread = [0.9, 1.3, 1.0, 1.6, 1.1, 0.8, 1.2]
    median, low, high = median_ci(spread)
    assert median == 1.1 and low <= median <= high and high - low > 0.1
    tight = [1.0, 1.001, 0.999, 1.0005, 0.9995, 1.0, 1.0002]
    _, t_low, t_high = median_ci(tight)
    assert t_high - t_low < 0.01
    assert summary([2.0])["ci95"] == [2.0, 2.0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])
    with pytest.raises(ValueError, match="against"):
        paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="zero"):
        paired_ratios([1.0], [0.0])
