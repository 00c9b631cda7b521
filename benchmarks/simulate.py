"""Simulate a fully async run before spending GPU time on it: the REAL controller on virtual time.

    python -m benchmarks.simulate [--config sim.toml|sim.json] [--FIELD VALUE ...] [--output out.json]
    python -m benchmarks.simulate --validate [--output bench-results/simulate.json]

What runs: `miles_aio.controller.Controller` itself — submission scheduler, admission pacing, data
buffer, rollout pool, limiter, driver step loop, weight pushes, adaptive concurrency — on a looptime
event loop (virtual time: sleeps cost nothing, results are deterministic for a seed). Only the seams
are fakes:
  engine   `FakeBatchedEngine`: response lengths drawn from a lognormal (--p50-tokens, --p99-tokens)
           or resampled from a recorded run (--lengths-from RUN_DIR: its trace.json's requests);
           continuous batching of at most --max-running requests per engine, a decode step taking
           --base-per-token-s + --slope-per-token-s × running requests (throughput degrades with
           concurrency, or a measured --per-token-curve); each request's start (its prefill and
           handling: --prefill-s, or a measured --prefill-curve by running requests) holds up the
           engine's decoding, and --request-latency-s adds latency outside the engine.
  trainer  `FakeTrainer`: --train-step-s + --train-per-token-s × response tokens per step, and
           --sync-s per weight push.

Predicted, in seconds of wall time: step time, staleness distribution, bubble ratios
(perf/trainer_idle_ratio, perf/rollout_blocked_ratio), wasted tokens, throughput. Config files hold
the same field names as the flags (with _ or -); flags override the file.

--validate: a short real run on the embedded engine and real trainer, the simulator calibrated from
separately measured quantities, and the predicted/measured step-time ratio (benchmarks.sim_validate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
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
)
from miles_aio.controller import Controller
from miles_aio.data.source import DataSource, PromptRecord
from miles_aio.errors import ConfigError
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.testing import FakeTokenizer, FakeTrainer
from miles_aio.testing.sim_engine import EmpiricalLengths, FakeBatchedEngine, LogNormalLengths
from miles_aio.types import Sample

__all__ = ["SimConfig", "load_config", "recorded_lengths", "run_sim"]


async def reward(ctx: RolloutContext, sample: Sample) -> float:
    return 1.0


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

    def lengths(self) -> LogNormalLengths | EmpiricalLengths:
        if self.lengths_from:
            return EmpiricalLengths(recorded_lengths(Path(self.lengths_from)))
        return LogNormalLengths(self.p50_tokens, self.p99_tokens)

    def curve(self) -> list[tuple[float, float]]:
        return _points(self.per_token_curve)

    def start_curve(self) -> list[tuple[float, float]]:
        return _points(self.prefill_curve)

    def run_config(self, run_dir: Path) -> RunConfig:
        cap = self.async_max_concurrent_samples
        return RunConfig(
            data=DataConfig(rollout_shuffle=False),
            rollout=RolloutConfig(
                rollout_batch_size=self.rollout_batch_size,
                n_samples_per_prompt=self.n_samples_per_prompt,
                rollout_max_response_len=self.rollout_max_response_len,
                custom_rm_path="benchmarks.simulate:reward",
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


def run_sim(cfg: SimConfig) -> dict[str, Any]:
    """Run one simulated run; returns the predicted figures (steady state: after the warm-up steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        rc = cfg.run_config(Path(tmp))
        engine = FakeBatchedEngine(
            cfg.lengths(),
            base_per_token_s=cfg.base_per_token_s,
            slope_per_token_s=cfg.slope_per_token_s,
            max_running=cfg.max_running,
            num_engines=cfg.num_engines,
            per_token_curve=cfg.curve(),
            prefill_s=cfg.prefill_s,
            prefill_curve=cfg.start_curve(),
            request_latency_s=cfg.request_latency_s,
            seed=cfg.seed,
        )
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
        "staleness_mean": _mean(steady, "rollout/train_staleness_mean"),
        "staleness_max": max((r.get("rollout/train_staleness_max", 0.0) for r in steady), default=0.0),
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


HELP = {
    "rollout_batch_size": "groups per step",
    "n_samples_per_prompt": "samples per group",
    "num_rollout": "steps to simulate",
    "warmup_steps": "first steps left out of the averages",
    "update_weights_interval": "push weights every N steps",
    "rollout_max_response_len": "max_new_tokens (longer draws are truncated)",
    "async_max_concurrent_samples": "in-flight bound: N or auto (default: B × N)",
    "async_data_buffer_capacity_factor": "buffer capacity = factor × B groups",
    "max_admission_staleness": "admission pacing K (default: off)",
    "max_weight_staleness": "consume-time staleness filter (default: off)",
    "adaptive_concurrency_min": "auto: smallest bound",
    "adaptive_concurrency_max": "auto: largest bound",
    "adaptive_concurrency_interval_s": "auto: seconds between decisions",
    "p50_tokens": "median response length (lognormal)",
    "p99_tokens": "99th percentile response length (lognormal)",
    "lengths_from": "recorded lengths: a run dir (its trace.json) or a JSON list (replaces the lognormal)",
    "base_per_token_s": "engine decode step seconds with no other request running",
    "slope_per_token_s": "extra decode step seconds per running request",
    "per_token_curve": "decode step seconds RUNNING:SECONDS,... (interpolated; replaces base/slope)",
    "prefill_s": "engine seconds per request start (prefill) during which decoding waits",
    "prefill_curve": "engine seconds per request start by RUNNING:SECONDS,... (replaces prefill-s)",
    "request_latency_s": "per-request latency outside the engine (HTTP, client)",
    "max_running": "requests an engine decodes at once; more wait in its queue",
    "num_engines": "identical engines (round robin)",
    "train_step_s": "trainer seconds per step",
    "train_per_token_s": "trainer seconds per response token",
    "sync_s": "seconds per weight push",
    "seed": "random seed (lengths)",
}


def _field_type(f: dataclasses.Field[Any]) -> type:
    t = str(f.type)
    return int if t.startswith("int") else float if t.startswith("float") else str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.simulate",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--config", type=Path, help="JSON or TOML file of settings (field names below)")
    parser.add_argument("--output", type=Path, help="write the prediction (JSON) here")
    parser.add_argument("--validate", action="store_true", help="real short run vs calibrated prediction")
    parser.add_argument(
        "--validate-steps",
        type=int,
        default=12,
        help="steps of the real validation run (default: %(default)s)",
    )
    group = parser.add_argument_group("simulated run (override the config file)")
    defaults = SimConfig()
    for f in fields(SimConfig):
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_field_type(f),
            default=None,
            help=f"{HELP.get(f.name, '')} (default: {getattr(defaults, f.name)})",
        )
    return parser


