from __future__ import annotations

import asyncio

import pytest

from miles_aio.tasks.arithmetic import make_splits, parse_answer
from miles_aio.tasks.math import extract_answer, gsm8k_reward
from miles_aio.types import Sample

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("so the total is \\boxed{1,234}.", "1234"),
        ("The answer is 3.50 dollars", "3.5"),
        ("x = -7", "-7"),
        ("no number here", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


def test_gsm8k_reward_compares_final_numbers() -> None:
    s = Sample(group_index=0, index=0, prompt="q", label="blah #### 1,000", response="it is \\boxed{1000}")
    assert asyncio.run(gsm8k_reward(None, s)) == 1.0
    s.response = "it is 999"
    assert asyncio.run(gsm8k_reward(None, s)) == 0.0


def test_arithmetic_splits_are_disjoint_and_seeded() -> None:
    train, held = make_splits()
    assert len(held) == 200 and len(train) == 8100 - 200
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    assert make_splits()[1] == held
    assert parse_answer("123") == "123" and parse_answer("12;3") == "12" and parse_answer("") == ""
