"""`--rollout-submission-granularity group` frees a group's slots when the whole group task returns —
after a `--group-rm` reward too — so groups cannot pile up inside a slow group reward model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

from miles_aio.controller import Controller
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.scheduler.policy import (
    AdmissionLimits,
    Blocked,
    DrainSchedule,
    SchedulerState,
    decide_admission,
)
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import Sample
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


class SlowGroupRM:
    """A `--group-rm` reward that takes 30 (virtual) seconds, counting how many groups are inside it."""

    inside: ClassVar[int] = 0
    most_inside: ClassVar[int] = 0
    engine: ClassVar[FakeLatencyEngine | None] = None
    generating_meanwhile: ClassVar[int] = 0

    @classmethod
    def reset(cls, engine: FakeLatencyEngine) -> None:
        cls.inside = cls.most_inside = cls.generating_meanwhile = 0
        cls.engine = engine


async def slow_group_reward(ctx: RolloutContext, samples: list[Sample]) -> list[float]:
    SlowGroupRM.inside += 1
    SlowGroupRM.most_inside = max(SlowGroupRM.most_inside, SlowGroupRM.inside)
    try:
        for _ in range(30):
            await asyncio.sleep(1.0)
            assert SlowGroupRM.engine is not None
            SlowGroupRM.generating_meanwhile = max(
                SlowGroupRM.generating_meanwhile, SlowGroupRM.engine.in_flight
            )
        return [float(s.response_length % 2) for s in samples]
    finally:
        SlowGroupRM.inside -= 1


def test_group_slots_are_held_until_the_group_task_returns() -> None:
    """The pure rule: under `group` the last sample finishing frees nothing; the group task returning does."""
    lim = AdmissionLimits(
        max_in_flight_samples=2, group_size=2, granularity="group", schedule=DrainSchedule(batch_groups=1)
    )
    state = SchedulerState(version=1)
    state.on_admit(0, 2)
    state.on_sample_done(0, "group")
    state.on_sample_done(0, "group")  # every sample generated; a group reward may still be running
    assert state.slots_held == 2
    assert decide_admission(lim, state) is Blocked.CAPACITY
    state.on_group_generated(0)  # the group task (reward included) returned
    assert state.slots_held == 0
    assert decide_admission(lim, state) is None


@pytest.mark.parametrize("granularity", ["group", "sample"])
def test_a_slow_group_reward_holds_the_groups_slots_under_group_granularity(
    vrun: Any, tmp_path: Path, granularity: str
) -> None:
    """One group of slots (`--async-max-concurrent-samples` = n): under `group`, no group is admitted
    while another is in its 30 s group reward, so at most one is ever inside it and no generation runs
    meanwhile. Under `sample` (miles' fully-async default) slots are freed per sample, so the next group
    generates while the reward runs."""
    cfg = make_config(
        tmp_path / "run",
        num_rollout=3,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=2,
        rollout_submission_granularity=granularity,
        group_rm=True,
        custom_rm_path=f"{__name__}:slow_group_reward",
    )
    engine = FakeLatencyEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=20.0, seed=3)
    SlowGroupRM.reset(engine)
    controller = Controller(
        cfg,
        engine=engine,
        trainer=FakeTrainer(step_time_s=0.5),
        source=make_source(n=2),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
    )
    summary = vrun(controller.run())
    assert summary.steps == 3
    if granularity == "group":
        assert SlowGroupRM.most_inside == 1
        assert SlowGroupRM.generating_meanwhile == 0
    else:
        assert SlowGroupRM.generating_meanwhile > 0
