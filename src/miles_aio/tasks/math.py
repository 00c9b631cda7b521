"""Grade-school math (GSM8K-style): the reward compares the last number of the response with the label.

Labels may be a bare number or GSM8K's full solution ending in `#### <answer>`; responses may end with
`\\boxed{<answer>}`, `#### <answer>`, `The answer is <answer>`, or just contain the number last.
"""

from __future__ import annotations

import re
from typing import Any

from miles_aio.types import Sample

__all__ = ["extract_answer", "gsm8k_reward", "normalize_number"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_number(text: str) -> str | None:
    """`"1,234.50"` → `"1234.5"`; None if there is no number."""
    found: list[str] = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def extract_answer(text: str) -> str | None:
    """The final answer of a response or a GSM8K label."""
    boxed: list[str] = _BOXED.findall(text)
    if boxed and (n := normalize_number(boxed[-1])) is not None:
        return n
    if "####" in text:
        return normalize_number(text.rsplit("####", 1)[1])
    return normalize_number(text)


async def gsm8k_reward(ctx: Any, sample: Sample) -> float:
    """1.0 if the response's final number equals the label's, else 0.0."""
    got = extract_answer(sample.response)
    want = extract_answer(str(sample.label))
    return float(got is not None and got == want)
