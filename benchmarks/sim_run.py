"""One simulated run: `SimConfig` (every knob) → `run_sim` (the predicted figures), and config files.

The model itself; `python -m benchmarks.simulate` is its command line (flags, the printed summary: see
that module for what runs and what is predicted) and `benchmarks.sim_validate` checks it against real
runs. A module apart so the validation imports the model, and the command line both, with no cycle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import looptime

from miles_aio.config import (
    BufferConfig,
    DataConfig,
    DriverConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TrainConfig,
    parse_concurrency_bound,
)
from miles_aio.controller import Controller
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.errors import ConfigError
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.testing import EmpiricalLengths, FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormal
from miles_aio.types import Sample

__all__ = ["SimConfig", "load_config", "recorded_lengths", "reward", "run_sim", "sim_engine"]


async def reward(ctx: RolloutContext, sample: Sample) -> float:
    return float(sample.response_length % 2)  # varies, as a real reward: a constant one is warned about


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Every knob of one simulated run (flag = --field-name)."""

    # run shape (miles flag names)
    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 8
    num_rollout: int = 20
    warmup_steps: int = 3
    update_weights_interval: int = 1
    rollout_max_response_len: int = 100_000
    # scheduler and buffer knobs under study
    async_max_concurrent_samples: str | None = None  # N, auto, or None (B × N)
    async_data_buffer_capacity_factor: float = 2.0
    max_admission_staleness: int | None = None
    max_weight_staleness: int | None = None
    adaptive_concurrency_min: int = 8
    adaptive_concurrency_max: int = 4096
    adaptive_concurrency_interval_s: float = 5.0
    # engine model
    p50_tokens: float = 200.0
    p99_tokens: float = 2000.0
    lengths_from: str | None = None  # a run dir (trace.json) or a JSON list of response lengths
    base_per_token_s: float = 0.02
    slope_per_token_s: float = 0.0001
    per_token_curve: str | None = None  # "running:seconds,..." measured points (replaces base/slope)
    prefill_s: float = 0.0
    prefill_curve: str | None = None  # "running:seconds,..." measured points (replaces prefill_s)
    request_latency_s: float = 0.0
    max_running: int = 256
    num_engines: int = 1
    # trainer model
    train_step_s: float = 2.0
    train_per_token_s: float = 0.0
    sync_s: float = 0.5
    seed: int = 0

    def lengths(self) -> LogNormal | EmpiricalLengths:
        if self.lengths_from:
            return EmpiricalLengths(recorded_lengths(Path(self.lengths_from)))
        return LogNormal(self.p50_tokens, self.p99_tokens)

    def curve(self) -> list[tuple[float, float]]:
        return _points(self.per_token_curve)

    def start_curve(self) -> list[tuple[float, float]]:
        return _points(self.prefill_curve)

    def run_config(self, run_dir: Path) -> RunConfig:
        try:  # the setting's text, as the CLI parses --async-max-concurrent-samples
            text = self.async_max_concurrent_samples
            cap = None if text is None else parse_concurrency_bound(text)
        except ValueError as e:
            raise ConfigError(str(e), flags=["--async-max-concurrent-samples"]) from None
        return RunConfig(
            data=DataConfig(rollout_shuffle=False),
            rollout=RolloutConfig(
                rollout_batch_size=self.rollout_batch_size,
                n_samples_per_prompt=self.n_samples_per_prompt,
                rollout_max_response_len=self.rollout_max_response_len,
                custom_rm_path="benchmarks.sim_run:reward",
                sglang_server_concurrency=1_000_000,
            ),
            scheduler=SchedulerConfig(
                async_max_concurrent_samples=cap,
                max_admission_staleness=self.max_admission_staleness,
                adaptive_concurrency_min=self.adaptive_concurrency_min,
                adaptive_concurrency_max=self.adaptive_concurrency_max,
                adaptive_concurrency_interval_s=self.adaptive_concurrency_interval_s,
            ),
            buffer=BufferConfig(
                async_data_buffer_capacity_factor=self.async_data_buffer_capacity_factor,
                max_weight_staleness=self.max_weight_staleness,
            ),
            driver=DriverConfig(
                num_rollout=self.num_rollout,
                update_weights_interval=self.update_weights_interval,
                stall_warning_s=1e9,
            ),
            train=TrainConfig(use_tis=True),
            run_dir=run_dir,
        )


def _points(spec: str | None) -> list[tuple[float, float]]:
    """The points of a "running:seconds,..." curve ([] for None or "")."""
    if not spec:
        return []
    points = [p.split(":") for p in spec.split(",")]
    return [(float(r), float(t)) for r, t in points]


def recorded_lengths(path: Path) -> list[int]:
    """Response lengths from a JSON list of ints, or from a run's timeline trace (a run dir or its
    trace.json): the `tokens` of every finished rollout `generate` request."""
    if path.is_dir():
        path = path / "trace.json"
    data = json.loads(path.read_text())
    if isinstance(data, list) and all(isinstance(x, int) for x in data):
        return [int(x) for x in data]
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [
        int(e["args"]["tokens"])
        for e in events
        if isinstance(e, dict)
        and e.get("name") == "generate"
        and isinstance(e.get("args"), dict)
        and isinstance(e["args"].get("tokens"), int)
        and e["args"].get("finish") in ("stop", "length")
    ]


