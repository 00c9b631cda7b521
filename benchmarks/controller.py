"""The single controller at cluster scale: what one Python process drives, from 1 to 1,024 engines.

    python -m benchmarks.controller [--quick] [--output bench-results/controller.json] [--plot PNG]
                                    [--uvloop] [--real-seconds S] [--profile N]

What runs: the real `Controller` (admission, pool, limiter, buffer, drains, step loop, metrics) with the
simulator's engines (`benchmarks.sim_run.sim_engine`: `FakeLatencyEngine`'s continuous-batching model,
`max_running` requests per engine, a decode step of base + slope × running seconds) and a zero-time
trainer. Three parts:

  ceiling  real time, one core, engines that answer at once (a decode step of 1 ns): the most samples/s
           and requests/s the controller's own path sustains (worker → pool → limiter → engine → buffer →
           drain → metrics), at 1 and at ~200 response tokens per sample and 1 and 4 turns per sample;
           and the same path with no engine model at all (`InstantEngine`: each request answered on the
           next loop pass, as an HTTP response wakes its future; `ceiling/i` in the printed table), the
           controller's cost alone.
  scale    virtual time (looptime): 1 … 1,024 engines × 64 running requests each (up to 65,536 in
           flight), 1 and 4 turns. The engines' figures (samples/s of the simulated cluster) are what the
           cluster would do; the controller's CPU per sample, measured in real time over the run, says
           what one core can drive: ceiling = 1 s / CPU per sample, and the cluster size at which the
           demand reaches it (`docs/guide/scaling.md`).
  lag      real time, with requests that take seconds: up to 50,000 in flight, event-loop lag
           p50/p99/max (how late a 10 ms sleep wakes, between the warm-up third and the stop; the
           stop's longest stall apart, as `stop_loop_lag_ms_max`), resident memory and memory per
           in-flight request.

CPU per sample is the process's CPU time over the run divided by samples: it includes the fake engines'
own bookkeeping (a few µs per request, kept out of their token draws by `fast_ids`), so it is an upper
bound of the controller's. Figures are noisy on a shared machine: compare ratios within one run; the
machine is named in the output. `--profile N` prints the cProfile table (by own time) of one ceiling
case, the top N rows. `--quick` is the CI smoke version (a few seconds; no figure is asserted).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import gc
import importlib
import json
import os
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import looptime
import structlog

from benchmarks.sim_run import SimConfig, sim_engine
from benchmarks.soak import monitor, rss_mib
from miles_aio.controller import Controller
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.single_turn import prompt_token_ids
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer
from miles_aio.types import GenerateOutput, RunSummary, Sample, Status

__all__ = ["Case", "InstantEngine", "main", "measure", "multi_turn"]

T = TypeVar("T")
N = 8  # samples per group
TOOL_IDS = list(range(16))  # a tool's answer between two turns: 16 tokens, not trained on
_turns = 1  # turns per sample of `multi_turn` (set by `measure` for its case: one run at a time)


async def multi_turn(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """An agent-like rollout: `_turns` engine calls, each on the whole context so far, with a tool's
    answer (`TOOL_IDS`) appended between two of them."""
    prompt_token_ids(ctx, sample)
    for turn in range(_turns):
        out = await ctx.engine.generate(
            input_ids=sample.tokens, sampling_params=sampling_params, routing_key=sample.group_index
        )
        sample.append(out)
        if sample.status != Status.COMPLETED or turn == _turns - 1:
            break
        sample.append_context(TOOL_IDS)
    return sample


@dataclass(frozen=True, kw_only=True)
class Case:
    """One measured run."""

    part: str  # ceiling | scale | lag
    engines: int
    per_engine: int  # requests each engine decodes at once (max_running): in flight = engines × this
    turns: int = 1
    p50_tokens: float = 100.0
    p99_tokens: float = 1000.0
    per_token_s: float = 0.02  # decode step with no other request running
    steps: int = 6
    engine: str = "sim"  # sim (the simulator's engines) | instant (`InstantEngine`: no engine model)
    clock: str = "virtual"  # virtual | real
    seconds: float = 0.0  # real clock with seconds > 0: run for that long, then stop

    @property
    def in_flight(self) -> int:
        return self.engines * self.per_engine

    @property
    def groups_per_step(self) -> int:
        # a quarter of what is in flight per step: the drain never waits on one slow sample, and the
        # buffer (one step's worth) stays small beside the in-flight requests
        return max(2, self.in_flight // (4 * N))

    def sim(self) -> SimConfig:
        return SimConfig(
            rollout_batch_size=self.groups_per_step,
            n_samples_per_prompt=N,
            num_rollout=self.steps if self.seconds == 0 else 10**6,
            async_max_concurrent_samples=str(self.in_flight),
            async_data_buffer_capacity_factor=1.0,
            p50_tokens=self.p50_tokens,
            p99_tokens=self.p99_tokens,
            base_per_token_s=self.per_token_s,
            slope_per_token_s=self.per_token_s / 200,  # throughput per request falls with concurrency
            max_running=self.per_engine,
            num_engines=self.engines,
            train_step_s=0.0,
            sync_s=0.0,
        )


class InstantEngine(FakeLatencyEngine):
    """A FAKE engine with no engine model: every request gets one token at the current version, on the
    loop's next pass (as a response read from a socket wakes its request) — what is left to measure is
    the controller's own path."""

    def __init__(self) -> None:
        super().__init__(lengths=lambda rng: 1.0)
        self._live = 0

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self.requests += 1
        self._live += 1
        self.max_in_flight = max(self.max_in_flight, self._live)
        try:
            await asyncio.sleep(0)
        finally:
            self._live -= 1
        return GenerateOutput(
            text="",
            output_ids=[7],
            output_log_probs=[-1.0],
            weight_versions=[self.version],
            finish_reason="stop",
            prompt_tokens=len(input_ids),
        )


