"""Command lines ported from miles behave as they do there (checked with --dry-run: nothing starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def dry_run(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recipes.quickstart", "--dry-run", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(120)
def test_load_and_save_on_the_same_empty_directory_starts_fresh(tmp_path: Path) -> None:
    """miles/Megatron: `--load X --save X` with nothing in X yet starts from scratch (with a warning)."""
    ckpt = tmp_path / "ckpt"
    proc = dry_run("--run-dir", str(tmp_path / "run"), "--load", str(ckpt), "--save", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "no checkpoint under --load (= --save) yet: starting fresh" in proc.stderr
    plan = json.loads(proc.stdout)["checkpoints"]
    assert (plan["save"], plan["load"]) == (str(ckpt), None)
    (ckpt / "step_3").mkdir(parents=True)
    (ckpt / "latest").write_text("3")
    proc = dry_run("--run-dir", str(tmp_path / "run"), "--load", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "starting fresh" not in proc.stderr
    assert json.loads(proc.stdout)["checkpoints"]["load"] == str(ckpt / "step_3")
    # any other --load without a checkpoint (a typo) is an error, not a silent fresh start
    proc = dry_run("--run-dir", str(tmp_path / "run"), "--load", str(tmp_path / "ckpnt"), "--save", str(ckpt))
    assert proc.returncode == 2
    assert "--load" in proc.stderr and "holds no checkpoint" in proc.stderr


@pytest.mark.timeout(60)
def test_a_flag_is_never_taken_for_the_prefix_of_another(tmp_path: Path) -> None:
    """argparse's prefix matching once turned miles' `--rollout-stop X` into `--rollout-stop-token-ids X`
    ('invalid int value'); a flag this project does not have must be named as unknown."""
    proc = dry_run("--run-dir", str(tmp_path / "run"), "--rollout-temp", "0.5")
    assert proc.returncode == 2
    assert "--rollout-temp" in proc.stderr and "unrecognized" in proc.stderr
