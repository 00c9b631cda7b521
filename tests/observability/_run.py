"""A small controller run over the fake engine and trainer, for the observability tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_aio.controller import Controller, RunSummary
from miles_aio.data.source import PromptRecord
from miles_aio.metrics import MetricsSink
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source


class RecordingSink:
    """A metrics sink that keeps what it was given."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


def run_controller(
    vrun: Any,
    run_dir: Path,
    *,
    sinks: Sequence[MetricsSink] = (),
    eval_prompts: int = 0,
    **cfg: Any,
) -> tuple[Controller, RunSummary]:
    config = make_config(run_dir, **cfg)
    engine = FakeLatencyEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=10.0, seed=7)
    evals = {"held": [PromptRecord(f"q{i}", label=i) for i in range(eval_prompts)]} if eval_prompts else None
    controller = Controller(
        config,
        engine=engine,
        trainer=FakeTrainer(step_time_s=1.0, sync_time_s=0.5),
        source=make_source(n=config.rollout.n_samples_per_prompt),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
        sinks=sinks,
        eval_datasets=evals,
    )
    summary = vrun(controller.run())
    return controller, summary
