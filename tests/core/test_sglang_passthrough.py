"""`--sglang-*` / `--eval-sglang-*` passthrough arguments (recipe.sglang_passthrough)."""

from __future__ import annotations

import argparse

import pytest

from miles_aio.recipe import sglang_passthrough

pytestmark = pytest.mark.pure


def parse(*unknown: str) -> tuple[list[str], list[str]]:
    return sglang_passthrough(argparse.ArgumentParser(prog="recipe"), list(unknown))


def test_rollout_flags_go_to_both_fleets() -> None:
    assert parse("--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics") == (
        ["--mem-fraction-static", "0.8", "--enable-metrics"],
        ["--mem-fraction-static", "0.8", "--enable-metrics"],
    )


def test_eval_flags_override_or_add_for_the_eval_fleet_only() -> None:
    rollout, evals = parse(
        "--sglang-mem-fraction-static=0.8",
        "--eval-sglang-mem-fraction-static",
        "0.5",
        "--sglang-tp-size",
        "2",
        "--eval-sglang-disable-radix-cache",
    )
    assert rollout == ["--mem-fraction-static=0.8", "--tp-size", "2"]
    assert evals == ["--tp-size", "2", "--mem-fraction-static", "0.5", "--disable-radix-cache"]


@pytest.mark.parametrize("unknown", [["--bogus"], ["stray"], ["--sglang-x", "1", "--other", "2"]])
def test_anything_else_exits_2_naming_it(unknown: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*unknown)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
