"""Whole runs stopped the way a terminal and a job scheduler stop them: signals to the process GROUP.

The controller is started in its own session, as a shell starts a job, and signalled with
`os.killpg`: a terminal's Ctrl-C sends SIGINT to the whole foreground group; Slurm and Kubernetes send
SIGTERM to all of it, then SIGKILL after a grace period. The engine and the trainer rank must not get
those signals (each runs in its own session); the controller alone decides: it finishes its step, logs
it, saves and stops them. Then `--load` continues, losing and repeating no group (the ledger's
conservation) and no step (metrics.jsonl).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import IO, Any

import pytest
import structlog

from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.recipe import _Stopper
from miles_aio.tasks.arithmetic import ALPHABET
from tests.core.test_kill_and_signals import SMALL, alive, descendants, steps_done, wait_for

pytestmark = pytest.mark.procs

GROUPS_PER_STEP = 8  # SMALL's --rollout-batch-size


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's model architecture, random init: copied into each run dir, so no run spends its
    time on the warm start (the recipe reuses a model it finds there)."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("qs") / "model",
        alphabet=ALPHABET,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        max_position_embeddings=32,
    )


def start_job(run_dir: Path, stderr: IO[str], *extra: str) -> subprocess.Popen[str]:
    """The controller as a shell job: its own session and process group (pgid = its pid)."""
    return subprocess.Popen(
        [sys.executable, "-m", "recipes.quickstart", "--run-dir", str(run_dir), *SMALL, *extra],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )


def new_run(run_dir: Path, model: Path) -> None:
    run_dir.mkdir(parents=True)
    shutil.copytree(model, run_dir / "model")


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def latest(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text())


def resume(run_dir: Path, target: int, log: Path, *extra: str) -> None:
    """`--load` the run's checkpoints in the same run dir up to `target` steps; it must succeed."""
    with log.open("w") as err:
        proc = start_job(
            run_dir, err, "--num-rollout", str(target), "--load", str(run_dir / "checkpoints"), *extra
        )
        try:
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def outside_group(children: set[int], pgid: int) -> None:
    """No descendant of the controller is in its process group: a signal to the group reaches it alone."""
    in_group = [pid for pid in children if alive(pid) and os.getpgid(pid) == pgid]
    assert not in_group, f"children {in_group} share the controller's process group {pgid}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_group_signal_saves_logs_the_step_and_resumes_losing_nothing(
    tmp_path: Path, model: Path, sig: signal.Signals
) -> None:
    """Ctrl-C (SIGINT) / a scheduler's SIGTERM to the whole group: exit 128+sig, a checkpoint at the last
    trained step, which has its metrics record; no process left; `--load` continues step by step."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    new_run(run_dir, model)
    with log.open("w") as err:
        proc = start_job(run_dir, err, "--num-rollout", "10000")
        try:
            wait_for(lambda: steps_done(run_dir) >= 2 or proc.poll() is not None, 90, "two steps")
            children = descendants(proc.pid)
            assert len(children) >= 2, log.read_text()[-2000:]  # the engine and the trainer rank
            outside_group(children, proc.pid)
            os.killpg(proc.pid, sig)  # the whole foreground group, as a terminal does
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = log.read_text()
    assert rc == 128 + sig, stderr[-3000:]
    assert "TrainerRankError" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert not [p for p in children if alive(p)]  # the controller stopped them before it exited
    saved = latest(run_dir)
    assert metric_steps(run_dir) == list(range(1, saved + 1))  # the saved (last trained) step is logged
    events = read_ledger(run_dir / "ledger.jsonl")
    check_conservation(events)
    assert any(e.get("event") == "checkpoint" and e["step"] == saved for e in events)
    if sig != signal.SIGINT:
        return  # how the run resumes does not depend on the signal that stopped it: resumed once

    target = saved + 3
    resume(run_dir, target, tmp_path / "resume.log")
    events = read_ledger(run_dir / "ledger.jsonl")
    assert [e["from_step"] for e in events if e.get("event") == "resume"] == [saved]
    counts = check_conservation(events)
    assert counts["trained"] == target * GROUPS_PER_STEP  # every step's groups trained once, none again
    assert metric_steps(run_dir) == list(range(1, target + 1))  # no step lost, none repeated


@pytest.mark.timeout(150)
def test_sigterm_then_sigkill_to_the_group_leaves_nothing_and_load_resumes(
    tmp_path: Path, model: Path
) -> None:
    """A scheduler whose grace period is shorter than the stop's save: SIGTERM to the group, then SIGKILL
    to the group. Nothing is left running, and `--load` continues from the last complete checkpoint."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    new_run(run_dir, model)
    with log.open("w") as err:
        proc = start_job(run_dir, err, "--num-rollout", "10000", "--save-interval", "2")
        try:
            wait_for(
                lambda: (
                    ((run_dir / "checkpoints" / "latest").exists() and steps_done(run_dir) >= 3)
                    or proc.poll() is not None
                ),
                90,
                "a checkpoint",
            )
            children = descendants(proc.pid)
            assert len(children) >= 2, log.read_text()[-2000:]
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.05)  # the grace period: shorter than finishing the step and saving it
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert rc == -signal.SIGKILL, log.read_text()[-2000:]
    # only the kernel can help the children now: parent-death signal, stdin / channel EOF
    wait_for(lambda: not [p for p in children if alive(p)], 15, "the orphaned children to exit")
    saved = latest(run_dir)
    target = saved + 3
    resume(run_dir, target, tmp_path / "resume.log", "--save-interval", "2")
    events = read_ledger(run_dir / "ledger.jsonl")
    assert [e["from_step"] for e in events if e.get("event") == "resume"] == [saved]
    check_conservation(events)
    assert metric_steps(run_dir)[-1] == target
    assert (run_dir / "checkpoints" / f"step_{target}").is_dir()


class _StoppingController:
    """What `_Stopper` needs of a controller: the stop request and the newest complete checkpoint."""

    def __init__(self, last_checkpoint_step: int | None) -> None:
        self.last_checkpoint_step = last_checkpoint_step
        self.stop_requested = asyncio.Event()

    def request_stop(self) -> None:
        self.stop_requested.set()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last", [4, None], ids=["after-a-checkpoint", "no-checkpoint"])
def test_a_second_signal_logs_that_the_save_is_skipped_and_what_load_resumes(last: int | None) -> None:
    """The first Ctrl-C asks for the stop (and its save); a second one cancels the run at once, saying
    in one line that no checkpoint is saved and where `--load` resumes. Real signals to this process."""
    controller = _StoppingController(last)

    async def main() -> list[MutableMapping[str, Any]]:
        stopper = _Stopper()
        stopper.controller = controller  # type: ignore[assignment]
        try:
            with structlog.testing.capture_logs() as logs:
                os.kill(os.getpid(), signal.SIGINT)
                await asyncio.wait_for(controller.stop_requested.wait(), 10)
                assert not logs  # the first signal stops after the step, with its save: nothing to say
                os.kill(os.getpid(), signal.SIGINT)
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.sleep(10)  # cancelled by the second signal
        finally:
            stopper.remove()
        return logs

    (line,) = asyncio.run(main())
    assert line["log_level"] == "warning"
    assert "second signal" in str(line["event"]) and "skipping the checkpoint save" in str(line["event"])
    assert line["last_checkpoint_step"] == last and line["signal"] == "SIGINT"
    assert ("--load" in str(line["event"])) is (last is not None)
