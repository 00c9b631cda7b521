"""Whole runs (embedded engine + trainer rank + controller, real processes) stopped the hard ways.

SIGINT/SIGTERM: the step in progress finishes, a checkpoint is saved, every child is gone, exit 128+sig
within 30 s. SIGKILL of the controller: the children die on their own (the engine on stdin EOF, the
ranks on their lost channel), and `--load` continues the run with a ledger that stays whole.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_aio.checkpoint import read_controller_state, step_dir
from miles_aio.ledger import check_conservation, read_ledger

pytestmark = pytest.mark.procs

SMALL = [
    "--rollout-batch-size",
    "8",
    "--global-batch-size",
    "64",
    "--micro-batch-size",
    "64",
    "--warm-start-accuracy",
    "0.0",
    "--eval-interval",
    "1000",
    "--skip-eval-before-train",
]


def start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "recipes.quickstart", "--run-dir", str(run_dir), *SMALL, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # a test watching another process: there is nothing to wait on but its files


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        p = frontier.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                if k not in found:
                    found.add(k)
                    frontier.append(k)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--num-rollout", "10000")
    try:
        wait_for(lambda: steps_done(run_dir) >= 3, 180, "three steps")
        children = descendants(proc.pid)
        assert len(children) >= 2  # the engine and the trainer rank (at least)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr[-2000:]
    latest = int((run_dir / "checkpoints" / "latest").read_text())
    assert latest >= 3
    assert not [p for p in children if alive(p)]
    events = read_ledger(run_dir / "ledger.jsonl")
    check_conservation(events)
    assert any(e.get("event") == "checkpoint" and e["step"] == latest for e in events)


@pytest.mark.timeout(300)
def test_sigkill_of_the_controller_then_load_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--num-rollout", "10000", "--save-interval", "2")
    try:
        wait_for(
            lambda: (run_dir / "checkpoints" / "latest").exists() and steps_done(run_dir) >= 4,
            180,
            "a checkpoint",
        )
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)  # also closes its stderr pipe
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not [p for p in children if alive(p)], 30, "the orphaned children to exit")
    saved = int((run_dir / "checkpoints" / "latest").read_text())
    target = saved + 3
    resumed = start(
        run_dir, "--num-rollout", str(target), "--save-interval", "2", "--load", str(run_dir / "checkpoints")
    )
    _, stderr = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, stderr[-3000:]
    events = read_ledger(run_dir / "ledger.jsonl")
    marker = read_controller_state(step_dir(run_dir / "checkpoints", saved)).ledger_checkpoint
    assert [e for e in events if e.get("event") == "resume"] == [
        {"event": "resume", "from_step": saved, "checkpoint": marker}
    ]
    counts = check_conservation(events)
    assert counts["trained"] >= target * 8
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == target
    assert os.path.exists(run_dir / "checkpoints" / f"step_{target}")


@pytest.mark.timeout(120)
def test_a_signal_during_start_up_exits_cleanly_and_leaves_no_process(tmp_path: Path) -> None:
    """SIGTERM while the engines start (before the first step): exit 143 with no traceback, nothing left."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--num-rollout", "5")
    try:
        wait_for(lambda: (run_dir / "logs" / "engine-0.log").exists(), 90, "the engine launch")
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    wait_for(lambda: not [p for p in children if alive(p)], 10, "the children to be gone")
    assert not (run_dir / "metrics.jsonl").exists()  # no step ran
