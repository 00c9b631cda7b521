"""`python -m benchmarks.simulate --validate`: does the simulator predict a real run's step time?

Repeated REPEATS times (each with a fresh engine and trainer); reported: every repeat's ratios and, per
quantity, the median and the spread (min, max).

1. Build the tiny Llama (random init, char tokenizer) and start ONE embedded engine (real HTTP server,
   real model) on loopback.
2. The real run: the Controller, that engine (through the EngineRouter) and a real trainer rank
   (TrainerActor, gloo, GRPO + TIS, disk weight sync), `steps` steps.
3. Right after it, on the same engine, ROUNDS rounds of (a) the engine calibration then (b) the
   rollout-alone checks; each round is calibrated and predicted on its own (this machine's speed drifts
   over seconds, so a round's calibration and checks are measured back to back).
   (a) Closed-loop load: for each concurrency c, requests of the task's held-out prompts (a fresh prompt
   per N requests, as per group) with `ignore_eos` and VARIED lengths (±50% around 0.5× and 1.5× the
   run's mean response length: the engine's cost per request depends on how many start per decode step),
   c in flight, each finished request replaced at once through the same client and limiter — the
   staggered arrivals a rollout produces. (Equal lengths finish together and come back in waves; a burst
   of simultaneous requests, the old calibration, batches the arrivals' handling and made the model
   optimistic: 0.73-0.91 at 8 in flight.) Under staggered traffic each request costs the engine more
   than its prefill: its own prefill forward, its HTTP handling on the engine's event loop (between and,
   for the GIL, during decode steps) and the prefix-cache lookup (a scan of every entry of the current
   weights, ~20 µs each); engine steps traced on this machine: 0.55-0.9 ms gaps between steps under
   rollout traffic vs 0.3-0.4 ms in a burst. The prefix cache is flushed before every load and check:
   in the run each weight update leaves only the prompts since the previous one.
   (b) The rollout alone: 16 groups through the real pool and limiter, in-flight bounds 8 and 64.
4. Calibrate the engine model from (a) only, by indirect inference: a simple estimator (per c: decode
   step time t(c) from the difference of the two lengths; the rest of a request's cycle, which the c
   requests in flight spend in turn on the engine, as engine seconds per request start h(c)) is applied
   to the measured walls and to the simulated walls of the SAME closed-loop workload on the fake engine,
   and t(c), h(c) are corrected until the two estimates agree (`calibrate_engine`; the fitted model then
   reproduces the calibration walls within about 1%). The rest from the run's own metrics: response
   lengths of the steps after the warm-up, trainer time per step as a + b × tokens (perf/train_seconds),
   weight-sync seconds.
5. Simulate the same config with those numbers (the step time: with round 1's engine calibration);
   report predicted / measured mean step time (after the warm-up steps) and, per round, predicted /
   measured rollout-alone wall time. The controller's own work per sample (pool, limiter, tokenizer,
   reward) was measured apart at 0.04-0.1 ms and is not modelled.
The tiny model's CPU trainer dominates the step (and runs several times slower while the engine
decodes: both share this machine's 2 cores), so the step time mostly checks the pipeline overlap and
the trainer calibration; the rollout-alone checks test the engine model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import looptime
import structlog

from benchmarks.engine import ALPHABET, _run_batch
from benchmarks.sim_run import SimConfig, run_sim
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
from miles_aio.data.source import DataSource, PromptRecord, encode_prompt
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.local_launch import launch_local_engines
from miles_aio.inference.router import EngineRouter
from miles_aio.models import build_tiny_llama
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import LimitedEngine, RolloutContext
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import RolloutPool
from miles_aio.tasks.arithmetic import make_splits
from miles_aio.testing import EmpiricalLengths, FakeLatencyEngine, FakeTokenizer
from miles_aio.types import Group

B, N, MAX_LEN, MAX_RUNNING, WARMUP = 8, 8, 24, 64, 3
REPEATS, ROUNDS = 3, 3  # independent real runs; interleaved calibration/rollout rounds after each
ROLLOUT_GROUPS, ROLLOUT_BOUNDS = 16, (8, 64)  # the rollout-alone check: groups, in-flight bounds
CALIBRATION_CONCURRENCY = (8, 32, MAX_RUNNING)
CALIBRATION_SPAN = (0.5, 1.5)  # the calibration loads' mean lengths: these × the run's mean response length


def calibration_means(mean_response_len: float) -> tuple[int, int]:
    """Mean lengths of the two calibration loads, bracketing the workload's mean response length (the
    engine's cost per request depends on how many requests start per decode step)."""
    lo, hi = (max(2, round(f * mean_response_len)) for f in CALIBRATION_SPAN)
    return lo, max(hi, lo + 4)


