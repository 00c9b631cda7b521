"""The fully async pipeline end to end on modelled engines and trainer (no model, no GPU, seconds).

    python -m recipes.simulated --num-rollout 20

The engine is a FAKE whose request latencies follow a long-tailed lognormal distribution and the
trainer a FAKE with a fixed step time, both in real time. It exercises the real controller,
scheduler, buffer, pool and ledger, and writes metrics.jsonl and ledger.jsonl like any run.
Use it to see what the knobs do before spending GPU time; `benchmarks.pipeline` measures it.

Why two simulators: this is a recipe, run like any other — every recipe flag, a run directory
(metrics, ledger, trace, plots; --save/--load and Ctrl-C behave as on a GPU), real time, and small
defaults (8 groups × 4 samples, 0.05 s median latency, a 0.15 s train step) that finish in seconds;
it predicts nothing. `python -m benchmarks.simulate` is the prediction tool: the same controller on
virtual time, no run directory, an engine model with continuous batching and a trainer model
calibrated against real runs, and a GPU-sized default workload (16 × 8 samples, 2 s train step); use
it (and `benchmarks.tune`) to choose concurrency, buffer size and staleness bounds. The step log line
prints `consume_staleness` (at drain time, what --max-admission-staleness and --max-weight-staleness
bound); metrics.jsonl also has the train staleness (`rollout/train_staleness_*`, against the policy
trained on the batch: up to one more under the prefetch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from miles_aio.config import RunConfig, opt
from miles_aio.data.source import PromptRecord
from miles_aio.errors import ConfigError
from miles_aio.recipe import Recipe, RecipeArgs, RunParts, main
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency

DEFAULTS = {
    "rollout_batch_size": 8,
    "n_samples_per_prompt": 4,
    "num_rollout": 20,
    "rollout_max_response_len": 256,
    "custom_rm_path": "recipes.simulated:reward",
    "max_admission_staleness": 2,
    "use_tis": True,  # the (simulated) trainer is corrected for off-policy data, as fully async requires
}


async def reward(ctx: object, sample: object) -> float:
    """A stand-in reward: 1 for an even number of response tokens (the fake engine's tokens are random)."""
    from miles_aio.types import Sample

    assert isinstance(sample, Sample)
    return float(sample.response_length % 2 == 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The simulated engine's and trainer's models."""

    latency_p50_s: float = opt(0.05, "Median request latency.")
    latency_p99_s: float = opt(0.6, "99th-percentile latency.")
    tokens_per_s: float = opt(2000.0, "Tokens per second per request.")
    train_step_s: float = opt(0.15, "Seconds per training step.")

    def __post_init__(self) -> None:
        for name in ("latency_p50_s", "tokens_per_s", "train_step_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"must be > 0, got {getattr(self, name)}", flags=["--" + name.replace("_", "-")]
                )
        if self.latency_p99_s < self.latency_p50_s:
            raise ConfigError(
                f"p99 ({self.latency_p99_s}) < p50 ({self.latency_p50_s})",
                flags=["--latency-p99-s", "--latency-p50-s"],
            )


def prompts(cfg: RunConfig, args: RecipeArgs[Options]) -> list[PromptRecord]:
    return [PromptRecord(f"question {i}", label=i) for i in range(1000)]


@asynccontextmanager
async def build(cfg: RunConfig, args: RecipeArgs[Options]) -> AsyncIterator[RunParts]:
    o = args.options
    engine = FakeLatencyEngine(
        LogNormalLatency(o.latency_p50_s, o.latency_p99_s), tokens_per_s=o.tokens_per_s
    )
    yield RunParts(engine=engine, trainer=FakeTrainer(step_time_s=o.train_step_s), tokenizer=FakeTokenizer())


def plan(cfg: RunConfig, args: RecipeArgs[Options]) -> dict[str, Any]:
    return {"processes": {"controller": 1, "engines": "1 simulated (in-process)", "trainer": "simulated"}}


RECIPE = Recipe(
    name="simulated",
    description=__doc__.split("\n\n")[0],
    defaults=DEFAULTS,
    build=build,
    options=Options,
    prompts=prompts,
    plan=plan,
)


def cli(argv: Sequence[str] | None = None) -> None:
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
