"""The quickstart's tiny Llama as its flags shape it: `--model-hidden-size` and `--model-heads` reach the
warm start (tool_use's too, which ignored them), a width the model cannot have and a head too narrow for
vLLM's CPU attention exit 2 naming the flags before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_aio.recipe import RecipeArgs
from recipes import quickstart, tool_use
from tests.helpers import make_config

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(120)]


def dry_run(recipe: str, run_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"recipes.{recipe}", "--dry-run", "--run-dir", str(run_dir), *argv],
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.parametrize(
    ("recipe", "argv", "flags"),
    [
        ("quickstart", ["--model-hidden-size", "100"], ["--model-hidden-size", "--model-heads"]),
        ("quickstart", ["--model-hidden-size", "0"], ["--model-hidden-size"]),
        (
            "quickstart",
            ["--rollout-backend", "vllm", "--model-hidden-size", "128"],
            ["--model-hidden-size", "--model-heads", "--rollout-backend"],
        ),
        ("tool_use", ["--rollout-backend", "vllm"], ["--model-hidden-size", "--rollout-backend"]),
    ],
)
def test_a_model_it_cannot_build_or_serve_exits_2_naming_the_flags(
    tmp_path: Path, recipe: str, argv: list[str], flags: list[str]
) -> None:
    proc = dry_run(recipe, tmp_path / "run", *argv)
    assert proc.returncode == 2, proc.stderr
    assert all(f in proc.stderr for f in flags), proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_default_model_runs_on_vllm(tmp_path: Path) -> None:
    """256 hidden over 4 heads: heads 64 wide, which vLLM's CPU attention has kernels for."""
    proc = dry_run("quickstart", tmp_path / "run", "--rollout-backend", "vllm")
    assert proc.returncode == 0, proc.stderr
    proc = dry_run("quickstart", tmp_path / "run2", "--rollout-backend", "vllm", "--model-heads", "8")
    assert proc.returncode == 2 and "is 32" in proc.stderr, proc.stderr


@pytest.mark.parametrize("recipe", [quickstart, tool_use])
def test_the_warm_start_builds_the_width_the_flags_ask_for(tmp_path: Path, recipe: object) -> None:
    options = recipe.Options(  # type: ignore[attr-defined]
        model_hidden_size=64, model_heads=2, warm_start_accuracy=0.0, warm_start_check_every=1
    )
    cfg = make_config(tmp_path / "run")
    recipe.prepare(cfg, RecipeArgs(options=options))  # type: ignore[attr-defined]
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"]) == (64, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 2)
