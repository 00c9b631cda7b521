"""A run whose every reward of a step is the same, step after step, says so: once per streak."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.observability.reward_watch import (
    CONSTANT_REWARD_STEPS,
    RewardStreak,
    RewardWatch,
    next_streak,
    streak_message,
)
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Sample
from tests.observability._run import run_controller

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]


def run_of(steps: list[list[float]], n: int = 3) -> list[bool]:
    streak, warned = RewardStreak(), []
    for rewards in steps:
        streak, warn = next_streak(streak, rewards, steps=n)
        warned.append(warn)
    return warned


def test_warns_once_on_the_step_the_streak_reaches_n() -> None:
    assert run_of([[0.0, 0.0]] * 6) == [False, False, True, False, False, False]


def test_a_step_with_differing_rewards_ends_the_streak_and_a_new_one_warns_again() -> None:
    steps = [[0.0, 0.0]] * 2 + [[0.0, 1.0]] + [[1.0, 1.0, 1.0]] * 3 + [[0.5, 0.5]]
    assert run_of(steps) == [False, False, False, False, False, True, False]


def test_steps_with_fewer_than_two_rewards_end_the_streak() -> None:
    assert run_of([[0.0, 0.0], [0.0, 0.0], [], [0.0, 0.0], [1.0], [0.0, 0.0]]) == [False] * 6


def test_the_value_is_named_when_the_streak_has_one() -> None:
    streak = RewardStreak()
    for _ in range(3):
        streak, _ = next_streak(streak, [0.0, 0.0, 0.0])
    assert streak == RewardStreak(3, frozenset({0.0}))
    assert streak_message(streak).startswith("Every reward was 0 for 3 steps in a row")
    mixed = RewardStreak(5, frozenset({0.0, 1.0}))
    assert streak_message(mixed).startswith("Every reward of a step was the same for 5 steps in a row")
    assert "\n" not in streak_message(mixed)


def test_watch_reads_the_trained_scalar_of_dict_rewards() -> None:
    watch = RewardWatch(reward_key="score", steps=2)

    def step(*scores: float) -> list[Sample]:
        return [
            Sample(group_index=0, index=i, prompt="", reward={"score": v, "acc": i})
            for i, v in enumerate(scores)
        ]

    assert watch.observe(0, step(1.0, 1.0)) is None
    message = watch.observe(1, step(1.0, 1.0))
    assert message is not None and "Every reward was 1 for 2 steps" in message
    assert watch.observe(2, step(1.0, 1.0)) is None


async def zero_reward(ctx: RolloutContext, sample: Sample) -> float:
    """A reward that never matches."""
    return 0.0


def test_a_run_on_a_constant_reward_warns_once(vrun: Any, tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        run_controller(
            vrun,
            tmp_path / "run",
            num_rollout=CONSTANT_REWARD_STEPS + 3,
            custom_rm_path="tests.observability.test_reward_watch:zero_reward",
        )
    warned = [e for e in logs if e["log_level"] == "warning" and "no learning signal" in e["event"]]
    assert len(warned) == 1
    assert warned[0]["step"] == CONSTANT_REWARD_STEPS  # the step that makes the streak that long
    assert warned[0]["event"].startswith(f"Every reward was 0 for {CONSTANT_REWARD_STEPS} steps in a row")


def test_a_run_on_a_varying_reward_does_not_warn(vrun: Any, tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        run_controller(vrun, tmp_path / "run", num_rollout=CONSTANT_REWARD_STEPS + 3)  # length_reward
    assert not [e for e in logs if "no learning signal" in e["event"]]
