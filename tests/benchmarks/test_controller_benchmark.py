"""`benchmarks.controller --quick`: the smoke version CI keeps (it runs and reports; asserts no figure)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.controller import HEADER, _row, cases, measure
from miles_aio.testing import FakeLatencyEngine, LogNormal

pytestmark = pytest.mark.timeout(120)


def test_the_quick_cases_run_and_report_every_figure() -> None:
    results = [measure(case) for case in cases(quick=True, real_seconds=1.0)]
    assert {r["part"] for r in results} == {"ceiling", "scale", "lag"}
    for r in results:
        assert r["requests"] > 0 and r["requests"] >= r["samples"]
        if r["part"] != "lag":  # a lag case stops after a wall-clock second: maybe before its first step
            assert r["samples"] > 0 and r["cpu_us_per_sample"] > 0 and r["ceiling_samples_per_s"] > 0
        assert r["max_in_flight_requests"] <= r["in_flight"]
        assert len(_row(r)) >= len(HEADER) - 10
    multi = next(r for r in results if r["part"] == "scale" and r["turns"] == 4)
    assert multi["requests"] > multi["samples"]  # several engine calls per sample
    instant = next(r for r in results if r["engine"] == "instant")  # the controller's cost alone
    assert instant["part"] == "ceiling" and instant["requests"] >= instant["samples"] > 0
    assert "/i" in _row(instant)
    lag = next(r for r in results if r["part"] == "lag")
    assert set(lag["loop_lag_ms"]) == {"p50", "p99", "max"} and "rss_kib_per_in_flight_request" in lag


def test_many_engines_keep_their_own_clock_and_the_in_flight_count(vrun: object, tmp_path: Path) -> None:
    """1,000 engines: every arrival and finish touches its engine only, and `in_flight` (a sum over the
    engines) agrees with the count the engine keeps for `max_in_flight`."""
    engine = FakeLatencyEngine(
        lengths=LogNormal(20, 200), num_engines=1000, max_running=2, fast_ids=True, vocab_size=50
    )

    async def one(i: int) -> list[int]:
        out = await engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 64})
        assert engine.in_flight == engine._live
        return out.output_ids

    async def main() -> list[list[int]]:
        async with asyncio.timeout(3600):
            return list(await asyncio.gather(*(one(i) for i in range(3000))))

    outs = vrun(main())  # type: ignore[operator]
    assert all(1 <= len(ids) <= 64 and all(0 <= t < 50 for t in ids) for ids in outs)
    assert engine.in_flight == 0 and engine.max_in_flight == 3000
