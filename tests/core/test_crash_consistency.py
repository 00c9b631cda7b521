"""A save is crash-consistent: killed at any phase, or out of disk or on a read-only file system at any
write, a run leaves `latest` naming a whole checkpoint that its ledger knows, a ledger that parses, and
`--load` resumes it losing and repeating nothing. Real controller processes (`recipes.simulated`: the
real controller, ledger and checkpoint code over the fake engine and trainer, seconds per run), faults
from `miles_aio._durable`'s hooks (a SIGKILL at a phase or in the middle of a write; ENOSPC or EROFS
after half a write), and a real full disk (a tiny tmpfs) where this machine lets us mount one."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_aio import _durable
from miles_aio.checkpoint import read_latest, step_dir
from miles_aio.controller import Controller
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import Group
from tests.core._runs import check_trained_once
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

B = 4  # groups per step
FAST = [
    *("--num-rollout", "6", "--save-interval", "2", "--rollout-batch-size", str(B)),
    *("--n-samples-per-prompt", "2", "--train-step-s", "0.02"),
    *("--latency-p50-s", "0.01", "--latency-p99-s", "0.05"),
]


def sim(run_dir: Path, *extra: str, fault: tuple[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_AIO_FAULT_")}
    if fault is not None:
        env[fault[0]] = fault[1]
    argv = ["--run-dir", str(run_dir), "--save", str(run_dir / "checkpoints"), *FAST, *extra]
    return subprocess.run(
        [sys.executable, "-m", "recipes.simulated", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def reported_error(stderr: str) -> str:
    """The exception line of the traceback a failed run printed last (notes come after it)."""
    lines = [ln for ln in stderr.splitlines() if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Group): ", ln)]
    assert lines, stderr[-3000:]
    return lines[-1]


def resume_and_check(run_dir: Path, expected_latest: int, n: int = 6) -> list[dict[str, Any]]:
    """`--load` the checkpoints: the run finishes, the ledger conserves every group, and the history that
    survives (run 1 up to the committed marker, then the resumed run) trains every step once, whole."""
    ckpt = run_dir / "checkpoints"
    assert read_latest(ckpt) == expected_latest
    read_ledger(run_dir / "ledger.jsonl")  # the interrupted run's ledger parses (one torn last line at most)
    done = sim(run_dir, "--num-rollout", str(n), "--load", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    return check_trained_once(run_dir, expected_latest, n, B)


# The second save (step_4) is interrupted; the first (step_2) is committed. `latest` moves to 4 only
# once its rename is done: a kill anywhere before leaves 2, with step 4's marker possibly in the ledger.
KILLS = [
    ("save:begin", 2),
    ("write:fake_trainer.json", 2),  # the trainer's files, half written
    ("save:trainer_saved", 2),
    ("write:ledger.jsonl:checkpoint", 2),  # the marker, half written: a torn last line
    ("save:ledger_marked", 2),
    ("write:controller_state.json", 2),
    ("save:state_written", 2),
    ("write:latest", 2),
    ("save:latest_published", 4),
]


@pytest.mark.parametrize(("point", "expected_latest"), KILLS, ids=[p for p, _ in KILLS])
def test_a_kill_at_any_phase_of_a_save_resumes_losing_and_repeating_nothing(
    tmp_path: Path, point: str, expected_latest: int
) -> None:
    run_dir = tmp_path / "run"
    killed = sim(run_dir, fault=(_durable.KILL_ENV, f"{point}#2"))
    assert killed.returncode == -9, killed.stderr[-3000:]
    before = read_ledger(run_dir / "ledger.jsonl")
    markers = [e["step"] for e in before if e.get("event") == "checkpoint"]
    marked = point in (
        "save:ledger_marked",
        "write:controller_state.json",
        "save:state_written",
        "write:latest",
    )
    torn_marker = point == "write:ledger.jsonl:checkpoint"  # half the marker's write: its first line, or less
    if torn_marker:
        assert markers in ([2], [2, 4])
    else:  # step 4's marker is in the ledger once written, committed only once `latest` names it
        assert markers == ([2, 4] if marked or expected_latest == 4 else [2])
    state_written = (step_dir(run_dir / "checkpoints", 4) / "controller_state.json").exists()
    assert state_written == (point in ("save:state_written", "write:latest", "save:latest_published"))
    events = resume_and_check(run_dir, expected_latest)
    repairs = [e for e in events if e.get("event") == "repaired_tail"]
    assert [r["action"] for r in repairs] == (["dropped_torn_line"] if torn_marker else [])


# ENOSPC after half of one write of the second save (or of the 4th ordinary ledger write, at a step's
# start): the run fails with that error, not a secondary one, and the first checkpoint stays the latest.
ENOSPC = ["fake_trainer.json", "ledger.jsonl:checkpoint", "controller_state.json", "latest", "ledger.jsonl#4"]


@pytest.mark.parametrize("what", ENOSPC)
def test_a_full_disk_at_any_write_reports_it_and_keeps_the_last_checkpoint(tmp_path: Path, what: str) -> None:
    run_dir = tmp_path / "run"
    failed = sim(run_dir, fault=(_durable.ENOSPC_ENV, what if "#" in what else f"{what}#2"))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert reported_error(failed.stderr).startswith(
        f"OSError: [Errno {errno.ENOSPC}] No space left on device"
    )
    events = resume_and_check(run_dir, 2)
    assert any(e.get("event") == "repaired_tail" for e in events) == what.startswith("ledger")


@pytest.mark.parametrize("what", ENOSPC)
def test_a_read_only_file_system_at_any_write_reports_it_and_keeps_the_last_checkpoint(
    tmp_path: Path, what: str
) -> None:
    """EROFS (a file system remounted read-only under the run) at the same writes, by the errno hook."""
    run_dir = tmp_path / "run"
    spec = f"EROFS:{what if '#' in what else f'{what}#2'}"
    failed = sim(run_dir, fault=(_durable.OSERROR_ENV, spec))
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert reported_error(failed.stderr).startswith(f"OSError: [Errno {errno.EROFS}] Read-only file system")
    events = resume_and_check(run_dir, 2)
    assert any(e.get("event") == "repaired_tail" for e in events) == what.startswith("ledger")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:  # not root (the hook tests above still run)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_real_full_disk_reports_enospc_and_resumes_once_there_is_room(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    failed = sim(run_dir, "--num-rollout", "10000")  # checkpoints every 2 steps until the disk is full
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert reported_error(failed.stderr).startswith(
        f"OSError: [Errno {errno.ENOSPC}] No space left on device"
    )
    latest = read_latest(run_dir / "checkpoints")
    assert latest is not None and latest >= 2
    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # room again
    resume_and_check(run_dir, latest, n=latest + 5)


# -- the first error is the one reported (in process) ---------------------------------------------------
class ExplodingTrainer(FakeTrainer):
    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        raise RuntimeError("train exploded")


def controller(tmp_path: Path, trainer: FakeTrainer, **cfg: Any) -> Controller:
    config = make_config(tmp_path / "run", **cfg)
    return Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 10.0), tokens_per_s=10, seed=7),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )


@pytest.fixture
def ledger_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's first ordinary write fails with ENOSPC (the one `close()` makes, in these runs)."""
    from collections import Counter as _Counter

    monkeypatch.setattr(_durable, "_seen", _Counter())
    monkeypatch.setenv(_durable.ENOSPC_ENV, "ledger.jsonl")


