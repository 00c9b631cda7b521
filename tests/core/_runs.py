"""A whole quickstart run (controller, embedded engines, trainer rank: real processes) watched through its
JSON log lines, for the tests that SIGKILL / SIGSTOP its children or kill it; its resume with `--load`, and
the check that a resumed history trains every step once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miles_aio.checkpoint import read_controller_state, step_dir
from miles_aio.ledger import check_conservation, committed_marker, read_ledger
from tests.core.test_kill_and_signals import SMALL, alive, descendants

Event = dict[str, Any]
QUICKSTART = [sys.executable, "-m", "recipes.quickstart", "--log-format", "json"]


def build_model(directory: Path) -> Path:
    """The quickstart's tiny model, barely trained (these tests need processes, not accuracy)."""
    from miles_aio.tasks.arithmetic import make_splits, warm_start

    train, _ = make_splits()
    warm_start(directory, train, target_accuracy=0.0, max_steps=1, check_every=1)
    return directory


class Run:
    """`python -m recipes.quickstart` with --log-format json; a thread collects its stderr events."""

    def __init__(self, run_dir: Path, model: Path, *extra: str, env: Mapping[str, str] | None = None) -> None:
        run_dir.mkdir(parents=True)
        shutil.copytree(model, run_dir / "model")  # the recipe's warm start finds it and skips
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [*QUICKSTART, "--run-dir", str(run_dir), *SMALL, "--num-rollout", "100000", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.events: list[Event] = []
        self.text: list[str] = []
        self.seen: set[int] = set()
        """Every descendant process seen (checked for orphans at the end)."""
        self._reader = threading.Thread(target=self._read, name="run-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.text.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.events.append(event)

    def wait(self, predicate: Callable[[Event], bool], what: str, timeout_s: float = 60.0) -> Event:
        """The first event (from the start) that matches; fails after `timeout_s` or if the run exits."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        while True:
            self.seen |= descendants(self.proc.pid)
            for e in self.events[checked:]:
                if predicate(e):
                    return e
            checked = len(self.events)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {what} (exit {self.proc.poll()}); stderr tail:\n{self.tail()}")
            time.sleep(0.1)  # another process's output: nothing to wait on but its lines

    def event(self, name: str, what: str = "", timeout_s: float = 60.0, **fields: Any) -> Event:
        def match(e: Event) -> bool:
            return e.get("event") == name and all(e.get(k) == v for k, v in fields.items())

        return self.wait(match, what or f"{name} {fields}", timeout_s)

    def steps(self) -> int:
        return sum(1 for e in self.events if e.get("event") == "step")

    def wait_steps(self, n: int, timeout_s: float = 60.0) -> None:
        target = self.steps() + n
        self.wait(lambda e: self.steps() >= target, f"{n} more steps", timeout_s)

    def engines(self) -> tuple[list[int], list[str]]:
        ready = self.event("engines.ready")
        return list(ready["pids"]), list(ready["urls"])

    def finish(self, timeout_s: float = 60.0) -> int:
        """Wait for the exit; return its code (the reader has every line by then)."""
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return rc

    def stop(self) -> int:
        """SIGTERM: the run finishes its step, saves and exits 143."""
        self.seen |= descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        return self.finish()

    def kill_if_running(self) -> None:
        """For the test's `finally`: a failed test leaves nothing running (or an open pipe) behind."""
        if self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            self.proc.kill()
            self.finish()
            for p in self.seen:
                if alive(p):
                    os.kill(p, signal.SIGKILL)

    def tail(self, n: int = 60) -> str:
        return "".join(self.text[-n:])

    def check_no_orphans(self) -> None:
        """Every child seen (restarted ones too) is gone within 15 s (those left are killed, and fail it)."""
        deadline = time.monotonic() + 15
        while (left := [p for p in self.seen if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"orphans: {left}"

    def check_aftermath(self) -> dict[str, int]:
        """No orphan (every child, restarted ones too, is gone) and a conserved ledger."""
        self.check_no_orphans()
        return check_conservation(read_ledger(self.run_dir / "ledger.jsonl"))


def resume(run_dir: Path, num_rollout: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """`--load <run-dir>/checkpoints` into the same run dir, up to `num_rollout` steps, no fault hook set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_AIO_FAULT_")}
    argv = [*QUICKSTART, "--run-dir", str(run_dir), *SMALL, "--num-rollout", str(num_rollout), *extra]
    return subprocess.run(
        [*argv, "--load", str(run_dir / "checkpoints")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


def check_trained_once(run_dir: Path, saved: int, n: int, per_step: int) -> list[Event]:
    """The ledger of a run stopped and then resumed once (from step `saved`, what `latest` named) to `n`
    steps conserves every group, and the history that survives (the first run up to the committed marker,
    then the resumed run) trains each step once, whole, and no group twice. Returns the ledger's events."""
    marker = read_controller_state(step_dir(run_dir / "checkpoints", saved)).ledger_checkpoint
    events = read_ledger(run_dir / "ledger.jsonl")
    resumes = [i for i, e in enumerate(events) if e.get("event") == "resume"]
    assert [events[i] for i in resumes] == [{"event": "resume", "from_step": saved, "checkpoint": marker}]
    check_conservation(events)
    at = committed_marker(events[: resumes[0]], saved, marker)
    assert at is not None
    trained = [
        (e["step"], e["group_id"]) for e in events[:at] + events[resumes[0] :] if e.get("fate") == "trained"
    ]
    assert Counter(s for s, _ in trained) == dict.fromkeys(range(1, n + 1), per_step)  # none lost or twice
    assert len({g for _, g in trained}) == n * per_step  # no group trained twice
    return events
