"""Warn when the trained batches carry no learning signal: every reward of a step the same, N steps in a row.

A reward that never matches (the classic: comparing the whole response, which keeps the EOS text, with
the label) trains on 0.0 forever with nothing else looking wrong. `next_streak` is the decision, a pure
function of the streak so far and one step's rewards; `RewardWatch` keeps the streak of a run and logs
one warning line per streak, on the step it reaches `CONSTANT_REWARD_STEPS`. The observer calls it with
every step's trained samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog

from miles_aio.metrics import reward_value
from miles_aio.types import Sample

__all__ = ["CONSTANT_REWARD_STEPS", "RewardStreak", "RewardWatch", "next_streak", "streak_message"]

CONSTANT_REWARD_STEPS = 5
"""Steps in a row whose rewards are all equal before the run warns."""

log = structlog.get_logger("miles_aio.observability")


@dataclass(frozen=True, slots=True)
class RewardStreak:
    steps: int = 0
    """Consecutive steps so far whose rewards were all equal (each step to itself)."""
    values: frozenset[float] = frozenset()
    """The value of each of those steps."""


def next_streak(
    streak: RewardStreak, rewards: Sequence[float], *, steps: int = CONSTANT_REWARD_STEPS
) -> tuple[RewardStreak, bool]:
    """The streak after a step with these rewards, and whether to warn now.

    A step of at least two rewards, all equal, extends the streak; any other step (rewards that differ,
    or fewer than two: nothing to compare) ends it. True exactly once per streak: on the step that
    makes it `steps` long.
    """
    if len(rewards) < 2 or any(r != rewards[0] for r in rewards):
        return RewardStreak(), False
    grown = RewardStreak(streak.steps + 1, streak.values | {float(rewards[0])})
    return grown, grown.steps == steps


def streak_message(streak: RewardStreak) -> str:
    """The warning's one line."""
    if len(streak.values) == 1:
        (value,) = streak.values
        what = f"Every reward was {value:g} for {streak.steps} steps in a row"
    else:
        what = f"Every reward of a step was the same for {streak.steps} steps in a row"
    return (
        f"{what}: no learning signal. Does the reward match real responses? They keep special tokens "
        "(e.g. the EOS text) unless --rollout-skip-special-tokens"
    )


class RewardWatch:
    """The run's streak of constant-reward steps; `observe` once per trained step."""

    def __init__(self, *, reward_key: str | None = None, steps: int = CONSTANT_REWARD_STEPS) -> None:
        self.reward_key = reward_key
        self.steps = steps
        self.streak = RewardStreak()

    def observe(self, step: int, samples: Iterable[Sample]) -> str | None:
        """Take one step's trained samples; the warning logged now, if any."""
        rewards = [v for s in samples if (v := reward_value(s.reward, self.reward_key)) is not None]
        self.streak, warn = next_streak(self.streak, rewards, steps=self.steps)
        if not warn:
            return None
        message = streak_message(self.streak)
        log.warning(message, step=step)
        return message