def print_summary(res: dict[str, Any]) -> None:
    hist = " ".join(f"{k}:{v:.2f}" for k, v in res["token_staleness"].items())
    print(f"step time        {res['step_time_s']:.3f} s (p90 {res['step_time_p90_s']:.3f} s)")
    print(
        f"throughput       {res['samples_per_s']:.2f} samples/s, {res['trained_tokens_per_s']:.0f} tokens/s"
    )
    print(f"staleness        mean {res['staleness_mean']:.2f}, max {res['staleness_max']:.0f}; tokens {hist}")
    print(f"trainer idle     {res['trainer_idle_ratio']:.3f} (perf/trainer_idle_ratio)")
    print(f"rollout blocked  {res['rollout_blocked_ratio']:.3f} (perf/rollout_blocked_ratio)")
    print(f"wasted tokens    {res['wasted_tokens']:.0f}")
    if res["config"]["async_max_concurrent_samples"] == "auto":
        print(f"adaptive limit   {res['limit_per_step']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    if args.validate:
        from benchmarks.sim_validate import validate

        result = validate(steps=args.validate_steps)
    else:
        overrides = {f.name: getattr(args, f.name) for f in fields(SimConfig)}
        try:
            cfg = load_config(args.config, overrides)
        except (ValueError, OSError, ConfigError) as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        result = {"benchmark": "simulate", **run_sim(cfg)}
        print_summary(result)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
