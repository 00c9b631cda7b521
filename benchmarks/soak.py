"""Soak: 10,000 samples in flight for a bounded time — memory stays flat, the event loop stays responsive.

    python -m benchmarks.soak [--seconds 120] [--groups 1000] [--median-s 8] [--p99-s 30]
                              [--step-fraction 4] [--max-response-len N] [--output bench-results/soak.json]
    python -m benchmarks.soak --seconds 600 --groups 5000 --median-s 40 --p99-s 120   # 50,000 in flight

The real controller (scheduler, pool, buffer, driver, ledger) runs in real time against the FAKE latency
engine (no model) and the FAKE trainer: `--groups` groups × 10 samples are kept in flight, each request
lasting `--median-s` (median) to `--p99-s` (p99) seconds; the defaults, 1,000 groups of 8 s to 30 s,
are ~1,000 requests per second (in flight / mean latency, Little's law); a request's tokens come at 4 per
second of its latency, and a step trains a quarter of the groups in flight. A monitor task samples the
event loop's lag (how late a 10 ms sleep wakes up) and the process's resident memory. The fake engine
draws its token ids in one call (`fast_ids`): drawn one by one, they were a third of the process's CPU.
Reported: loop lag p50/p99/max over the whole run and between its first third (the warm-up: 50,000
samples admitted at once) and the stop, the stop's own length and longest stall (it cancels every
request in flight), RSS at the end vs after warm-up, as a ratio, plus RSS every 10 s, the
garbage collector's pauses by generation (count, total, longest: the controller paces the collector,
`miles_aio._gc`), and what one full pass after the run finds (the reference cycles the paced collector
left for later). Targets: lag p99 < 10 ms, RSS within ±10%.

The steady window's lag is also given corrected for coordinated omission (`time_weighted`): a monitor
that sleeps 10 ms at a time takes one sample during a stall of 450 ms, where it would have taken 45, so
plain percentiles of its samples favour one long stall over the same work spread across many loop
passes. The corrected percentiles count, for each sample of lag L, the samples the stall hid (L - 10 ms,
L - 20 ms, ... above 0), as HdrHistogram's `recordValueWithExpectedInterval` does: a percentile of how
late a timer due at a random moment would have been.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from miles_aio.config import (
    BufferConfig,
    DataConfig,
    DriverConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
)
from miles_aio.controller import Controller
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency

GROUPS, N = 1000, 10
"""The default load: groups in flight, samples per group."""
TOKENS_PER_S = 4
"""Tokens a request gets per second of its latency (a median 8 s request: 32 tokens)."""
STEP_FRACTION = 4
"""A step trains 1/STEP_FRACTION of the groups in flight (the buffer holds STEP_FRACTION steps), so steps
come every few request latencies; a step of everything in flight waits for the slowest of its requests
(at 50,000 in flight: one step in two minutes)."""
CAP_OVER_P99 = 4
"""--rollout-max-response-len, as a multiple of the p99 latency's tokens: a cap that ends about one
request in a million (8 s median, 30 s p99) to ten million (40 s, 120 s) of the lognormal model, so the
latency model alone says when a request ends. Until session 19 the
cap was 64 tokens (16 s at 4 tokens/s): the requests of a 40 s median nearly all lasted 16 s, and the
50,000 a step admits together also finished together, ~46,000 of them within one second."""
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def hidden_samples(lags: list[float], interval: float = 0.01) -> list[float]:
    """The lag samples with, after each, those its stall hid: a lag L also stands for L - interval,
    L - 2 interval, ... while above 0 (coordinated omission: the monitor was stalled too)."""
    out: list[float] = []
    for lag in lags:
        out.append(lag)
        hidden = lag - interval
        while hidden > 0:
            out.append(hidden)
            hidden -= interval
    return out


async def monitor(stop: asyncio.Event, lags: list[float], rss: list[tuple[float, float]]) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.01)
        lags.append(loop.time() - before - 0.01)
        if len(lags) % 10 == 0:
            rss.append((loop.time() - t0, rss_mib()))


class GcPauses:
    """Collector pauses by generation, from `gc.callbacks` (a diagnostic: it does not change the lag)."""

    def __init__(self) -> None:
        self.by_gen = {g: [0, 0.0, 0.0] for g in range(3)}  # count, total s, longest s
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause, row = time.perf_counter() - self._t0, self.by_gen[info["generation"]]
        row[0], row[1], row[2] = row[0] + 1, row[1] + pause, max(row[2], pause)

    def report(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {"count": c, "total_s": round(t, 3), "max_ms": round(m * 1000, 1)}
            for g, (c, t, m) in self.by_gen.items()
        }


async def soak(
    seconds: float,
    run_dir: Path,
    *,
    groups: int = GROUPS,
    median_s: float = 8.0,
    p99_s: float = 30.0,
    step_fraction: int = STEP_FRACTION,
    max_response_len: int | None = None,
) -> dict[str, object]:
    """`max_response_len` None: `CAP_OVER_P99` × the p99 latency's tokens."""
    base_mib = rss_mib()  # before the controller and its samples exist
    cap = max_response_len or math.ceil(TOKENS_PER_S * p99_s * CAP_OVER_P99)
    step_groups = max(1, groups // step_fraction)
    cfg = RunConfig(
        data=DataConfig(),
        rollout=RolloutConfig(
            rollout_batch_size=step_groups,
            n_samples_per_prompt=N,
            rollout_max_response_len=cap,
            custom_rm_path="benchmarks.pipeline:reward",
            sglang_server_concurrency=100_000,
        ),
        scheduler=SchedulerConfig(async_max_concurrent_samples=groups * N),
        buffer=BufferConfig(async_data_buffer_capacity_factor=float(step_fraction)),
        driver=DriverConfig(num_rollout=10**6),
        train=TrainConfig(use_tis=True),
        run_dir=run_dir,
    )
    engine = FakeLatencyEngine(LogNormalLatency(median_s, p99_s), tokens_per_s=TOKENS_PER_S, fast_ids=True)
    controller = Controller(
        cfg,
        engine=engine,
        trainer=FakeTrainer(step_time_s=0.5, keep_batches=False),
        source=DataSource(
            [PromptRecord(f"p{i}") for i in range(max(100_000, 20 * groups))],
            n_samples_per_prompt=N,
            seed=0,
            shuffle=False,
        ),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
        write_files=False,
    )
    lags: list[float] = []
    rss: list[tuple[float, float]] = []
    stop = asyncio.Event()
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(monitor(stop, lags, rss), name="monitor")
            run = tg.create_task(controller.run(), name="controller")
            await asyncio.sleep(seconds / 3)
            warm_from = len(lags)  # the lag samples after the warm-up (admission's first ramp) third
            await asyncio.sleep(seconds - seconds / 3)
            stop_from, t_stop = len(lags), time.perf_counter()  # the stop's own stall is reported apart
            controller.request_stop()
            summary = await run
            stop_s = time.perf_counter() - t_stop
            stop.set()
    finally:
        gc.callbacks.remove(pauses)
    # What the paced collector left for later: reference cycles that became garbage in the oldest
    # generation since its last full pass (`miles_aio._gc`: at most one per FULL_EVERY_S).
    t_full = time.perf_counter()
    unreachable = gc.collect()
    full_pass = {"unreachable_objects": unreachable, "ms": round((time.perf_counter() - t_full) * 1000, 1)}
    warm = [m for t, m in rss if t >= seconds / 3]
    q = statistics.quantiles([x * 1000 for x in lags], n=100)
    steady = lags[warm_from:stop_from] if stop_from - warm_from >= 2 else lags
    stopping = lags[stop_from:] or [0.0]
    qs = statistics.quantiles([x * 1000 for x in steady], n=100)
    qc = statistics.quantiles([x * 1000 for x in hidden_samples(steady)], n=100)
    return {
        "seconds": seconds,
        "steps": summary.steps,
        "groups": groups,
        "step_groups": step_groups,
        "max_response_len": cap,
        "latency_s": {"median": median_s, "p99": p99_s},
        "max_in_flight_requests": engine.max_in_flight,
        "requests": engine.requests,
        "loop_lag_ms": {"p50": round(q[49], 3), "p99": round(q[98], 3), "max": round(max(lags) * 1000, 3)},
        "loop_lag_ms_after_warmup": {
            "p50": round(qs[49], 3),
            "p99": round(qs[98], 3),
            "max": round(max(steady) * 1000, 3),
            "time_weighted": {"p50": round(qc[49], 3), "p99": round(qc[98], 3)},
        },
        # the stop: finish the step in progress, cancel every request in flight, close the engine
        "stop": {"s": round(stop_s, 2), "loop_lag_ms_max": round(max(stopping) * 1000, 3)},
        "rss_mib": {
            "after_warmup": round(warm[0], 1),
            "end": round(warm[-1], 1),
            "ratio_end_to_warmup": round(warm[-1] / warm[0], 4),
            "max": round(max(m for _, m in rss), 1),
            "before_start": round(base_mib, 1),
            # what the run added at its end, per request in flight at the peak (with its sample and
            # the finished samples buffered meanwhile): an upper bound of one request's memory
            "kib_per_in_flight_request": round(
                (warm[-1] - base_mib) * 1024 / max(engine.max_in_flight, 1), 2
            ),
            "every_10s": [round(next(m for t, m in rss if t >= k), 1) for k in range(0, int(rss[-1][0]), 10)],
        },
        "gc_pauses": pauses.report(),
        "gc_full_pass_after_the_run": full_pass,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=120.0, help="run time (RSS is compared from its first third on)"
    )
    parser.add_argument(
        "--groups", type=int, default=GROUPS, help=f"groups of {N} in flight (default: %(default)s)"
    )
    parser.add_argument(
        "--median-s", type=float, default=8.0, help="request latency median (default: %(default)s)"
    )
    parser.add_argument(
        "--p99-s", type=float, default=30.0, help="request latency p99 (default: %(default)s)"
    )
    parser.add_argument(
        "--step-fraction",
        type=int,
        default=STEP_FRACTION,
        help="a step trains 1/this of the groups in flight (default: %(default)s; 1: the old soak)",
    )
    parser.add_argument(
        "--max-response-len",
        type=int,
        default=None,
        help=f"tokens per request at most (default: {CAP_OVER_P99} × the p99 latency's; 64: the old soak)",
    )
    parser.add_argument("--output", type=Path, default=Path("bench-results/soak.json"))
    args = parser.parse_args()
    if args.step_fraction < 1 or (args.max_response_len is not None and args.max_response_len < 1):
        parser.error("--step-fraction and --max-response-len must be >= 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = asyncio.run(
            soak(
                args.seconds,
                Path(tmp),
                groups=args.groups,
                median_s=args.median_s,
                p99_s=args.p99_s,
                step_fraction=args.step_fraction,
                max_response_len=args.max_response_len,
            )
        )
    result |= {
        "benchmark": "soak",
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
