"""`python -m benchmarks.simulate --validate`: does the simulator predict a real run's step time?

1. Build the tiny Llama (random init, char tokenizer) and start ONE embedded engine (real HTTP server,
   real model) on loopback.
2. Calibrate the engine SEPARATELY (just after the run, on the same engine): c concurrent
   `ignore_eos` requests of 4 and of 64 tokens for several c: decode step time(c) from the
   difference (a piecewise-linear curve), prefill and request latency from the rest
   (`calibrate_engine`).
3. The real run: the Controller, that engine (through the EngineRouter) and a real trainer rank
   (TrainerActor, gloo, GRPO + TIS, disk weight sync), `steps` steps.
4. Calibrate the rest from what the run measured: response lengths (resampled as recorded), trainer
   time per step as a + b × tokens (least squares on perf/train_seconds), weight-sync seconds.
5. Simulate the same config with those numbers; report predicted / measured mean step time (after
   the warm-up steps). The tiny model's CPU trainer is slow next to its engine, so that run is
   train-bound; to check the engine model too, rollout runs ALONE on the real engine (16 groups
   through the real pool and limiter, in-flight bounds 8 and 64) and is predicted the same way.
Engine and trainer share this machine's cores, which the simulator does not model: the ratios say
how much that matters here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import looptime
import structlog

from benchmarks.engine import ALPHABET, _run_batch
from benchmarks.simulate import SimConfig, run_sim
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
from miles_aio.inference.local import launch_local_engines
from miles_aio.inference.router import EngineRouter
from miles_aio.models import build_tiny_llama
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import LimitedEngine, RolloutContext
from miles_aio.rollout.limiter import Limiter
from miles_aio.rollout.pool import RolloutPool
from miles_aio.tasks.arithmetic import make_splits
from miles_aio.testing import FakeTokenizer
from miles_aio.testing.sim_engine import EmpiricalLengths, FakeBatchedEngine
from miles_aio.types import Group

B, N, MAX_LEN, MAX_RUNNING, WARMUP = 8, 8, 24, 64, 3
ROLLOUT_GROUPS, ROLLOUT_BOUNDS = 16, (8, 64)  # the rollout-alone check: groups, in-flight bounds
CALIBRATION_CONCURRENCY, CALIBRATION_LENGTHS, CALIBRATION_REPEATS = (1, 8, 32, MAX_RUNNING), (4, 64), 3


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append(dict(metrics))

    def close(self) -> None:
        return None


class _LengthRecordingTrainer:
    """Delegates to the real trainer; records the response length of every trained sample."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.lengths = inner, list[int]()

    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        self.lengths.extend(s.response_length for g in batch for s in g)
        result: dict[str, float] = await self.inner.train(step, batch)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x (b = 0 if x does not vary)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    return my - b * mx, b


async def _measure(engine: EngineRouter, batch: int, new_tokens: int) -> dict[str, Any]:
    """Wall time of `batch` concurrent `ignore_eos` generations of `new_tokens` each, through the same
    client and connections as the run (the engine decodes them as one continuous batch)."""
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(batch):
            ids = [3 + (i * 7 + j) % 40 for j in range(16)]
            tg.create_task(engine.generate(input_ids=ids, sampling_params=params))
    return {"batch": batch, "new_tokens": new_tokens, "wall_s": time.perf_counter() - t0}


