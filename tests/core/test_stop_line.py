"""Ctrl-C on a run: its last line says that it stopped early, at which step, and where it saved (or why
it saved nothing). A real `python -m recipes.simulated` in its own process group, signalled as a
terminal does (the whole foreground group)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.checkpoint import read_latest
from miles_aio.recipe import stop_line
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(120)

FAST = ["--train-step-s", "0.05", "--latency-p50-s", "0.01", "--latency-p99-s", "0.05"]


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def interrupted(tmp_path: Path, *extra: str, sig: signal.Signals = signal.SIGINT) -> tuple[int, str]:
    """Start the run, wait for 3 steps, signal its process group; its exit code and last stderr line."""
    run_dir, err = tmp_path / "run", tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "recipes.simulated", "--run-dir", str(run_dir), *FAST, *extra],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group, as a shell's foreground job
        )
        try:
            deadline = time.monotonic() + 60
            while steps_logged(run_dir) < 3 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # another process's file: nothing to wait on but polling
            assert proc.poll() is None, err.read_text()[-3000:]
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole foreground group
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lines = err.read_text().splitlines()
    assert lines, "no output"
    return rc, lines[-1]


def test_ctrl_c_ends_on_a_line_with_the_step_and_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    rc, last = interrupted(tmp_path, "--num-rollout", "300", "--save", str(ckpt), "--save-interval", "100")
    assert rc == 128 + signal.SIGINT, last
    saved = read_latest(ckpt)
    assert saved is not None and saved >= 3
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == saved  # the stop saved the step it finished, whose record is the last
    assert f"stopped early at step {saved} of 300 (SIGINT); saved {ckpt / f'step_{saved}'}" in last
    assert f"--load {ckpt}` resumes with step {saved + 1}" in last


def test_ctrl_c_without_save_says_nothing_was_saved_and_why(tmp_path: Path) -> None:
    rc, last = interrupted(tmp_path, "--num-rollout", "300")
    assert rc == 128 + signal.SIGINT, last
    steps = steps_logged(tmp_path / "run")
    assert f"stopped early at step {steps} of 300 (SIGINT); nothing saved: no --save given" in last


def stub(**fields: Any) -> Any:
    defaults = {"steps_done": 5, "start_step": 0, "last_checkpoint_step": None, "last_checkpoint_dir": None}
    return SimpleNamespace(**{**defaults, "saved_this_run": False, **fields})


def test_the_stop_line_of_each_case(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    cfg = make_config(tmp_path / "run", num_rollout=10, save=save)
    assert stop_line(cfg, None, signal.SIGTERM, save_skipped=True) == (
        "stopped before the first step of 10 (SIGTERM); nothing saved: the run had not started"
    )
    assert stop_line(cfg, stub(steps_done=0), signal.SIGINT) == (
        "stopped early at step 0 of 10 (SIGINT); nothing saved: no step finished"
    )
    second = stub(last_checkpoint_step=4, last_checkpoint_dir=save / "step_4", saved_this_run=True)
    assert stop_line(cfg, second, signal.SIGINT, save_skipped=True) == (
        f"stopped early at step 5 of 10 (SIGINT); nothing saved: a second signal skipped the save; "
        f"`--load {save}` resumes with step 5"
    )
    loaded = tmp_path / "old" / "step_4"
    resumed = stub(steps_done=4, start_step=4, last_checkpoint_step=4, last_checkpoint_dir=loaded)
    assert stop_line(cfg, resumed, signal.SIGINT) == (
        f"stopped early at step 4 of 10 (SIGINT); nothing new to save: no step finished since {loaded} "
        f"was loaded (`--load {loaded}` resumes with step 5)"
    )