class _StepRss:
    """A metrics sink: the resident memory at every step (virtual or real clock alike)."""

    def __init__(self) -> None:
        self.rss: list[float] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rss.append(rss_mib())

    def close(self) -> None:
        return None


def _controller(case: Case, run_dir: Path) -> tuple[Controller, Any, _StepRss]:
    global _turns
    _turns = case.turns
    # the plug-in path imports this module by name, which is another module object than `__main__`
    vars(importlib.import_module("benchmarks.controller"))["_turns"] = case.turns
    sim = case.sim()
    rc = sim.run_config(run_dir)
    if case.turns > 1:
        rollout = dataclasses.replace(
            rc.rollout, custom_generate_function_path="benchmarks.controller:multi_turn"
        )
        rc = dataclasses.replace(rc, rollout=rollout)
    engine = InstantEngine() if case.engine == "instant" else sim_engine(sim, fast_ids=True)
    groups = (case.steps + 2) * case.groups_per_step + case.in_flight // N
    records = [PromptRecord(f"p{i}") for i in range(max(1000, min(groups, 100_000)))]
    rss = _StepRss()
    controller = Controller(
        rc,
        engine=engine,
        trainer=FakeTrainer(step_time_s=0.0, keep_batches=False),
        source=DataSource(records, n_samples_per_prompt=N, seed=0, shuffle=False),
        plugins=resolve_plugins(rc),
        tokenizer=FakeTokenizer(),
        num_engines=case.engines,
        sinks=[rss],
        write_files=False,
    )
    return controller, engine, rss


async def _run_real(
    controller: Controller, seconds: float, lags: list[float], stopped_at: list[int]
) -> RunSummary:
    """The controller beside the lag monitor (`benchmarks.soak.monitor`); stopped after `seconds` if > 0
    (`stopped_at` gets the number of lag samples taken before the stop: its stall is not steady state)."""
    stop = asyncio.Event()
    rss: list[tuple[float, float]] = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(monitor(stop, lags, rss), name="lag-monitor")
        run = tg.create_task(controller.run(), name="controller")
        if seconds > 0:
            await asyncio.sleep(seconds)
            stopped_at.append(len(lags))
            controller.request_stop()
        try:
            summary = await run
        finally:
            stop.set()
    return summary


def _loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop]:
    if use_uvloop:
        # optional (--uvloop only), never a dependency: imported by name, untyped
        factory: Callable[[], asyncio.AbstractEventLoop] = importlib.import_module("uvloop").new_event_loop
        return factory
    return asyncio.new_event_loop


def _on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> tuple[T, float]:
    """The coroutine's result and the loop's clock when it ended (virtual seconds under looptime)."""
    try:
        start = loop.time()
        result = loop.run_until_complete(coro)
        return result, loop.time() - start
    finally:
        loop.close()


