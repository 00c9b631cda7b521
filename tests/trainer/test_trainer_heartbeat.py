"""A killed trainer rank fails the run at once, a frozen one within --trainer-heartbeat-timeout-s, each with
the reason, exit 1, no process left and the ledger conserved (and `--load` resumes); a rank busy in a long
command keeps beating (a thread of its own), so only a frozen one goes silent."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from miles_aio.checkpoint import read_latest
from miles_aio.trainer import protocol
from miles_aio.trainer.channel import BlockingChannel
from miles_aio.trainer.rank_main import _start_heartbeat
from tests.core._runs import Run, build_model, check_trained_once, resume

pytestmark = pytest.mark.procs


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_trainer_rank_fails_the_run_and_load_resumes_it(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    run = Run(run_dir, model, "--save-interval", "2")
    try:
        run.wait_steps(3)
        (pid,) = run.event("trainer: ranks spawned")["pids"]
        os.kill(pid, signal.SIGKILL)
        rc = run.finish(timeout_s=60)
    finally:
        run.kill_if_running()
    assert rc == 1, run.tail()
    assert "TrainerRankError: trainer rank 0: exited with code -9" in run.tail(30), run.tail()
    run.check_aftermath()  # the engine stopped on the way out; the open groups recorded pending_at_exit
    saved = read_latest(run_dir / "checkpoints")
    assert saved is not None and saved >= 2  # step_2 at least: --save-interval 2 counts steps done
    done = resume(run_dir, saved + 2, "--save-interval", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    check_trained_once(run_dir, saved, saved + 2, 8)  # SMALL's --rollout-batch-size


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_frozen_trainer_rank_fails_the_run_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    run = Run(tmp_path / "run", model, "--trainer-heartbeat-timeout-s", "3")
    try:
        # the rank's start-up (init, model load) and every step so far were longer than nothing: it beat
        run.wait_steps(3)
        (pid,) = run.event("trainer: ranks spawned")["pids"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        run.event("trainer: rank stopped answering", timeout_s=30)
        noticed = time.monotonic() - t0
        rc = run.finish(timeout_s=60)
    finally:
        run.kill_if_running()
    assert 2.5 <= noticed < 3 + 6, noticed  # the timeout, plus at most one beat interval and a log line
    assert rc == 1, run.tail()
    assert "no heartbeat for 3s (--trainer-heartbeat-timeout-s)" in run.tail(30)
    run.check_aftermath()  # the frozen rank too: SIGKILLed on the way out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("work", ["torch", "python"])
def test_a_rank_busy_in_a_long_command_keeps_beating(work: str) -> None:
    """The heartbeat thread beats on time while the command loop computes (torch kernels, or pure Python
    holding the GIL between switches) for several timeouts' worth."""
    ours, theirs = socket.socketpair()
    chan = BlockingChannel(ours)
    beats: list[float] = []

    def read() -> None:
        reader = BlockingChannel(theirs)
        while True:
            try:
                msg = reader.recv()
            except (ConnectionError, OSError, protocol.ProtocolError):
                return
            if msg.op == "heartbeat":
                beats.append(time.monotonic())

    reader = threading.Thread(target=read, name="test-heartbeat-reader", daemon=True)
    reader.start()
    timeout_s = 0.6
    _start_heartbeat(chan, timeout_s)
    t0 = time.monotonic()
    x = torch.randn(256, 256)
    while time.monotonic() - t0 < 5 * timeout_s:  # a "train step" five times the timeout
        if work == "torch":
            x = torch.tanh(x @ x)
        else:
            sum(i * i for i in range(20_000))
    chan.close()
    reader.join(timeout=5)
    theirs.close()
    gaps = [b - a for a, b in zip([t0, *beats], beats, strict=False)]
    assert len(beats) >= 10, beats  # one every timeout/6
    assert max(gaps) < timeout_s, gaps  # never silent for a timeout while busy
