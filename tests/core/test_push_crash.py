"""A controller SIGKILLed at any phase of a weight push resumes with `--load` losing and repeating nothing.

The push after step 2 (the 4th: version 1 is pushed before step 0) is killed; the checkpoint of step 1 is
the latest. The controller's phases (paused, flushed, transferred, stamped, continued) on
`recipes.simulated` (the real controller, ledger and checkpoint code, seconds per run); the transfer's
halves that involve the engine and the trainer rank in whole quickstart runs (real processes): by disk
(rank 0 wrote the weights, no engine loaded them) and by broadcast (rank 0 mid-collective). Every case:
exit -9, no process left (the engine and the rank die with the controller), then a clean resumed run
whose ledger conserves every group and trains every step once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from miles_aio import _durable
from miles_aio.checkpoint import read_latest
from tests.core._runs import Run, build_model, check_trained_once, resume
from tests.core.test_crash_consistency import resume_and_check, sim
from tests.core.test_kill_and_signals import descendants

pytestmark = pytest.mark.procs

KILLED_PUSH = 4  # the push after step 3; step_2 (--save-interval 2) is committed
PHASES = ["push:paused", "push:flushed", "push:transferred", "push:stamped", "push:continued"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", PHASES)
def test_a_kill_at_any_phase_of_a_push_resumes_losing_and_repeating_nothing(
    tmp_path: Path, point: str
) -> None:
    run_dir = tmp_path / "run"
    killed = sim(run_dir, fault=(_durable.KILL_ENV, f"{point}#{KILLED_PUSH}"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resume_and_check(run_dir, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("push-crash") / "model")


TRANSFERS = [("push:weights_written", "disk"), ("push:broadcast", "broadcast")]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("point", "mode"), TRANSFERS, ids=[p for p, _ in TRANSFERS])
def test_a_kill_mid_transfer_takes_the_engine_and_rank_down_and_resumes(
    tmp_path: Path, model: Path, point: str, mode: str
) -> None:
    run_dir, args = tmp_path / "run", ["--save-interval", "2", "--update-weight-transfer-mode", mode]
    run = Run(run_dir, model, *args, env={_durable.KILL_ENV: f"{point}#{KILLED_PUSH}"})
    try:
        run.engines()
        run.event("trainer: ranks spawned")
        run.seen |= descendants(run.proc.pid)
        assert len(run.seen) >= 2, run.tail()  # the engine and the trainer rank (at least)
        rc = run.finish(timeout_s=90)
    finally:
        run.kill_if_running()
    assert rc == -signal.SIGKILL, run.tail()
    assert run.steps() == 2 and read_latest(run_dir / "checkpoints") == 2, run.tail()  # step 3's push
    run.check_no_orphans()
    done = resume(run_dir, 4, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    check_trained_once(run_dir, 2, 4, 8)  # SMALL's --rollout-batch-size