@pytest.mark.usefixtures("ledger_enospc")
def test_a_failing_close_does_not_replace_the_error_the_run_failed_with(vrun: Any, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="train exploded") as info:
        vrun(controller(tmp_path, ExplodingTrainer()).run())
    assert any("closing the ledger" in n and "No space left" in n for n in info.value.__notes__)


@pytest.mark.usefixtures("ledger_enospc")
def test_a_failing_close_of_a_healthy_run_is_its_error(vrun: Any, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space left") as info:
        vrun(controller(tmp_path, FakeTrainer(), num_rollout=1).run())
    assert info.value.errno == errno.ENOSPC


class RecordingTrainer(FakeTrainer):
    def __init__(self) -> None:
        super().__init__(step_time_s=1.0)
        self.saves: list[int] = []

    async def save(self, step: int, directory: Path) -> None:
        self.saves.append(step)
        await super().save(step, directory)


def test_a_stop_before_the_first_resumed_step_does_not_rewrite_the_committed_checkpoint(
    vrun: Any, tmp_path: Path
) -> None:
    """Re-saving the step `latest` names would overwrite its files in place: a crash then would leave
    `latest` naming a torn checkpoint. Nothing was trained since it, so nothing is saved."""
    ckpt = tmp_path / "ckpt"
    vrun(controller(tmp_path, FakeTrainer(), num_rollout=3, save=ckpt, save_interval=3).run())
    assert read_latest(ckpt) == 3
    trainer = RecordingTrainer()
    ctl = controller(tmp_path, trainer, num_rollout=6, save=ckpt, save_interval=3, load=ckpt)

    async def stopped_at_once() -> None:
        run = asyncio.create_task(ctl.run(), name="resumed-run")
        await asyncio.sleep(0.01)  # resumed, waiting for the first batch
        ctl.request_stop()
        summary = await run
        assert ctl.stopped and summary.steps == 3  # steps done: those of step_3, none since

    vrun(stopped_at_once())
    assert trainer.saves == [] and read_latest(ckpt) == 3
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
