"""benchmarks.soak's lag corrected for coordinated omission: a stall stands for the samples it hid."""

from __future__ import annotations

import asyncio
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.report import soak_section
from benchmarks.soak import CAP_OVER_P99, TOKENS_PER_S, N, hidden_samples, soak


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


@pytest.mark.timeout(60)
def test_a_short_soak_steps_and_reports_with_an_uncapped_latency_model(tmp_path: Path) -> None:
    """A few seconds of the soak at 200 in flight: steps of a quarter of the groups, a response cap the
    latency model (4 tokens per second of latency) practically never reaches, and every figure reported."""
    result = asyncio.run(soak(4.0, tmp_path, groups=20, median_s=0.2, p99_s=0.6))
    steps, in_flight = result["steps"], result["max_in_flight_requests"]
    assert isinstance(steps, int) and isinstance(in_flight, int)
    assert result["step_groups"] == 5 and steps >= 1
    assert result["max_response_len"] == math.ceil(TOKENS_PER_S * 0.6 * CAP_OVER_P99)
    assert 0 < in_flight <= 20 * N
    lag = result["loop_lag_ms_after_warmup"]
    assert isinstance(lag, dict) and set(lag) == {"p50", "p99", "max", "time_weighted"}


def test_the_report_gives_the_steady_lag_time_weighted_and_the_stop_apart() -> None:
    d = {
        "max_in_flight_requests": 50000, "seconds": 600.0, "requests": 700000, "steps": 40,
        "latency_s": {"median": 40.0, "p99": 120.0},
        "loop_lag_ms": {"p50": 0.6, "p99": 3.0, "max": 1300.0},
        "loop_lag_ms_after_warmup": {
            "p50": 0.6, "p99": 4.3, "max": 26.0, "time_weighted": {"p50": 0.6, "p99": 4.4},
        },
        "stop": {"s": 1.6, "loop_lag_ms_max": 1300.0},
        "rss_mib": {
            "after_warmup": 760.0, "end": 790.0, "ratio_end_to_warmup": 1.04,
            "kib_per_in_flight_request": 15.1,
        },
    }  # fmt: skip
    text = "\n".join(soak_section(d))
    assert "40.0 s median, 120.0 s p99" in text
    assert "p99 4.3 ms, max 26.0 ms; time-weighted (coordinated omission corrected) p99 4.4 ms" in text
    assert "the stop (cancelling every request in flight): 1.6 s, longest stall 1300.0 ms" in text
    assert "15.1 KiB per in-flight request" in text
