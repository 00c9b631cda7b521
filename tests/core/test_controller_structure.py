"""How the controller is put together: components built in dependency order without importing the
controller, every task named, adaptive concurrency only with `auto`, the step's phases on a clock."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest

import miles_aio
from miles_aio.controller import Controller
from miles_aio.observability.accounting import StepClock
from miles_aio.plugins import resolve_plugins
from miles_aio.scheduler.adaptive import AdaptiveConcurrency
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import Group
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]

PACKAGE = Path(miles_aio.__file__).parent
TOP = {"__init__.py", "recipe.py"}  # the entry points above the controller


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, TYPE_CHECKING imports included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_component_imports_the_controller() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "controller.py"
        and str(p.relative_to(PACKAGE)) not in TOP
        and "miles_aio.controller" in imported_modules(p)
    ]
    assert offenders == []


class TaskNames(FakeTrainer):
    """Records the names of every task alive while it trains."""

    def __init__(self) -> None:
        super().__init__(step_time_s=1.0)
        self.names: set[str] = set()

    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        self.names |= {t.get_name() for t in asyncio.all_tasks()}
        return await super().train(step, batch)


def controller(tmp_path: Path, trainer: FakeTrainer, *, write_files: bool = True, **cfg: Any) -> Controller:
    config = make_config(tmp_path / "run", num_rollout=3, **cfg)
    return Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 10.0), tokens_per_s=20.0, seed=3),
        trainer=trainer,
        source=make_source(n=config.rollout.n_samples_per_prompt),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
        write_files=write_files,
    )


@pytest.mark.parametrize("auto", [False, True])
def test_every_task_is_named_and_adaptive_concurrency_runs_only_with_auto(
    vrun: Any, tmp_path: Path, auto: bool
) -> None:
    trainer = TaskNames()
    cfg: dict[str, Any] = {"async_max_concurrent_samples": "auto"} if auto else {}
    ctl = controller(tmp_path, trainer, **cfg)
    assert isinstance(ctl.adaptive, AdaptiveConcurrency) if auto else ctl.adaptive is None

    async def main() -> str:
        await ctl.run()
        task = asyncio.current_task()
        assert task is not None
        return task.get_name()

    main_task = vrun(main())
    unnamed = {n for n in trainer.names if n.startswith("Task-") and n != main_task}
    assert unnamed == set()
    assert {"rollout-worker", "drain-2"} <= trainer.names  # step 2's drain runs while step 1 trains
    assert ("adaptive-concurrency" in trainer.names) == auto


def test_the_components_share_what_the_controller_built_first(tmp_path: Path) -> None:
    ctl = controller(tmp_path, FakeTrainer(step_time_s=1.0), write_files=False)  # built, never run
    assert ctl.worker.gate is ctl.gate and ctl.worker.state is ctl.gate.state
    assert ctl.engine.tracer is ctl.tracer is ctl.obs.tracer
    assert ctl.ctx.engine is ctl.engine


def test_a_step_clock_adds_up_each_phase_and_times_the_step_from_its_start() -> None:
    now = [10.0]
    clock = StepClock(lambda: now[0])
    with clock.phase("wait_data"):
        now[0] += 2.0
    with clock.phase("train"):
        now[0] += 3.0
    with pytest.raises(RuntimeError), clock.phase("wait_data"):  # a phase that raises still counts
        now[0] += 0.5
        raise RuntimeError
    now[0] += 1.0
    times = clock.times()
    assert (times.step_s, times.wait_data_s, times.train_s, times.weight_sync_s, times.eval_s) == (
        6.5,
        2.5,
        3.0,
        0.0,
        0.0,
    )
    assert clock.start == 10.0 and clock.began == {"wait_data": 10.0, "train": 12.0}


def test_a_step_clock_since_an_earlier_moment_times_the_step_from_there() -> None:
    now = [10.0]
    clock = StepClock(lambda: now[0], since=9.25)  # the previous step's times were read at 9.25
    with clock.phase("train"):
        now[0] += 3.0
    assert clock.times().step_s == 3.75 and clock.start == 10.0 and clock.began == {"train": 10.0}
    assert StepClock(lambda: 10.0, since=11.0).since == 10.0  # never later than its construction
