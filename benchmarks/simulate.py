"""Simulate a fully async run before spending GPU time on it: the REAL controller on virtual time.

    python -m benchmarks.simulate [--config sim.toml|sim.json] [--FIELD VALUE ...] [--output out.json]
    python -m benchmarks.simulate --validate [--output bench-results/simulate.json]

What runs: `miles_aio.controller.Controller` itself — submission scheduler, admission pacing, data
buffer, rollout pool, limiter, driver step loop, weight pushes, adaptive concurrency — on a looptime
event loop (virtual time: sleeps cost nothing, results are deterministic for a seed). Only the seams
are fakes:
  engine   `FakeLatencyEngine`, lengths model: response lengths drawn from a lognormal (--p50-tokens,
           --p99-tokens) or resampled from a recorded run (--lengths-from RUN_DIR: its trace.json's requests);
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

Staleness is printed both ways, each labelled: consume staleness (`rollout/fully_async/*`, at drain
time: what --max-admission-staleness and --max-weight-staleness bound) and train staleness
(`rollout/train_staleness_*`, against the policy that trains on the batch: up to one more under the
prefetch; the `staleness_*` keys of the JSON and `benchmarks.tune`'s figures).

Why a second simulator beside `recipes.simulated`: this one is a prediction tool. It runs on virtual
time (a 20-step run of minutes takes seconds), writes no run directory, models an engine's continuous
batching and a trainer's per-token cost, is calibrated against real runs (--validate), and its
defaults are a GPU-sized workload (16 groups × 8 samples, 200/2000-token lengths, a 2 s train step).
`recipes.simulated` is a recipe: the same controller over latency-model fakes in real time, with every
recipe flag and a run directory (metrics, ledger, trace, plots, checkpoints), small defaults that
finish in seconds, to see what a run looks like and try --save/--load or Ctrl-C; it predicts nothing.

--validate: a short real run on the embedded engine and real trainer, the simulator calibrated from
separately measured quantities, and the predicted/measured step-time ratio (benchmarks.sim_validate).

The model is `benchmarks.sim_run` (`SimConfig`, `run_sim`, re-exported here); this module is its command
line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from benchmarks.sim_run import SimConfig, load_config, recorded_lengths, run_sim
from miles_aio.errors import ConfigError

__all__ = ["SimConfig", "build_parser", "load_config", "main", "print_summary", "recorded_lengths", "run_sim"]


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


_BOUNDS = ("max_admission_staleness", "max_weight_staleness")  # both stated in consume staleness


def print_summary(res: dict[str, Any]) -> None:
    """The prediction, one line per figure; staleness both ways, each labelled (consume / train)."""
    hist = " ".join(f"{k}:{v:.2f}" for k, v in res["token_staleness"].items())
    print(f"step time        {res['step_time_s']:.3f} s (p90 {res['step_time_p90_s']:.3f} s)")
    print(
        f"throughput       {res['samples_per_s']:.2f} samples/s, {res['trained_tokens_per_s']:.0f} tokens/s"
    )
    cfg = res["config"]
    bounds = [f"--{k.replace('_', '-')} {cfg[k]}" for k in _BOUNDS if cfg.get(k) is not None]
    verb = "bound" if len(bounds) > 1 else "bounds"
    bounded = f"what {' and '.join(bounds)} {verb}" if bounds else "what --max-*-staleness would bound; off"
    print(
        f"consume staleness mean {res['consume_staleness_mean']:.2f}, max {res['consume_staleness_max']:.0f} "
        f"(at drain time: {bounded})"
    )
    print(
        f"train staleness   mean {res['staleness_mean']:.2f}, max {res['staleness_max']:.0f} (against the "
        f"policy trained on the batch, up to 1 more under the prefetch); tokens {hist}"
    )
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
