"""Engines die with their launcher: a controller that is SIGKILLed (no teardown runs) leaves no server.

A controller-like parent process launches a server through the real launcher, reports the server's pid,
then is killed with SIGKILL; the server must be gone within a few seconds (`PR_SET_PDEATHSIG`). For the
SGLang launcher the stand-in server is the SGLang stub (same health endpoint); it has no stdin watch, so
only the parent-death signal can take it down.
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

from miles_aio.inference._pdeathsig import die_with_parent
from miles_aio.models.tiny import build_tiny_llama

pytestmark = [
    pytest.mark.procs,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"),
]

_GONE_WITHIN_S = 10.0

# The parent: launch one server, print its pid (a child of this process), then wait to be killed.
_PRELUDE = """
import asyncio, json, os, sys
from pathlib import Path

def report(urls: list[str]) -> None:
    kids = [int(p) for t in os.listdir("/proc/self/task")
            for p in open(f"/proc/self/task/{t}/children").read().split()]
    print(json.dumps({"urls": urls, "children": kids}), flush=True)
"""
_RUN = "\nasyncio.run(main())\n"
_SGLANG_PARENT = (
    _PRELUDE
    + """
from miles_aio.inference.sglang_launch import free_port, launch_sglang_servers

async def main() -> None:
    cmd = [sys.executable, "-m", "miles_aio.testing.sglang_stub_server", "--port", str(free_port())]
    logs = Path(sys.argv[1])
    async with launch_sglang_servers("unused", num_engines=1, commands=[cmd], log_dir=logs) as urls:
        report(urls)
        await asyncio.Event().wait()
"""
    + _RUN
)

_LOCAL_PARENT = (
    _PRELUDE
    + """
from miles_aio.inference.local_launch import launch_local_engines

async def main() -> None:
    async with launch_local_engines(sys.argv[2], num_engines=1, log_dir=Path(sys.argv[1])) as urls:
        report(urls)
        await asyncio.Event().wait()
"""
    + _RUN
)


def _alive(pid: int) -> bool:
    """Running (not a zombie: a reparented child is reaped by init, or by the test's subreaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _kill_parent_and_check(script: str, *args: str, log: Path) -> None:
    with log.open("wb") as err:
        parent = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    children: list[int] = []
    try:
        assert parent.stdout is not None
        while line := parent.stdout.readline():  # skip log lines; the report is the one with "children"
            if line.startswith(b'{"urls"'):
                children = json.loads(line)["children"]
                break
        assert children, f"the launcher started no child process; its stderr:\n{log.read_text()}"
        assert all(_alive(pid) for pid in children)
        os.kill(parent.pid, signal.SIGKILL)  # no finally, no teardown: only the kernel can help now
        parent.wait()
        deadline = time.monotonic() + _GONE_WITHIN_S
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in children if _alive(pid)]
        assert not left, f"servers {left} outlived their SIGKILLed launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        for pid in children:  # don't leak servers from a failing run
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sglang_servers_die_when_the_controller_is_sigkilled(tmp_path: Path) -> None:
    _kill_parent_and_check(_SGLANG_PARENT, str(tmp_path), log=tmp_path / "parent.log")


def test_local_engines_die_when_the_controller_is_sigkilled(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "m", alphabet="abc", hidden_size=32, num_heads=2, num_kv_heads=1)
    _kill_parent_and_check(_LOCAL_PARENT, str(tmp_path / "logs"), str(model), log=tmp_path / "parent.log")


def test_wrapper_refuses_to_start_when_the_launcher_is_already_gone() -> None:
    # The race the getppid check closes: the expected parent pid is not our parent (as if it had died
    # before the prctl), so the real command must never run.
    cmd = die_with_parent([sys.executable, "-c", "print('ran')"])
    pid_at = cmd.index(str(os.getpid()))
    cmd[pid_at] = "1"  # pretend the launcher was pid 1's child... i.e. not our parent
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 3, out
    assert "ran" not in out.stdout
    assert "launcher exited" in out.stderr


def test_wrapper_execs_the_command_in_place() -> None:
    out = subprocess.run(
        die_with_parent([sys.executable, "-c", "import os; print(os.getpid())"]),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().isdecimal()
