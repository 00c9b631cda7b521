"""The fully async pipeline end to end on modelled engines and trainer (no model, no GPU, seconds).

    python -m recipes.simulated --num-rollout 20

The engine is a FAKE whose request latencies follow a long-tailed lognormal distribution and the
trainer a FAKE with a fixed step time, both in real time. It exercises the real controller,
scheduler, buffer, pool and ledger, and writes metrics.jsonl and ledger.jsonl like any run.
Use it to see what the knobs do before spending GPU time; `benchmarks.pipeline` measures it.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.recipe import Recipe, RunParts, main
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulated engine and trainer")
    g.add_argument(
        "--latency-p50-s", type=float, default=0.05, help="Median request latency (default: 0.05)."
    )
    g.add_argument("--latency-p99-s", type=float, default=0.6, help="99th-percentile latency (default: 0.6).")
    g.add_argument("--tokens-per-s", type=float, default=2000.0, help="Tokens per second per request.")
    g.add_argument(
        "--train-step-s", type=float, default=0.15, help="Seconds per training step (default: 0.15)."
    )


def prompts(cfg: RunConfig, ns: argparse.Namespace) -> list[PromptRecord]:
    return [PromptRecord(f"question {i}", label=i) for i in range(1000)]


@asynccontextmanager
async def build(cfg: RunConfig, ns: argparse.Namespace) -> AsyncIterator[RunParts]:
    engine = FakeLatencyEngine(
        LogNormalLatency(ns.latency_p50_s, ns.latency_p99_s), tokens_per_s=ns.tokens_per_s
    )
    yield RunParts(engine=engine, trainer=FakeTrainer(step_time_s=ns.train_step_s), tokenizer=FakeTokenizer())


RECIPE = Recipe(
    name="simulated",
    description=__doc__.split("\n\n")[0],
    defaults=DEFAULTS,
    build=build,
    add_arguments=add_arguments,
    prompts=prompts,
    plan=lambda cfg, ns: {
        "processes": {"controller": 1, "engines": "1 simulated (in-process)", "trainer": "simulated"}
    },
)


def cli(argv: Sequence[str] | None = None) -> None:
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
