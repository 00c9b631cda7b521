"""One bug in user code is one short report: a wrong signature exits 2 before anything starts, naming
the flag; a plug-in raising in every sample prints one short traceback (no locals, no interpreter or
command-line frames) per distinct error, with the cause on the last line, not a flood."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.errors import ConfigError, format_run_error, primary_error
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.types import Group, Sample
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(90)

HERE = "tests.core.test_user_code_report"


async def two_argument_generate(ctx: RolloutContext, sample: Sample) -> Sample:
    return sample


async def three_argument_reward(ctx: RolloutContext, sample: Sample, extra: int) -> float:
    return 0.0


def one_argument_filter(group: Group) -> bool:
    return True


async def buggy_generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    scale = sampling_params.get("temperature", 1.0)
    sample.metadata["weight"] = 1 / (scale - scale)  # the bug: in every sample
    return sample


@pytest.mark.parametrize(
    ("field", "path", "flag"),
    [
        ("custom_generate_function_path", f"{HERE}:two_argument_generate", "--custom-generate-function-path"),
        ("custom_rm_path", f"{HERE}:three_argument_reward", "--custom-rm-path"),
        ("dynamic_sampling_filter_path", f"{HERE}:one_argument_filter", "--dynamic-sampling-filter-path"),
    ],
)
def test_a_plug_in_with_the_wrong_signature_is_a_config_error(field: str, path: str, flag: str) -> None:
    with pytest.raises(ConfigError) as e:
        overrides: dict[str, Any] = {field: path}
        resolve_plugins(make_config(**overrides))
    assert e.value.flags == (flag,)
    assert "has the signature" in str(e.value) and "called as" in str(e.value)


def test_the_same_error_from_many_tasks_is_one_note_and_no_log_line() -> None:
    same = [ZeroDivisionError("division by zero") for _ in range(3)]
    other = [KeyError("x"), KeyError("x")]
    group = ExceptionGroup("g", [*same, *other])
    with structlog.testing.capture_logs() as logs:
        primary = primary_error(group)
    assert primary is same[0]
    assert primary.__notes__ == [
        "raised 3 times in all (one traceback shown)",
        "also raised: KeyError: 'x' (2 times)",
    ]
    assert [e["error"] for e in logs] == [repr(other[0])]  # each distinct error logged once
    primary_error(group)
    assert len(primary.__notes__) == 2  # a second call adds nothing


def test_the_report_ends_on_the_cause() -> None:
    known: dict[str, int] = {}
    try:
        try:
            known["k"]
        except KeyError as cause:
            raise ValueError("the reward parser broke") from cause
    except ValueError as e:
        e.add_note("raised in the rollout worker")
        report = format_run_error(e)
    lines = report.splitlines()
    assert lines[-1] == "ValueError: the reward parser broke"
    assert lines[-2] == "raised in the rollout worker"
    assert "KeyError: 'k'" in report and report.count("Traceback (most recent call last)") == 2


def test_a_bug_in_every_sample_prints_one_short_traceback_ending_on_its_cause(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "recipes.simulated", "--run-dir", str(tmp_path / "run")),
            *("--num-rollout", "3", "--custom-generate-function-path", f"{HERE}:buggy_generate"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    lines = err.splitlines()
    assert lines[-1] == "ZeroDivisionError: float division by zero", err[-3000:]  # the cause, last
    assert err.count("Traceback (most recent call last)") == 1, err[-6000:]  # once, not once per sample
    assert err.count("ZeroDivisionError: float division by zero") == 1, err[-6000:]
    assert "also raised" not in err and "raised alongside" not in err
    assert any(ln.startswith("raised ") and ln.endswith("times in all (one traceback shown)") for ln in lines)
    frames = [ln for ln in lines if ln.startswith('  File "')]
    assert frames[-1].endswith("in buggy_generate"), frames  # the user's frame, where it raised
    assert len(frames) <= 6, frames  # no interpreter, asyncio or command-line frames
    assert not any("runpy" in f or "asyncio" in f or "recipe.py" in f for f in frames), frames
    assert "scale = " not in err and "sampling_params = " not in err  # no locals
