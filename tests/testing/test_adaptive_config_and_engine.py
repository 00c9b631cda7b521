"""`--async-max-concurrent-samples auto` on the command line, and the FAKE engine's batched time model."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from miles_aio.cli import parse_run_config
from miles_aio.testing import FakeLatencyEngine, LogNormal

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(20)]

BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "1", "--use-tis"]


def test_cli_accepts_auto_and_integers() -> None:
    cfg = parse_run_config(
        [*BASE, "--async-max-concurrent-samples", "auto", "--adaptive-concurrency-max", "10"]
    )
    assert cfg.scheduler.adaptive and cfg.max_in_flight_samples == 10  # B × N = 16, clamped to the max
    cfg = parse_run_config([*BASE, "--async-max-concurrent-samples", "12"])
    assert cfg.scheduler.async_max_concurrent_samples == 12 and not cfg.scheduler.adaptive


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--async-max-concurrent-samples", "lots"], "positive integer or 'auto'"),
        (["--async-max-concurrent-samples", "-4"], "positive integer or 'auto'"),
        (["--async-max-concurrent-samples", "0"], "must be > 0"),
        (["--async-max-concurrent-samples", "auto", "--adaptive-concurrency-min", "2"], "hold a group"),
        (["--adaptive-concurrency-min", "64", "--adaptive-concurrency-max", "32"], "max (32) < min (64)"),
    ],
)
def test_cli_rejects_bad_values_with_exit_2(args: list[str], message: str, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_run_config([*BASE, *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_batched_engine_shares_decode_time_and_queues_beyond_its_batch(vrun: Any) -> None:
    eng = FakeLatencyEngine(
        lengths=lambda rng: 10, base_per_token_s=0.1, slope_per_token_s=0.05, max_running=2
    )

    async def main() -> list[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        out: list[tuple[float, int]] = []

        async def one() -> None:
            res = await eng.generate(input_ids=[1], sampling_params={})
            out.append((round(loop.time(), 6), len(res.output_ids)))

        async with asyncio.TaskGroup() as tg:
            for _ in range(3):
                tg.create_task(one())
            await asyncio.sleep(0.5)
            assert (eng.load().running, eng.load().queued) == (2, 1)
        return out

    # two run together at 0.2 s/token (10 tokens: 2 s); the third then runs alone at 0.15 s/token
    assert vrun(main()) == [(2.0, 10), (2.0, 10), (3.5, 10)]


def test_batched_engine_pause_freezes_and_versions_tag_tokens(vrun: Any) -> None:
    eng = FakeLatencyEngine(lengths=lambda rng: 10, base_per_token_s=0.1)

    async def main() -> list[int | None]:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(eng.generate(input_ids=[1], sampling_params={}))
            await eng.update_weight_version(1)
            await asyncio.sleep(0.45)  # 4 tokens at version 1
            await eng.pause_generation("retract")
            await eng.update_weight_version(2)
            await asyncio.sleep(5.0)  # frozen
            await eng.continue_generation()
        return task.result().weight_versions

    assert vrun(main()) == [1] * 4 + [2] * 6


def test_versions_of_overlapping_requests_follow_every_stamp_and_old_stamps_go(vrun: Any) -> None:
    """Requests started 0.3 s apart, 10 tokens at 0.1 s each, the version stamped every 0.25 s (between
    token boundaries): token i of a request started at t0 carries the last version stamped before
    t0 + 0.1 (i + 1), the end of its decode step. The engine keeps only the stamps its running requests
    can still need."""
    eng = FakeLatencyEngine(lengths=lambda rng: 10, base_per_token_s=0.1)
    starts = [0.3 * k for k in range(12)]
    stamps = [(0.25 * k + 0.01, k) for k in range(1, 20)]

    async def main() -> tuple[list[list[int | None]], int]:
        kept = 0

        async def stamper() -> None:
            nonlocal kept
            for t, v in stamps:
                await asyncio.sleep(t - asyncio.get_running_loop().time())
                await eng.update_weight_version(v)
                kept = max(kept, len(eng._engines[0].stamps))

        async def request(t0: float) -> list[int | None]:
            await asyncio.sleep(t0)
            return (await eng.generate(input_ids=[1], sampling_params={})).weight_versions

        async with asyncio.TaskGroup() as tg:
            tg.create_task(stamper())
            tasks = [tg.create_task(request(t0)) for t0 in starts]
        return [t.result() for t in tasks], kept

    got, kept = vrun(main())
    for t0, versions in zip(starts, got, strict=True):
        expected = [max((v for t, v in stamps if t < t0 + 0.1 * (i + 1)), default=None) for i in range(10)]
        assert versions == expected, t0
    assert kept <= 6  # a request runs 1 s: at most 5 stamps fall in it (and the newest one)


def test_lognormal_lengths_hit_their_median() -> None:
    dist, rng = LogNormal(100, 1000), random.Random(0)
    draws = sorted(dist(rng) for _ in range(4001))
    assert 90 <= draws[2000] <= 110 and min(draws) >= 1


def test_batched_engine_interpolates_a_measured_curve() -> None:
    eng = FakeLatencyEngine(lengths=lambda rng: 1, per_token_curve=[(1, 0.002), (8, 0.004), (64, 0.012)])
    assert eng.per_token_s(1) == pytest.approx(0.002)
    assert eng.per_token_s(36) == pytest.approx(0.008)  # halfway between 8 and 64
    assert eng.per_token_s(120) == pytest.approx(0.020)  # extrapolated along the last segment
    assert eng.per_token_s(0) > 0
    with pytest.raises(ValueError, match="curve"):
        FakeLatencyEngine(lengths=lambda rng: 1, per_token_curve=[(1, 0.002)])


def test_pause_and_continue_over_many_engines_settle_in_chunks_with_the_same_result(
    vrun: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause or a continue over more than `SETTLE_CHUNK` engines settles them a chunk per loop pass (as
    N engines answer N calls), and every request ends as it does when all are settled in one go:
    same tokens, same versions, same end times."""
    from miles_aio.testing import fakes

    def run(chunk: int) -> tuple[list[tuple[float, int, tuple[int | None, ...]]], int]:
        monkeypatch.setattr(fakes, "SETTLE_CHUNK", chunk)
        eng = FakeLatencyEngine(
            lengths=LogNormal(20, 80),
            base_per_token_s=0.01,
            slope_per_token_s=0.001,
            max_running=4,
            num_engines=200,
            seed=3,
            fast_ids=True,  # token ids from their own generator: lengths are drawn in arrival order only
        )

        async def main() -> tuple[list[tuple[float, int, tuple[int | None, ...]]], int]:
            loop, passes, pausing = asyncio.get_running_loop(), 0, asyncio.Event()

            async def one(k: int) -> tuple[float, int, tuple[int | None, ...]]:
                # (never at the instant of a pause or continue: requests that arrive at the same time
                # draw their lengths in the order they run, which the chunks' passes may change)
                await asyncio.sleep(0.001 * k + 0.0005)
                out = await eng.generate(input_ids=[1], sampling_params={})
                return round(loop.time(), 9), len(out.output_ids), tuple(out.weight_versions)

            async def counter() -> None:  # passes of the loop while the pause is in progress
                nonlocal passes
                await pausing.wait()
                while pausing.is_set():
                    passes += 1
                    await asyncio.sleep(0)

            async with asyncio.TaskGroup() as tg:
                tg.create_task(counter())
                tasks = [tg.create_task(one(k)) for k in range(1000)]
                await eng.update_weight_version(1)
                await asyncio.sleep(0.35)
                pausing.set()
                await eng.pause_generation("retract")
                pausing.clear()
                await eng.update_weight_version(2)
                await asyncio.sleep(0.2)
                await eng.continue_generation()
            return [t.result() for t in tasks], passes

        result: tuple[list[tuple[float, int, tuple[int | None, ...]]], int] = vrun(main())
        return result

    paced, passes = run(16)
    one_go, passes_one_go = run(10**6)
    assert paced == one_go
    assert passes >= 200 // 16 and passes_one_go == 0
    assert {v for _, _, vs in paced for v in vs} == {1, 2}  # requests ran across the pause


def test_a_continue_cancelled_between_chunks_still_lets_every_request_finish(
    vrun: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continue is cancelled after its first chunk (a push's deadline, a stop): the change stands, so
    the engines not yet settled are settled as it unwinds, and no request waits for ever on an engine
    that was never told the pause is over."""
    from miles_aio.testing import fakes

    monkeypatch.setattr(fakes, "SETTLE_CHUNK", 16)
    eng = FakeLatencyEngine(
        lengths=LogNormal(20, 80), base_per_token_s=0.01, max_running=4, num_engines=200, seed=5
    )

    async def main() -> int:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(eng.generate(input_ids=[1], sampling_params={})) for _ in range(1000)]
            await asyncio.sleep(0.05)
            await eng.pause_generation("retract")
            going = asyncio.create_task(eng.continue_generation())
            await asyncio.sleep(0)  # one pass: the continue settles its first chunk and yields
            assert "continue" in eng.calls and not going.done()  # between two of its 13 chunks
            going.cancel()
            with pytest.raises(asyncio.CancelledError):
                await going
            async with asyncio.timeout(600):  # virtual seconds; the longest request needs a few
                done = await asyncio.gather(*tasks)
        return len(done)

    assert vrun(main()) == 1000