class _Recorder:
    """A metrics sink keeping every step's metrics, plus the limiter's size at each step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.controller: Controller | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = dict(metrics)
        if self.controller is not None:
            row["sim/limit"] = float(self.controller.limiter.total_tokens)
        self.steps.append(row)

    def close(self) -> None:
        return None


def _mean(rows: Sequence[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else 0.0


def sim_engine(cfg: SimConfig, *, fast_ids: bool = False) -> FakeLatencyEngine:
    """The engines of `cfg`'s model (`fast_ids`: token ids drawn in one call, see `FakeLatencyEngine`)."""
    return FakeLatencyEngine(
        lengths=cfg.lengths(),
        base_per_token_s=cfg.base_per_token_s,
        slope_per_token_s=cfg.slope_per_token_s,
        max_running=cfg.max_running,
        num_engines=cfg.num_engines,
        per_token_curve=cfg.curve(),
        prefill_s=cfg.prefill_s,
        prefill_curve=cfg.start_curve(),
        request_latency_s=cfg.request_latency_s,
        seed=cfg.seed,
        fast_ids=fast_ids,
    )


def run_sim(cfg: SimConfig) -> dict[str, Any]:
    """Run one simulated run; returns the predicted figures (steady state: after the warm-up steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        rc = cfg.run_config(Path(tmp))
        engine = sim_engine(cfg)
        trainer = FakeTrainer(
            step_time_s=cfg.train_step_s,
            per_token_s=cfg.train_per_token_s,
            sync_time_s=cfg.sync_s,
            keep_batches=False,
        )
        rec = _Recorder()
        records = [
            PromptRecord(f"p{i}") for i in range(max(1000, 4 * cfg.rollout_batch_size * cfg.num_rollout))
        ]
        controller = Controller(
            rc,
            engine=engine,
            trainer=trainer,
            source=DataSource(
                records, n_samples_per_prompt=cfg.n_samples_per_prompt, seed=cfg.seed, shuffle=False
            ),
            plugins=resolve_plugins(rc),
            tokenizer=FakeTokenizer(),
            num_engines=cfg.num_engines,
            sinks=[rec],
            write_files=False,
        )
        rec.controller = controller
        loop = looptime.new_event_loop(start=0.0)
        try:
            summary = loop.run_until_complete(controller.run())
        finally:
            loop.close()
    steady = rec.steps[cfg.warmup_steps :] or rec.steps
    times = summary.step_times_s[cfg.warmup_steps :] or summary.step_times_s
    step_s = statistics.fmean(times)
    samples = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    hist = {k: _mean(steady, f"rollout/token_staleness/{k}") for k in ("0", "1", "2", "3", "4+")}
    return {
        "config": dataclasses.asdict(cfg),
        "steps": summary.steps,
        "step_time_s": step_s,
        "step_time_p90_s": sorted(times)[min(len(times) - 1, int(0.9 * len(times)))],
        "samples_per_s": samples / step_s,
        "trained_tokens_per_s": _mean(steady, "rollout/tokens") / step_s,
        "staleness_mean": _mean(steady, "rollout/train_staleness_mean"),  # train staleness
        "staleness_max": max((r.get("rollout/train_staleness_max", 0.0) for r in steady), default=0.0),
        "consume_staleness_mean": _mean(steady, "rollout/fully_async/avg_staleness"),
        "consume_staleness_max": max(
            (r.get("rollout/fully_async/max_staleness", 0.0) for r in steady), default=0.0
        ),
        "token_staleness": hist,
        "trainer_idle_ratio": _mean(steady, "perf/trainer_idle_ratio"),
        "rollout_blocked_ratio": _mean(steady, "perf/rollout_blocked_ratio"),
        "rollout_capacity_blocked_ratio": _mean(steady, "perf/rollout_blocked_ratio/capacity"),
        "wasted_tokens": sum(r.get("perf/wasted_tokens", 0.0) for r in rec.steps),
        "engine_max_in_flight": engine.max_in_flight,
        "limit_per_step": [int(r.get("sim/limit", 0)) for r in rec.steps],
        "virtual_s": summary.wall_s,
    }


# -- config files and flags ---------------------------------------------------------------------------
def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> SimConfig:
    """A SimConfig from a JSON or TOML file (keys: field names, `-` or `_`), then `overrides`.

    Raises ValueError (unknown keys), OSError, or ConfigError (invalid run settings)."""
    values: dict[str, Any] = {}
    if path is not None:
        text = path.read_text()
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        values = {k.replace("-", "_"): v for k, v in raw.items()}
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f.name for f in fields(SimConfig)}
    if unknown := sorted(set(values) - known):
        raise ValueError(f"unknown simulator settings: {unknown}")
    if "async_max_concurrent_samples" in values and values["async_max_concurrent_samples"] is not None:
        values["async_max_concurrent_samples"] = str(values["async_max_concurrent_samples"])
    cfg = SimConfig(**values)
    cfg.run_config(Path("."))  # validates (ConfigError names the flags); creates nothing
    return cfg
