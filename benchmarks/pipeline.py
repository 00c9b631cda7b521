"""Pipeline efficiency of the fully async controller vs the ideal bound and vs synchronous RL.

    python -m benchmarks.pipeline [--output bench-results/pipeline.json] [--steps 30]

What it runs: the real Controller (scheduler, buffer, pool, driver loop) over the FAKE latency engine
(lognormal request latency, p99/p50 = 12) and the FAKE trainer (fixed step time), on virtual time
(looptime), so the figures measure the scheduling, not this machine's noise. Cases vary the trainer
step time so the run is train-bound, balanced, and rollout-bound.

  ideal bound  = max(rollout, train) per step, rollout = samples/step × mean latency / in-flight bound
                 (Little's law: the engines never idle and nothing waits)
  async        = mean step time of the controller in steady state (after 3 warm-up steps)
  sync         = the same pool, engine and trainer run synchronously: generate the whole batch, then
                 train (miles' train.py) — its step is the slowest sample of the batch plus training

Also measured, in real wall time: the controller's own overhead, as groups/s pushed through a
zero-latency engine and a zero-time trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import looptime

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
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import RolloutPool
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import Sample

T = TypeVar("T")

B, N = 16, 8  # groups per step, samples per group
LATENCY = LogNormalLatency(p50=1.0, p99=12.0)
TOKENS_PER_S = 50.0


async def reward(ctx: RolloutContext, sample: Sample) -> float:
    return float(sample.response_length % 2)  # varies, as a real reward: a constant one is warned about


def config(run_dir: Path, steps: int, **sched: Any) -> RunConfig:
    return RunConfig(
        data=DataConfig(),
        rollout=RolloutConfig(
            rollout_batch_size=B,
            n_samples_per_prompt=N,
            rollout_max_response_len=100_000,
            custom_rm_path="benchmarks.pipeline:reward",
            sglang_server_concurrency=100_000,
        ),
        scheduler=SchedulerConfig(**sched),
        buffer=BufferConfig(),
        driver=DriverConfig(num_rollout=steps),
        train=TrainConfig(use_tis=True),
        run_dir=run_dir,
    )


def source() -> DataSource:
    return DataSource(
        [PromptRecord(f"p{i}") for i in range(10_000)], n_samples_per_prompt=N, seed=0, shuffle=False
    )


def on_virtual_time(coro: Coroutine[Any, Any, T]) -> T:
    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def run_async(train_step_s: float, steps: int, run_dir: Path) -> list[float]:
    cfg = config(run_dir, steps)
    controller = Controller(
        cfg,
        engine=FakeLatencyEngine(LATENCY, tokens_per_s=TOKENS_PER_S, seed=1),
        trainer=FakeTrainer(step_time_s=train_step_s),
        source=source(),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
        write_files=False,
    )
    return on_virtual_time(controller.run()).step_times_s


def run_sync(train_step_s: float, steps: int, run_dir: Path) -> list[float]:
    """Generate the whole batch with the same pool and engine, then train: one step at a time."""
    cfg = config(run_dir, steps)
    plugins = resolve_plugins(cfg)
    engine = FakeLatencyEngine(LATENCY, tokens_per_s=TOKENS_PER_S, seed=1)
    trainer = FakeTrainer(step_time_s=train_step_s)
    import structlog

    from miles_aio.rollout.context import LimitedEngine

    ctx = RolloutContext(
        engine=LimitedEngine(engine, Limiter(100_000)),
        tokenizer=FakeTokenizer(),
        config=cfg,
        log=structlog.get_logger("bench"),
    )
    pool = RolloutPool(ctx=ctx, generate_fn=plugins.generate_fn, reward_fn=plugins.reward_fn)
    src = source()

    async def main() -> list[float]:
        loop, times = asyncio.get_running_loop(), []
        for step in range(steps):
            t0 = loop.time()
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(pool.run_group(src.next_group(), on_sample_done=lambda: None))
                    for _ in range(B)
                ]
            await trainer.train(step, [t.result() for t in tasks])
            times.append(loop.time() - t0)
        return times

    return on_virtual_time(main())


def controller_overhead(run_dir: Path, steps: int = 30) -> dict[str, float]:
    """Real wall time: how many groups/s the controller itself can push (zero-latency engine/trainer)."""
    cfg = config(run_dir, steps)
    controller = Controller(
        cfg,
        engine=FakeLatencyEngine(lambda rng: 0.0, tokens_per_s=1.0),
        trainer=FakeTrainer(step_time_s=0.0),
        source=source(),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
        write_files=False,
    )
    t0 = time.perf_counter()
    summary = asyncio.run(controller.run())
    wall = time.perf_counter() - t0
    groups = summary.steps * B
    return {"groups_per_s": groups / wall, "samples_per_s": groups * N / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("bench-results/pipeline.json"))
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up only

    samples = B * N
    rollout_s = samples * LATENCY.mean / (B * N)  # in-flight bound = B × N (the default)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, train_s in (
            ("train-bound", 2.0 * rollout_s),
            ("balanced", rollout_s),
            ("rollout-bound", 0.5 * rollout_s),
        ):
            async_times = run_async(train_s, args.steps, Path(tmp))[3:]
            sync_times = run_sync(train_s, args.steps, Path(tmp))[3:]
            bound = max(rollout_s, train_s)
            a, s = statistics.mean(async_times), statistics.mean(sync_times)
            cases.append(
                {
                    "case": name,
                    "train_step_s": round(train_s, 4),
                    "rollout_s_per_step_at_full_concurrency": round(rollout_s, 4),
                    "ideal_bound_s": round(bound, 4),
                    "async_step_s": round(a, 4),
                    "sync_step_s": round(s, 4),
                    "async_over_bound": round(a / bound, 4),
                    "speedup_over_sync": round(s / a, 3),
                }
            )
        overhead = controller_overhead(Path(tmp))
    result = {
        "benchmark": "pipeline",
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "setup": {
            "groups_per_step": B,
            "samples_per_group": N,
            "latency_p50_s": LATENCY.p50,
            "latency_p99_s": LATENCY.p99,
            "steps": args.steps,
            "time": "virtual (looptime)",
        },
        "cases": cases,
        "controller_overhead_real_time": {k: round(v, 2) for k, v in overhead.items()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    header = ("case", "train s", "bound s", "async s", "sync s", "async/bound", "speedup")
    print(f"{header[0]:14} " + " ".join(f"{h:>{12 if h == 'async/bound' else 8}}" for h in header[1:]))
    for c in cases:
        print(
            f"{c['case']:14} {c['train_step_s']:8.3f} {c['ideal_bound_s']:8.3f} {c['async_step_s']:8.3f} "
            f"{c['sync_step_s']:8.3f} {c['async_over_bound']:12.3f} {c['speedup_over_sync']:8.2f}x"
        )
    print(
        f"controller overhead (real time): {overhead['groups_per_s']:.0f} groups/s, "
        f"{overhead['samples_per_s']:.0f} samples/s"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
