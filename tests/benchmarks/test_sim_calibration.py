"""The simulator's engine calibration (benchmarks.sim_validate): closed-loop loads, indirect inference."""

from __future__ import annotations

import asyncio
import itertools

import looptime
import pytest

from benchmarks.sim_validate import (
    CALIBRATION_CONCURRENCY,
    EngineParams,
    _simulated_walls,
    calibrate_engine,
    calibration_lengths,
    closed_loop,
)
from miles_aio.testing import FakeLatencyEngine

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


def test_prefill_curve_interpolates_and_holds_up_decoding() -> None:
    eng = FakeLatencyEngine(
        lengths=lambda rng: 10, base_per_token_s=0.01, prefill_curve=[(8, 0.004), (64, 0.002)]
    )
    assert eng.start_s(1) == 0.004 and eng.start_s(100) == 0.002  # flat past both ends
    assert eng.start_s(36) == pytest.approx(0.003)
    with pytest.raises(ValueError, match="prefill curve"):
        FakeLatencyEngine(lengths=lambda rng: 1, prefill_curve=[(1, -0.1), (2, 0.0)])

    async def one() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 10})
        return loop.time() - t0

    loop = looptime.new_event_loop(start=0.0)
    try:
        assert loop.run_until_complete(one()) == pytest.approx(0.004 + 10 * 0.01)
    finally:
        loop.close()


def test_calibration_lengths_vary_and_closed_loop_bounds_in_flight() -> None:
    lengths = calibration_lengths(8, 30)
    assert len(set(lengths)) > 10 and all(15 <= n <= 45 for n in lengths)
    assert calibration_lengths(8, 30) == lengths  # fixed: real and simulated loads are the same
    eng = FakeLatencyEngine(lengths=lambda rng: 1_000_000, base_per_token_s=0.001)
    loop = looptime.new_event_loop(start=0.0)
    try:
        wall = loop.run_until_complete(closed_loop(eng, itertools.repeat([3] * 6), 8, 6))
    finally:
        loop.close()
    assert eng.max_in_flight == 8 and wall > 0


def test_calibrate_engine_recovers_the_parameters_of_simulated_loads() -> None:
    true = EngineParams(
        curve=((8, 0.0012), (32, 0.0027), (64, 0.0053)), start=((8, 0.0019), (32, 0.0012), (64, 0.0016))
    )
    walls = _simulated_walls(true, (9, 28))
    assert sorted(walls) == sorted(CALIBRATION_CONCURRENCY)
    got, err = calibrate_engine(walls)
    assert err < 0.01
    for (c, t), (_, t_true) in zip(got.curve, true.curve, strict=True):
        assert t == pytest.approx(t_true, rel=0.05), c
    for (c, h), (_, h_true) in zip(got.start, true.start, strict=True):
        assert h == pytest.approx(h_true, rel=0.1), c
