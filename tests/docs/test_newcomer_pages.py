"""What the pages a miles user reads first say about the issue's frictions: one step numbering, the
last line of a stopped run, the two simulators."""

from __future__ import annotations

import recipes.simulated
from tests.docs._docs import DOCS


def test_coming_from_miles_states_the_step_numbering() -> None:
    text = (DOCS / "guide" / "coming-from-miles.md").read_text()
    assert "| step numbers |" in text and "steps done" in text and "`rollout_id` counts from 0" in text
    assert "`--engine-flush-attempts`, `--engine-flush-backoff-s`" in text


def test_two_simulators_are_explained_where_both_are_met() -> None:
    assert "Why two simulators" in (recipes.simulated.__doc__ or "")
    assert "Why two simulators" in (DOCS / "guide" / "tuning.md").read_text()
