"""bench.comm_scaling: the latency + bytes / bandwidth fit."""

import math

import pytest

from bench.comm_scaling import MB, fit_latency_bandwidth


def test_fit_recovers_latency_and_bandwidth_over_three_decades() -> None:
    sizes = [0.1 * MB, MB, 16 * MB, 64 * MB]
    alpha, beta = 0.5e-3, 800 * MB  # 0.5 ms and 800 MB/s
    fit = fit_latency_bandwidth(sizes, [alpha + n / beta for n in sizes])
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_bytes_s == pytest.approx(beta, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.as_dict() == {"alpha_ms": 0.5, "beta_mb_s": 800.0, "r2": 1.0}


def test_small_sizes_set_the_latency_despite_noise_at_the_large_one() -> None:
    # The largest size 20 % slow: a fit in plain seconds would put alpha below zero;
    # relative residuals keep it near the small sizes' time.
    sizes = [0.1 * MB, MB, 16 * MB, 64 * MB]
    seconds = [1e-3 + n / (1000 * MB) for n in sizes]
    seconds[-1] *= 1.2
    fit = fit_latency_bandwidth(sizes, seconds)
    assert 0.5e-3 < fit.alpha_s < 1.5e-3
    assert fit.r2 < 1.0


def test_flat_timings_give_an_infinite_bandwidth() -> None:
    assert math.isinf(fit_latency_bandwidth([MB, 2 * MB], [1e-3, 0.9e-3]).beta_bytes_s)


@pytest.mark.parametrize(
    ("sizes", "seconds"),
    [([MB], [1.0]), ([MB, MB], [1.0, 2.0]), ([MB, 2 * MB], [1.0]), ([MB, 2 * MB], [1.0, 0.0])],
)
def test_fit_refuses_what_it_cannot_fit(sizes: list[float], seconds: list[float]) -> None:
    with pytest.raises(ValueError):
        fit_latency_bandwidth(sizes, seconds)