def calibrate_engine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """From c concurrent requests of two lengths L1 < L2 (all arriving at once), per concurrency c:
    decode step time t(c) = (wall(c, L2) - wall(c, L1)) / (L2 - L1), and the rest of wall(c, L1) -
    L1 t(c) = latency + c × prefill (prefills serialize on the engine), fitted over c. Of repeated
    measurements the fastest is kept (the least disturbed by other load on the machine)."""
    by_c: dict[int, dict[int, float]] = {}
    for r in rows:
        walls = by_c.setdefault(r["batch"], {})
        walls[r["new_tokens"]] = min(walls.get(r["new_tokens"], math.inf), r["wall_s"])
    conc, per_token, overhead = [], [], []
    for c, walls in sorted(by_c.items()):
        (l1, w1), (l2, w2) = sorted(walls.items())
        t = max((w2 - w1) / (l2 - l1), 1e-6)
        conc.append(float(c))
        per_token.append(t)
        overhead.append(max(w1 - l1 * t, 0.0))
    latency, prefill = _fit(conc, overhead)
    return {
        "concurrency": conc,
        "per_token_s": per_token,
        "prefill_s": max(prefill, 0.0),
        "request_latency_s": max(latency, 0.0),
    }


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
    from miles_aio.trainer.actor import TrainerActor

    cfg = _run_config(run_dir, steps)
    extra = ["--max-running-requests", str(MAX_RUNNING), "--log-level", "WARNING"]
    async with launch_local_engines(model, num_engines=1, weights_root=run_dir, extra_args=extra) as urls:
        await _run_batch(urls[0], 1, 8)  # warm-up
        train, _ = make_splits()
        source = DataSource(
            [PromptRecord(p.prompt, label=p.answer) for p in train],
            n_samples_per_prompt=N,
            seed=0,
            shuffle=True,
        )
        rec = _Recorder()
        async with (
            EngineRouter.open(urls) as router,
            TrainerActor.open(
                dataclasses.replace(cfg.train, hf_checkpoint=model), cfg, run_dir=run_dir
            ) as tr,
        ):
            from transformers import AutoTokenizer

            trainer = _LengthRecordingTrainer(tr)
            controller = Controller(
                cfg,
                engine=router,
                trainer=trainer,  # type: ignore[arg-type]
                source=source,
                plugins=resolve_plugins(cfg),
                tokenizer=AutoTokenizer.from_pretrained(model),
                sinks=[rec],
                write_files=False,
            )
            summary = await controller.run()
            # the engine measured apart from the run, right after it, interleaved with the
            # rollout-alone tries (this machine's background load changes over seconds)
            await _measure(router, 8, 8)  # warm-up: the router's connections
            tok = AutoTokenizer.from_pretrained(model)
            calib: list[dict[str, Any]] = []
            tries: dict[int, list[tuple[float, list[int]]]] = {b: [] for b in ROLLOUT_BOUNDS}
            for _ in range(CALIBRATION_REPEATS):
                for c in CALIBRATION_CONCURRENCY:
                    calib += [await _measure(router, c, n) for n in CALIBRATION_LENGTHS]
                for b in ROLLOUT_BOUNDS:
                    tries[b].append(await _rollout_once(cfg, router, tok, source, b))
            phases = [
                {
                    "bound": b,
                    "wall_s": min(w for w, _ in runs),  # the fastest, as for the calibration
                    "walls_s": [w for w, _ in runs],
                    "lengths": [n for _, ls in runs for n in ls],
                }
                for b, runs in tries.items()
            ]
    return {
        "calibration": calib,
        "rows": rec.rows,
        "step_times": summary.step_times_s,
        "lengths": trainer.lengths,
        "rollout_phases": phases,
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


def _simulated_phase(cfg: RunConfig, sim: SimConfig, phase: dict[str, Any]) -> float:
    """The same rollout phase with the calibrated FAKE engine, on virtual time."""
    engine = FakeBatchedEngine(
        EmpiricalLengths(phase["lengths"]),
        base_per_token_s=sim.base_per_token_s,
        slope_per_token_s=sim.slope_per_token_s,
        max_running=sim.max_running,
        per_token_curve=sim.curve(),
        prefill_s=sim.prefill_s,
        request_latency_s=sim.request_latency_s,
    )
    source = DataSource(
        [PromptRecord(f"p{i}") for i in range(ROLLOUT_GROUPS)], n_samples_per_prompt=N, seed=0, shuffle=False
    )
    loop = looptime.new_event_loop(start=0.0)
    try:
        loop.run_until_complete(_generate_groups(_pool(cfg, engine, phase["bound"], FakeTokenizer()), source))
        return loop.time()
    finally:
        loop.close()


def validate(*, steps: int = 12) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp) / "model", alphabet=ALPHABET)
        (Path(tmp) / "run").mkdir()
        real = asyncio.run(_real(model, Path(tmp) / "run", steps))
        engine = calibrate_engine(real["calibration"])
        conc, per_token = engine["concurrency"], engine["per_token_s"]
        base, slope = _fit(conc, per_token)
        rows = real["rows"][WARMUP:]
        tokens, train_s = [r["rollout/tokens"] for r in rows], [r["perf/train_seconds"] for r in rows]
        train_a, train_b = _fit(tokens, train_s)
        if train_a < 0 or train_b < 0:  # too little spread in tokens per step: proportional model
            train_a, train_b = 0.0, statistics.fmean(train_s) / statistics.fmean(tokens)
        sync_s = statistics.fmean(r["perf/weight_sync_seconds"] for r in rows)
        lengths_file = Path(tmp) / "lengths.json"
        lengths_file.write_text(json.dumps(real["lengths"]))
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
            per_token_curve=",".join(f"{int(c)}:{t}" for c, t in zip(conc, per_token, strict=True)),
            prefill_s=engine["prefill_s"],
            request_latency_s=engine["request_latency_s"],
            max_running=MAX_RUNNING,
            train_step_s=max(train_a, 0.0),
            train_per_token_s=max(train_b, 0.0),
            sync_s=sync_s,
        )
        predicted = run_sim(sim)
        rc = _run_config(Path(tmp) / "run", steps)
        phases = [
            {
                "in_flight": ph["bound"],
                "groups": ROLLOUT_GROUPS,
                "measured_s": ph["wall_s"],
                "predicted_s": (pred := _simulated_phase(rc, sim, ph)),
                "predicted_over_measured": pred / ph["wall_s"],
            }
            for ph in real["rollout_phases"]
        ]
    measured = statistics.fmean(real["step_times"][WARMUP:])
    ratio = predicted["step_time_s"] / measured
    result = {
        "benchmark": "simulate",
        "mode": "validate",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "setup": {"groups_per_step": B, "samples_per_group": N, "max_response_len": MAX_LEN, "steps": steps},
        "calibration": {
            "engine_per_token_s_vs_concurrency": dict(zip(map(int, conc), per_token, strict=True)),
            "engine_prefill_s": engine["prefill_s"],
            "engine_request_latency_s": engine["request_latency_s"],
            "engine_base_per_token_s": base,
            "engine_slope_per_token_s": slope,
            "trainer_step_s": train_a,
            "trainer_per_token_s": train_b,
            "weight_sync_s": sync_s,
            "mean_response_len": statistics.fmean(real["lengths"]) if real["lengths"] else 0.0,
        },
        "measured_step_time_s": measured,
        "measured_trainer_idle_ratio": statistics.fmean(r["perf/trainer_idle_ratio"] for r in rows),
        "predicted_step_time_s": predicted["step_time_s"],
        "predicted_trainer_idle_ratio": predicted["trainer_idle_ratio"],
        "predicted_over_measured": ratio,
        "prediction": predicted,
        "rollout_phases": phases,
    }
    curve = " ".join(f"{int(c)}:{t * 1e3:.2f}" for c, t in zip(conc, per_token, strict=True))
    print(f"engine decode step ms by running requests {curve}; prefill {engine['prefill_s'] * 1e3:.2f} ms, "
          f"latency {engine['request_latency_s'] * 1e3:.2f} ms")  # fmt: skip
    print(f"trainer: {train_a:.3f} s + {train_b:.6f} s/token; weight sync {sync_s:.3f} s")
    print(f"measured step time  {measured:.3f} s (mean of steps {WARMUP}..{steps - 1}, real run)")
    print(f"predicted step time {predicted['step_time_s']:.3f} s (simulator, calibrated)")
    print(f"predicted / measured = {ratio:.3f}")
    for ph in phases:
        print(
            f"rollout alone, {ph['groups']} groups with {ph['in_flight']} in flight: measured "
            f"{ph['measured_s']:.3f} s, predicted {ph['predicted_s']:.3f} s, "
            f"ratio {ph['predicted_over_measured']:.3f}"
        )
    return result
