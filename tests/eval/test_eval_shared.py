"""Mode 1 eval (shared engines) on the fake engine, virtual time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.controller import Controller
from miles_aio.data.source import PromptRecord
from miles_aio.eval import EvalDispatcher, SharedEngineEval
from miles_aio.eval.shared import EVAL_PRIORITY
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


class WindowedEval:
    """Wraps the evaluator to count rollout groups finished while a point runs."""

    def __init__(self, inner: SharedEngineEval) -> None:
        self.inner = inner
        self.controller: Controller | None = None
        self.finished_during: list[int] = []

    async def evaluate(self) -> dict[str, float]:
        assert self.controller is not None
        before = self.controller.worker.finished_groups
        metrics = await self.inner.evaluate()
        self.finished_during.append(self.controller.worker.finished_groups - before)
        return metrics


def test_shared_engine_eval_keeps_rollout_producing_and_never_mixes_versions(
    vrun: Any, tmp_path: Path
) -> None:
    cfg = make_config(
        tmp_path / "run",
        num_rollout=6,
        eval_interval=2,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=8,
    )
    engine = FakeLatencyEngine(LogNormalLatency(1.0, 8.0), tokens_per_s=10, seed=5)
    plugins = resolve_plugins(cfg)
    wrapper: WindowedEval | None = None

    def build(controller_ctx: Any) -> WindowedEval:
        evaluator = SharedEngineEval(
            ctx=controller_ctx,
            datasets={"held": [PromptRecord(f"q{i}", label=i) for i in range(12)]},
            generate_fn=plugins.generate_fn,
            reward_fn=plugins.reward_fn,
            temperature=0.0,
        )
        return WindowedEval(evaluator)

    controller = Controller(
        cfg,
        engine=engine,
        trainer=FakeTrainer(step_time_s=1.0),
        source=make_source(n=2),
        plugins=plugins,
        tokenizer=FakeTokenizer(),
    )
    from dataclasses import replace

    wrapper = build(replace(controller.ctx, engine=controller.engine.with_priority(EVAL_PRIORITY)))
    wrapper.controller = controller
    controller.evals = EvalDispatcher(wrapper, interval=cfg.driver.eval_interval)
    vrun(controller.run())

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    points = [(m["step"], m["eval/step"], m["eval/version"]) for m in lines if "eval/step" in m]
    # before training (0), after steps 2, 4 and 6; each evaluates the weights pushed right before it
    assert [p[1] for p in points] == [0.0, 2.0, 4.0, 6.0]
    assert [p[2] for p in points] == [1.0, 3.0, 5.0, 7.0]
    assert points[-1][0] == 6  # the last point lands in the last record, its step that of the point
    for m in lines:
        if "eval/step" in m:
            assert m["eval/held/mixed_version_ratio"] == 0.0
            assert m["eval/held/weight_version/mean"] == m["eval/version"]
            assert m["eval/lag_steps"] >= 0
    assert sum(wrapper.finished_during) > 0  # rollout kept producing during eval
    assert any(m["eval/push_wait_seconds"] > 0 for m in lines if "eval/step" in m)  # a push waited


def controller_with(cfg: Any, evals: EvalDispatcher, trainer: FakeTrainer | None = None) -> Controller:
    """A controller over the fake engine and trainer, with the given eval dispatcher."""
    return Controller(
        cfg,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 8.0), tokens_per_s=10, seed=5),
        trainer=trainer or FakeTrainer(step_time_s=1.0),
        source=make_source(n=2),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
        evals=evals,
    )


class CrashOnSecondPoint:
    """An eval whose user code raises on its second point."""

    def __init__(self) -> None:
        self.calls = 0

    async def evaluate(self) -> dict[str, float]:
        self.calls += 1
        if self.calls == 2:
            raise ValueError("reward function bug")
        return {"eval/held/accuracy": 0.5}


def test_a_crashing_point_is_skipped_and_training_goes_on(vrun: Any, tmp_path: Path) -> None:
    """As in modes 2 and 3: a crashed point is `eval/skipped_crashed`, not the end of the run."""
    cfg = make_config(tmp_path / "run", num_rollout=4, eval_interval=2)
    summary = vrun(controller_with(cfg, EvalDispatcher(CrashOnSecondPoint(), interval=2, final_step=4)).run())
    assert summary.steps == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["eval/step"] for m in lines if "eval/step" in m] == [0.0, 4.0]  # the point at 2 crashed
    assert [m["step"] for m in lines if "eval/skipped_crashed" in m] == [3]  # the next step's record
    assert sum(m.get("eval/skipped_crashed", 0) for m in lines) == 1


def test_the_run_ends_on_pushed_weights_so_the_final_point_sees_them(vrun: Any, tmp_path: Path) -> None:
    """--update-weights-interval 2 over 3 steps: the last step still pushes, so the final eval point
    (mode 1, on the rollout engines) evaluates the trained weights, not the ones pushed a step earlier."""
    cfg = make_config(tmp_path / "run", num_rollout=3, eval_interval=2, update_weights_interval=2)
    trainer = FakeTrainer(step_time_s=1.0)
    vrun(controller_with(cfg, EvalDispatcher(CrashOnSecondPoint(), interval=2, final_step=3), trainer).run())
    assert trainer.synced_versions == [1, 2, 3]  # initial, after step 2, and after the last step
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    points = [(m["eval/step"], m["eval/version"]) for m in lines if "eval/step" in m]
    assert points == [(0.0, 1.0), (3.0, 3.0)]  # the point at 2 crashed (skipped); the final one is v3