CALIBRATION_ITERATIONS = 8


def calibration_requests(c: int) -> int:
    """Requests of one closed-loop calibration load with `c` in flight (enough to reach steady state)."""
    return max(16, 8 * c) if c <= 8 else 4 * c


def calibration_lengths(c: int, mean_tokens: int) -> list[int]:
    """The lengths of one calibration load: uniform in mean ± mean/2, in a fixed pseudo-random order.
    Varied, so that requests finish (and are replaced) one by one as in a rollout; equal lengths would
    finish together and arrive in waves, like a burst."""
    rng = random.Random(1000 * c + mean_tokens)
    half = mean_tokens // 2
    return [rng.randint(mean_tokens - half, mean_tokens + half) for _ in range(calibration_requests(c))]


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append(dict(metrics))

    def close(self) -> None:
        return None


class _LengthRecordingTrainer:
    """Delegates to the real trainer; records the response lengths of every step's trained samples."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.lengths = inner, list[list[int]]()

    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        self.lengths.append([s.response_length for g in batch for s in g])
        result: dict[str, float] = await self.inner.train(step, batch)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b = 0 if x does not vary)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    return my - b * mx, b


# -- the engine calibration: a closed-loop load, real and simulated ------------------------------------
async def closed_loop(
    engine: InferenceEngine, prompts: Iterator[list[int]], c: int, mean_tokens: int
) -> float:
    """Seconds for the requests of `calibration_lengths(c, mean_tokens)` (each exactly that long) with `c`
    in flight (limiter as in the pool: a finished request's slot goes to the next at once). Every N
    requests share the next prompt, as a group's samples do."""
    limited = LimitedEngine(engine, Limiter(c))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ids: list[int] = []
    async with asyncio.TaskGroup() as tg:
        for i, n in enumerate(calibration_lengths(c, mean_tokens)):
            ids = next(prompts) if i % N == 0 else ids
            params = {"max_new_tokens": n, "ignore_eos": True, "temperature": 1.0}
            tg.create_task(limited.generate(input_ids=ids, sampling_params=params))
    return loop.time() - t0


@dataclasses.dataclass(frozen=True)
class EngineParams:
    """The fake engine's parameters, by running requests c: decode step seconds t(c), and engine seconds
    per request start h(c) (its prefill and its handling on the engine: decoding waits)."""

    curve: tuple[tuple[int, float], ...]
    start: tuple[tuple[int, float], ...]

    def engine(self, lengths: Any) -> FakeLatencyEngine:
        return FakeLatencyEngine(
            lengths=lengths, max_running=MAX_RUNNING, per_token_curve=self.curve, prefill_curve=self.start
        )


def estimate(walls: dict[int, dict[int, float]]) -> EngineParams:
    """The simple estimator: per concurrency c (n requests of mean lengths L1 < L2, c in flight), decode
    step time t(c) = c (W2 - W1) / (n (L2 - L1)), and per request the rest of its cycle,
    o(c) = c W1 / n - L1 t(c), which the c requests in flight spend in turn on the engine: h(c) = o(c) / c.
    (Measured with one request in flight, o(1) was 0.1-3 ms here, noisy: an upper bound on any latency
    outside the engine, so none is modelled apart.)"""
    curve, start = [], []
    for c, w in sorted(walls.items()):
        (m1, w1), (m2, w2) = sorted(w.items())
        (l1, l2), n = (statistics.fmean(calibration_lengths(c, m)) for m in (m1, m2)), calibration_requests(c)
        t = c * (w2 - w1) / (n * (l2 - l1))
        curve.append((c, t))
        start.append((c, (c * w1 / n - l1 * t) / c))
    return EngineParams(tuple(curve), tuple(start))


def _simulated_walls(params: EngineParams, means: Sequence[int]) -> dict[int, dict[int, float]]:
    """The calibration workload on the fake engine (virtual time)."""
    out: dict[int, dict[int, float]] = {}
    for c in CALIBRATION_CONCURRENCY:
        for n in means:
            loop = looptime.new_event_loop(start=0.0)
            try:
                engine = params.engine(lambda rng: 1_000_000)  # every request runs to max_new_tokens
                out.setdefault(c, {})[n] = loop.run_until_complete(
                    closed_loop(engine, itertools.repeat([3] * 6), c, n)
                )
            finally:
                loop.close()
    return out


def _step(
    params: tuple[tuple[int, float], ...],
    target: tuple[tuple[int, float], ...],
    got: tuple[tuple[int, float], ...],
    floor: float,
) -> tuple[tuple[int, float], ...]:
    return tuple(
        (c, max(x + (tx - gx), floor)) for (c, x), (_, tx), (_, gx) in zip(params, target, got, strict=True)
    )


def calibrate_engine(walls: dict[int, dict[int, float]]) -> tuple[EngineParams, float]:
    """Indirect inference: find the fake engine's parameters whose SIMULATED closed-loop walls give the
    same `estimate` as the measured walls (the estimator's biases — ramp-up, drain, concurrency varying
    as requests start — then cancel). Returns the parameters and the largest relative error of the
    simulated calibration walls against the measured ones."""
    target = estimate(walls)
    params = EngineParams(
        _step(target.curve, target.curve, target.curve, 1e-6),
        _step(target.start, target.start, target.start, 0.0),
    )
    best, best_err = params, math.inf
    for _ in range(CALIBRATION_ITERATIONS):
        sim_walls = _simulated_walls(params, sorted(next(iter(walls.values()))))
        err = max(abs(sim_walls[c][n] / walls[c][n] - 1) for c in walls for n in walls[c])
        if err < best_err:
            best, best_err = params, err
        if err < 0.005:
            break
        got = estimate(sim_walls)
        params = EngineParams(
            _step(params.curve, target.curve, got.curve, 1e-6),
            _step(params.start, target.start, got.start, 0.0),
        )
    return best, best_err


# -- the real run and the rollout-alone checks ---------------------------------------------------------
def _run_config(run_dir: Path, steps: int) -> RunConfig:
    return RunConfig(
        data=DataConfig(),
        rollout=RolloutConfig(
            rollout_batch_size=B,
            n_samples_per_prompt=N,
            rollout_max_response_len=MAX_LEN,
            custom_rm_path="miles_aio.tasks.arithmetic:answer_reward",
        ),
        scheduler=SchedulerConfig(max_admission_staleness=2),
        buffer=BufferConfig(),
        driver=DriverConfig(num_rollout=steps),
        train=TrainConfig(
            use_tis=True, global_batch_size=B * N, micro_batch_size=B * N, update_weight_transfer_mode="disk"
        ),
        run_dir=run_dir,
    )


async def _real(model: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from miles_aio.trainer.actor import TrainerActor

    cfg = _run_config(run_dir, steps)
    extra = ["--max-running-requests", str(MAX_RUNNING), "--log-level", "WARNING"]
    async with launch_local_engines(model, num_engines=1, weights_root=run_dir, extra_args=extra) as urls:
        await _run_batch(urls[0], 1, 8)  # warm-up
        train, held_out = make_splits()
        source = DataSource(
            [PromptRecord(p.prompt, label=p.answer) for p in train],
            n_samples_per_prompt=N,
            seed=0,
            shuffle=True,
        )
        tok: Any = AutoTokenizer.from_pretrained(model)
        rec = _Recorder()
        async with (
            EngineRouter.open(urls) as router,
            TrainerActor.open(
                dataclasses.replace(cfg.train, hf_checkpoint=model), cfg, run_dir=run_dir
            ) as tr,
        ):
            trainer = _LengthRecordingTrainer(tr)
            controller = Controller(
                cfg,
                engine=router,
                trainer=trainer,
                source=source,
                plugins=resolve_plugins(cfg),
                tokenizer=tok,
                sinks=[rec],
                write_files=False,
            )
            summary = await controller.run()
            # the engine measured apart from the run, right after it, interleaved with the
            # rollout-alone tries (this machine's background load changes over seconds)
            # the task's held-out prompts, a fresh one per group as in a rollout (more of them than the
            # engine's prefix cache keeps, so none is reused from it)
            prompts = itertools.cycle([encode_prompt(tok, p.prompt) for p in held_out])
            await closed_loop(router, prompts, MAX_RUNNING, 2)  # warm-up: the router's connections
            # Every load starts with the engine's prefix cache flushed: its lookups scan every entry of
            # the current weights (~20 µs each here), and in the run each weight update leaves only the
            # prompts since the last one; without the flush later loads would meet a full cache.
            steady = [n for step in trainer.lengths[WARMUP:] for n in step]
            means = calibration_means(statistics.fmean(steady) if steady else MAX_LEN / 2)
            rounds = []
            for _ in range(ROUNDS):
                walls: dict[int, dict[int, float]] = {}
                for c in CALIBRATION_CONCURRENCY:
                    for n in means:
                        await router.flush_cache()
                        walls.setdefault(c, {})[n] = await closed_loop(router, prompts, c, n)
                tries = {}
                for b in ROLLOUT_BOUNDS:
                    await router.flush_cache()
                    tries[b] = await _rollout_once(cfg, router, tok, source, b)
                rounds.append(
                    {
                        "walls": walls,
                        "phases": [{"bound": b, "wall_s": w, "lengths": ls} for b, (w, ls) in tries.items()],
                    }
                )
    return {
        "rounds": rounds,
        "rows": rec.rows,
        "step_times": summary.step_times_s,
        "lengths": trainer.lengths,
    }


def _pool(cfg: RunConfig, engine: Any, bound: int, tokenizer: Any) -> RolloutPool:
    plugins = resolve_plugins(cfg)
    ctx = RolloutContext(
        engine=LimitedEngine(engine, Limiter(bound)),
        tokenizer=tokenizer,
        config=cfg,
        log=structlog.get_logger("miles_aio.validate"),
    )
    return RolloutPool(ctx=ctx, generate_fn=plugins.generate_fn, reward_fn=plugins.reward_fn)


async def _generate_groups(pool: RolloutPool, source: DataSource) -> list[int]:
    """ROLLOUT_GROUPS groups at once through the pool (its limiter bounds the requests in flight)."""
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(pool.run_group(source.next_group(), on_sample_done=lambda: None))
            for _ in range(ROLLOUT_GROUPS)
        ]
    return [s.response_length for t in tasks for s in t.result()]


async def _rollout_once(
    cfg: RunConfig, engine: Any, tokenizer: Any, source: DataSource, bound: int
) -> tuple[float, list[int]]:
    """Rollout alone on the real engine: wall time of ROLLOUT_GROUPS groups with `bound` in flight."""
    t0 = time.perf_counter()
    lengths = await _generate_groups(_pool(cfg, engine, bound, tokenizer), source)
    return time.perf_counter() - t0, lengths


def _simulated_phase(cfg: RunConfig, params: EngineParams, phase: dict[str, Any]) -> float:
    """The same rollout phase with the calibrated FAKE engine, on virtual time."""
    engine = params.engine(EmpiricalLengths(phase["lengths"]))
    source = DataSource(
        [PromptRecord(f"p{i}") for i in range(ROLLOUT_GROUPS)], n_samples_per_prompt=N, seed=0, shuffle=False
    )
    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(_generate_groups(_pool(cfg, engine, phase["bound"], FakeTokenizer()), source))
        return loop.time()
    finally:
        loop.close()


# -- one repeat: calibrate, predict, compare ------------------------------------------------------------
def _repeat(model: Path, tmp: Path, steps: int, index: int) -> dict[str, Any]:
    run_dir = tmp / f"run{index}"
    run_dir.mkdir()
    real = asyncio.run(_real(model, run_dir, steps))
    rc = _run_config(run_dir, steps)
    rounds = []  # per round: the engine calibrated from its closed-loop loads, its rollout tries predicted
    for rd in real["rounds"]:
        params, err = calibrate_engine(rd["walls"])
        phases = [
            {
                "in_flight": ph["bound"],
                "groups": ROLLOUT_GROUPS,
                "measured_s": ph["wall_s"],
                "predicted_s": (pred := _simulated_phase(rc, params, ph)),
                "predicted_over_measured": pred / ph["wall_s"],
            }
            for ph in rd["phases"]
        ]
        rounds.append({"engine": params, "error": err, "walls": rd["walls"], "rollout_phases": phases})
    engine, calib_err = (
        rounds[0]["engine"],
        rounds[0]["error"],
    )  # the step time: the round right after the run
    conc = [c for c, _ in engine.curve]
    per_token = [t for _, t in engine.curve]
    base, slope = _fit([float(c) for c in conc], per_token)
    rows = real["rows"][WARMUP:]
    tokens, train_s = [r["rollout/tokens"] for r in rows], [r["perf/train_seconds"] for r in rows]
    train_a, train_b = _fit(tokens, train_s)
    if train_a < 0 or train_b < 0:  # too little spread in tokens per step: proportional model
        train_a, train_b = 0.0, statistics.fmean(train_s) / statistics.fmean(tokens)
    sync_s = statistics.fmean(r["perf/weight_sync_seconds"] for r in rows)
    lengths = [n for step in real["lengths"][WARMUP:] for n in step]  # the steps the averages cover
    lengths_file = tmp / f"lengths{index}.json"
    lengths_file.write_text(json.dumps(lengths))
    sim = SimConfig(
        rollout_batch_size=B,
        n_samples_per_prompt=N,
        num_rollout=steps,
        warmup_steps=WARMUP,
        rollout_max_response_len=MAX_LEN,
        max_admission_staleness=2,
        lengths_from=str(lengths_file),
        base_per_token_s=max(base, 1e-6),
        slope_per_token_s=max(slope, 0.0),
        per_token_curve=",".join(f"{c}:{t}" for c, t in engine.curve),
        prefill_curve=",".join(f"{c}:{t}" for c, t in engine.start),
        max_running=MAX_RUNNING,
        train_step_s=max(train_a, 0.0),
        train_per_token_s=max(train_b, 0.0),
        sync_s=sync_s,
    )
    predicted = run_sim(sim)
    measured = statistics.fmean(real["step_times"][WARMUP:])
    return {
        "calibration": {
            "engine_per_token_s_vs_concurrency": dict(zip(conc, per_token, strict=True)),
            "engine_start_s_vs_concurrency": dict(engine.start),
            "engine_base_per_token_s": base,
            "engine_slope_per_token_s": slope,
            "engine_calibration_walls_s": {
                str(c): {str(n): w for n, w in ws.items()} for c, ws in rounds[0]["walls"].items()
            },
            "engine_calibration_max_error": calib_err,
            "engine_calibration_mean_lengths": sorted(next(iter(rounds[0]["walls"].values()))),
            "trainer_step_s": train_a,
            "trainer_per_token_s": train_b,
            "weight_sync_s": sync_s,
            "mean_response_len": statistics.fmean(lengths) if lengths else 0.0,
        },
        "measured_step_time_s": measured,
        "measured_trainer_idle_ratio": statistics.fmean(r["perf/trainer_idle_ratio"] for r in rows),
        "predicted_step_time_s": predicted["step_time_s"],
        "predicted_trainer_idle_ratio": predicted["trainer_idle_ratio"],
        "predicted_over_measured": predicted["step_time_s"] / measured,
        "prediction": predicted,
        "rounds": [
            {
                "engine_per_token_s_vs_concurrency": dict(r["engine"].curve),
                "engine_start_s_vs_concurrency": dict(r["engine"].start),
                "engine_calibration_max_error": r["error"],
                "rollout_phases": r["rollout_phases"],
            }
            for r in rounds
        ],
    }


def _spread(ratios: Sequence[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "ratios": list(ratios),
    }


def _print_repeat(i: int, r: dict[str, Any]) -> None:
    c = r["calibration"]
    curve = " ".join(f"{k}:{t * 1e3:.2f}" for k, t in c["engine_per_token_s_vs_concurrency"].items())
    start = " ".join(f"{k}:{t * 1e3:.2f}" for k, t in c["engine_start_s_vs_concurrency"].items())
    print(
        f"[repeat {i + 1}] engine ms by running requests: decode step {curve}; per request start {start} "
        f"(calibration walls reproduced within {c['engine_calibration_max_error']:.1%})"
    )
    print(
        f"[repeat {i + 1}] trainer {c['trainer_step_s']:.3f} s + {c['trainer_per_token_s']:.6f} s/token, "
        f"sync {c['weight_sync_s']:.3f} s; step time measured {r['measured_step_time_s']:.3f} s, "
        f"predicted {r['predicted_step_time_s']:.3f} s, ratio {r['predicted_over_measured']:.3f}"
    )
    for k, rd in enumerate(r["rounds"]):
        for ph in rd["rollout_phases"]:
            print(
                f"[repeat {i + 1} round {k + 1}] rollout alone, {ph['groups']} groups with "
                f"{ph['in_flight']} in flight: measured {ph['measured_s']:.3f} s, predicted "
                f"{ph['predicted_s']:.3f} s, ratio {ph['predicted_over_measured']:.3f}"
            )


def validate(*, steps: int = 12, repeats: int = REPEATS) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp) / "model", alphabet=ALPHABET)
        for i in range(repeats):
            runs.append(_repeat(model, Path(tmp), steps, i))
            _print_repeat(i, runs[-1])
    step = _spread([r["predicted_over_measured"] for r in runs])
    rollout = {
        str(b): _spread(
            [
                ph["predicted_over_measured"]
                for r in runs
                for rd in r["rounds"]
                for ph in rd["rollout_phases"]
                if ph["in_flight"] == b
            ]
        )
        for b in ROLLOUT_BOUNDS
    }
    median_run = sorted(runs, key=lambda r: r["predicted_over_measured"])[len(runs) // 2]
    result = {
        "benchmark": "simulate",
        "mode": "validate",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "setup": {
            "groups_per_step": B,
            "samples_per_group": N,
            "max_response_len": MAX_LEN,
            "steps": steps,
            "repeats": repeats,
            "rounds": ROUNDS,
            "calibration_concurrency": list(CALIBRATION_CONCURRENCY),
            "calibration_span_of_mean_response": list(CALIBRATION_SPAN),
            "calibration_lengths": runs[0]["calibration"]["engine_calibration_mean_lengths"],
            "rollout_groups": ROLLOUT_GROUPS,
        },
        "step_time_ratio": step,
        "rollout_ratio_by_in_flight": rollout,
        "predicted_over_measured": step["median"],
        # the repeat with the median step-time ratio, for its calibration and figures
        "calibration": median_run["calibration"],
        "measured_step_time_s": median_run["measured_step_time_s"],
        "predicted_step_time_s": median_run["predicted_step_time_s"],
        "measured_trainer_idle_ratio": median_run["measured_trainer_idle_ratio"],
        "predicted_trainer_idle_ratio": median_run["predicted_trainer_idle_ratio"],
        "repeats": runs,
        "wall_s": time.perf_counter() - t0,
    }
    print(f"predicted / measured step time: median {step['median']:.3f} (min {step['min']:.3f}, "
          f"max {step['max']:.3f}) over {repeats} repeats")  # fmt: skip
    for b, s in rollout.items():
        print(f"predicted / measured rollout alone, {b} in flight: median {s['median']:.3f} "
              f"(min {s['min']:.3f}, max {s['max']:.3f})")  # fmt: skip
    print(f"validation took {result['wall_s']:.0f} s")
    return result