def measure(
    case: Case, *, use_uvloop: bool = False, profile: cProfile.Profile | None = None
) -> dict[str, Any]:
    """Run one case; its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        controller, engine, rss = _controller(case, Path(tmp))
        gc.collect()
        rss0 = rss_mib()
        lags: list[float] = []
        stopped_at: list[int] = []
        if case.clock == "virtual":
            # no-op cycles before each jump of the clock: looptime spins 42 by default, most of the CPU here
            loop: asyncio.AbstractEventLoop = looptime.new_event_loop(start=0.0, noop_cycles=1)
            coro: Coroutine[Any, Any, RunSummary] = controller.run()
        else:
            loop = _loop_factory(use_uvloop)()
            coro = _run_real(controller, case.seconds, lags, stopped_at)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            summary, loop_s = _on(loop, coro)
        finally:
            if profile is not None:
                profile.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    samples = summary.steps * case.groups_per_step * N
    requests = engine.requests
    result: dict[str, Any] = {
        **{k: v for k, v in dataclasses.asdict(case).items() if k not in ("steps", "seconds")},
        "in_flight": case.in_flight,
        "steps": summary.steps,
        "samples": samples,
        "requests": requests,
        "max_in_flight_requests": engine.max_in_flight,
        "cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "cpu_us_per_sample": round(1e6 * cpu / max(samples, 1), 1),
        "cpu_us_per_request": round(1e6 * cpu / max(requests, 1), 1),
        # what one core could drive: the controller's CPU per request, inverted, per turns (requests, not
        # trained samples: the requests still in flight at the end cost CPU too)
        "ceiling_samples_per_s": round(requests / cpu / case.turns) if cpu > 0 else None,
        "rss_mib": {"before": round(rss0, 1), "peak_step": round(max(rss.rss, default=rss0), 1)},
    }
    if case.clock == "virtual":
        # (summary.wall_s is the controller's monotonic clock: real seconds, not the loop's)
        result["virtual_s"] = round(loop_s, 2)
        # the simulated cluster's rate (engines-bound): what the controller must keep up with
        result["cluster_samples_per_s"] = round(samples / loop_s, 1) if loop_s else None
        result["cluster_requests_per_s"] = round(requests / loop_s, 1) if loop_s else None
    else:
        result["samples_per_s"] = round(samples / wall, 1)
        result["requests_per_s"] = round(requests / wall, 1)
        result["uvloop"] = use_uvloop
        end = stopped_at[0] if stopped_at else len(lags)
        warm = lags[end // 3 : end] or lags
        if stopped_at and lags[end:]:
            result["stop_loop_lag_ms_max"] = round(max(lags[end:]) * 1000, 2)
        if len(warm) >= 2:
            q = statistics.quantiles([x * 1000 for x in warm], n=100, method="inclusive")
            result["loop_lag_ms"] = {
                "p50": round(q[49], 2),
                "p99": round(q[98], 2),
                "max": round(max(warm) * 1000, 2),
            }
        grown = max(rss.rss, default=rss0) - rss0
        result["rss_kib_per_in_flight_request"] = round(1024 * grown / case.in_flight, 1)
    return result


def cases(quick: bool, real_seconds: float) -> list[Case]:
    """The runs of one invocation: ceiling, scale and lag cases (a few small ones with --quick)."""

    def zero(**kw: Any) -> Case:  # real time, engines that answer at once (a 1 ns decode step)
        return Case(part="ceiling", clock="real", per_token_s=1e-9, **kw)

    if quick:
        return [
            zero(engines=1, per_engine=128, p50_tokens=1, p99_tokens=1, steps=4),
            zero(engines=1, per_engine=128, p50_tokens=1, p99_tokens=1, steps=4, engine="instant"),
            zero(engines=1, per_engine=128, turns=4, steps=2),
            Case(part="scale", engines=8, per_engine=64, steps=3),
            Case(part="scale", engines=8, per_engine=64, turns=4, steps=2),
            Case(part="lag", engines=4, per_engine=64, clock="real", per_token_s=0.0005, seconds=1.0),
        ]
    ceiling = [
        zero(engines=1, per_engine=128, p50_tokens=1, p99_tokens=1, steps=150),
        zero(engines=1, per_engine=128, steps=100),
        zero(engines=1, per_engine=128, turns=4, steps=40),
        zero(engines=16, per_engine=256, p50_tokens=1, p99_tokens=1, steps=12),
        zero(engines=16, per_engine=256, p50_tokens=1, p99_tokens=1, steps=40, engine="instant"),
    ]
    scale = [
        Case(part="scale", engines=e, per_engine=64, turns=t, steps=6 if e < 256 else 2)
        for t in (1, 4)
        for e in (1, 8, 64, 256, 1024)
        if t == 1 or e <= 256  # 4 turns at 1,024 engines: half a million requests, too long here
    ]
    lag = [
        Case(part="lag", engines=e, per_engine=50, clock="real", per_token_s=0.05, seconds=real_seconds)
        for e in (20, 200, 1000)
    ]
    return [*ceiling, *scale, *lag]


def _row(r: dict[str, Any]) -> str:
    lag = r.get("loop_lag_ms")
    rate = r.get("samples_per_s", r.get("cluster_samples_per_s"))
    part = r["part"] + ("/i" if r.get("engine") == "instant" else "")
    return (
        f"{part:10} {r['engines']:5} {r['in_flight']:7} {r['turns']:3} {r['samples']:8} "
        f"{rate or 0:10.0f} {r['cpu_us_per_sample']:9.1f} {r['cpu_us_per_request']:8.1f} "
        f"{r['ceiling_samples_per_s'] or 0:9} "
        + (f"{lag['p50']:6.2f} {lag['p99']:7.2f} {lag['max']:7.1f}" if lag else " " * 22)
        + f" {r['rss_mib']['peak_step']:8.0f}"
    )


HEADER = (
    f"{'part':10} {'eng':>5} {'flight':>7} {'trn':>3} {'samples':>8} {'samples/s':>10} {'cpu µs/s':>9} "
    f"{'µs/req':>8} {'ceiling':>9} {'lag50':>6} {'lag99':>7} {'lagmax':>7} {'rss MiB':>8}"
)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Three panels: CPU per request by engines (scale, per turns), cluster demand (requests/s, virtual
    time) vs what one core drives by engines, loop lag p50/p99 by requests in flight (lag)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    scale = [r for r in results if r["part"] == "scale"]
    for turns in sorted({r["turns"] for r in scale}):
        rows = sorted((r for r in scale if r["turns"] == turns), key=lambda r: r["engines"])
        xs = [r["engines"] for r in rows]
        axes[0].plot(xs, [r["cpu_us_per_request"] for r in rows], "o-", label=f"{turns} turn(s)/sample")
        if all("cluster_requests_per_s" in r for r in rows):
            demand = [r["cluster_requests_per_s"] for r in rows]
            axes[1].plot(xs, demand, "o-", label=f"cluster asks, {turns} turn(s)")
        core = [1e6 / r["cpu_us_per_request"] for r in rows]
        axes[1].plot(xs, core, "s--", label=f"1 core drives, {turns} turn(s)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines (64 running each)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("controller CPU µs per request")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("requests/s")
    axes[1].set_title("cluster demand vs one core's ceiling", fontsize=10)
    lag = sorted(
        (r for r in results if r["part"] == "lag" and "loop_lag_ms" in r), key=lambda r: r["in_flight"]
    )
    if lag:
        xs = [r["in_flight"] for r in lag]
        axes[2].plot(xs, [r["loop_lag_ms"]["p99"] for r in lag], "o-", label="p99")
        axes[2].plot(xs, [r["loop_lag_ms"]["p50"] for r in lag], "o-", label="p50")
        axes[2].axhline(10, color="gray", ls=":", label="10 ms target")
        axes[2].set_xscale("log")
        axes[2].set_xlabel("requests in flight (real time)")
        axes[2].set_ylabel("event-loop lag ms")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases only (CI smoke test)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/controller.json"))
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG; needs matplotlib)")
    parser.add_argument("--uvloop", action="store_true", help="real-time cases on uvloop (if installed)")
    parser.add_argument("--real-seconds", type=float, default=60.0, help="length of each lag case")
    parser.add_argument("--only", choices=("ceiling", "scale", "lag"), help="run one part only")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N of the first case")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    results = []
    print(HEADER)
    for i, case in enumerate(cases(args.quick, args.real_seconds)):
        if args.only and case.part != args.only:
            continue
        prof = cProfile.Profile() if args.profile and i == 0 else None
        results.append(measure(case, use_uvloop=args.uvloop, profile=prof))
        print(_row(results[-1]), flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    out = {
        "benchmark": "controller",
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "note": "shared machine: compare ratios within one run",
        },
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")
    if args.plot is not None:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return out


if __name__ == "__main__":
    main()
