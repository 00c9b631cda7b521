"""benchmarks.soak's lag corrected for coordinated omission: a stall stands for the samples it hid."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.soak import hidden_samples


def test_a_stall_stands_for_the_samples_it_hid() -> None:
    assert hidden_samples([0.002, 0.045]) == pytest.approx([0.002, 0.045, 0.035, 0.025, 0.015, 0.005])
    assert hidden_samples([0.0, 0.01]) == [0.0, 0.01]  # on time, or exactly one interval late: nothing hidden


def test_one_long_stall_weighs_more_than_the_same_work_spread_out() -> None:
    quiet = [0.0005] * 2000
    one_stall = [*quiet, 0.45]  # 450 ms in one loop pass: the plain p99 does not see it
    spread = [*quiet, *[0.01] * 45]  # the same 450 ms as 45 passes of 10 ms

    def p99(lags: list[float]) -> float:
        return statistics.quantiles(lags, n=100)[98]

    assert p99(one_stall) < p99(spread)  # why plain percentiles mislead
    assert p99(hidden_samples(one_stall)) > p99(hidden_samples(spread))
