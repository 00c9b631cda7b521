"""`launch_local_engines`: start N embedded engines as child processes and always take them down again.

    async with launch_local_engines(model_dir, num_engines=2) as urls:
        ...  # urls == ["http://127.0.0.1:41233", "http://127.0.0.1:40111"]

Each child is `python -m miles_aio.engine --port 0 --exit-on-stdin-eof ...`. The launcher reads
each child's stdout until its one JSON "ready" line (so no port is guessed and nothing polls); after that
line the child points its stdout at its stderr, so the pipe never fills. Stderr goes to
`<log_dir>/engine-<i>.log` (a fresh temporary folder if none is given, removed again on exit), so no task
has to drain it. A child that exits before it is ready raises `EngineStartError` with the tail of its log.
`local_engines()` is the launcher underneath: `start(i)` starts engine i again (a fresh port) for the
supervisor that restarts dead engines (`inference.supervisor`); it stops every engine it started on exit.

Each child runs in its own session (process group): a terminal's Ctrl-C or a job scheduler's SIGTERM goes
to the controller's foreground group, and must reach only the controller, which finishes its step, saves
and then stops the engines itself (an engine killed by the same signal would fail the step it is serving).
Cleanup, on every exit path (normal, exception, cancellation): SIGTERM to the child's group, up to
`_TERM_GRACE_S` to exit, then SIGKILL. If the controller itself is SIGKILLed, the children get SIGTERM from
the kernel (`PR_SET_PDEATHSIG`, see `_pdeathsig`) and also see stdin EOF, and exit on their own.

`api_key` (the run's `--sglang-api-key`) is passed as the engines' API key (in their environment, out
of the process list), so they refuse requests without it, as SGLang servers given that key do; the run's
client sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.engine.cli import API_KEY_ENV  # the engine program's interface; imports no torch
from miles_aio.inference._pdeathsig import die_with_parent

__all__ = ["EngineStartError", "LocalEngines", "launch_local_engines", "local_engines"]

_log = structlog.get_logger(__name__)
_TERM_GRACE_S: Final = 10.0
_STDERR_TAIL_LINES: Final = 60


class EngineStartError(RuntimeError):
    """An engine process exited, or stayed silent, before printing its ready line."""


@dataclass(eq=False)
class _Child:
    index: int
    proc: asyncio.subprocess.Process
    log_path: Path
    url: str = ""
    """Set once the engine printed its ready line."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait(self) -> int:
        return await self.proc.wait()

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_STDERR_TAIL_LINES:]
        except OSError:
            lines = []
        return "\n".join(lines) or "(no stderr output)"


class LocalEngines:
    """The launcher of `local_engines()`: starts embedded engine processes (`start`, `start_all`); the
    context manager stops every one it ever started. Engine i logs to `<log_dir>/engine-<i>.log` (a
    restart appends to it) and gets a fresh port each start."""

    def __init__(
        self, cmd: Sequence[str], logs: Path, ready_timeout_s: float, env: Mapping[str, str] | None = None
    ) -> None:
        self._cmd, self._logs, self._ready_timeout_s = list(cmd), logs, ready_timeout_s
        self._env = None if env is None else {**os.environ, **env}
        self.children: list[_Child] = []

    async def _spawn(self, index: int) -> _Child:
        log_path = self._logs / f"engine-{index}.log"
        with log_path.open("ab") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *die_with_parent(self._cmd),  # SIGTERM when this process dies, even by SIGKILL
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=self._env,
                start_new_session=True,  # the terminal's / scheduler's group signals reach only us
            )
        child = _Child(index, proc, log_path)
        self.children.append(child)
        return child

    async def _ready(self, children: list[_Child]) -> None:
        try:
            async with asyncio.timeout(self._ready_timeout_s):
                for c in children:
                    c.url = await _wait_ready(c)
        except TimeoutError:
            raise EngineStartError(
                f"engine not ready after {self._ready_timeout_s} s; stderr tail:\n"
                + "\n".join(f"[engine {c.index}] {c.tail()}" for c in children)
            ) from None

    async def start_all(self, num_engines: int) -> list[_Child]:
        """Start engines 0..num_engines-1 together; return them once every one is ready."""
        children = [await self._spawn(i) for i in range(num_engines)]
        await self._ready(children)
        _log.info("engines.ready", urls=[c.url for c in children], pids=[c.pid for c in children])
        return children

    async def start(self, index: int) -> _Child:
        """Start engine `index` (again, e.g. after it died); return it once it is ready."""
        child = await self._spawn(index)
        await self._ready([child])
        return child


@asynccontextmanager
async def local_engines(
    model_path: Path | str,
    *,
    weights_root: Path | str | None = None,
    num_threads: int = 1,
    max_running_requests: int | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    log_dir: Path | str | None = None,
    api_key: str | None = None,
) -> AsyncIterator[LocalEngines]:
    """A launcher of embedded engines on loopback ports; every engine it started is stopped on exit."""
    cmd = [
        sys.executable,
        "-m",
        "miles_aio.engine",
        "--model-path",
        str(model_path),
        "--port",
        "0",
        "--num-threads",
        str(num_threads),
        "--exit-on-stdin-eof",
    ]
    if weights_root is not None:
        cmd += ["--weights-root", str(weights_root)]
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    # The key goes by environment, not argv: any local user can read a process's command line.
    env = {API_KEY_ENV: api_key} if api_key else None
    cmd += list(extra_args)
    own_logs = log_dir is None  # a temporary folder of ours: removed once the engines are down
    logs = Path(tempfile.mkdtemp(prefix="miles-aio-engines-")) if log_dir is None else Path(log_dir)
    launcher = LocalEngines(cmd, logs, ready_timeout_s, env)
    try:
        logs.mkdir(parents=True, exist_ok=True)
        yield launcher
    finally:
        # The stop runs to completion even if this task is cancelled (again) meanwhile: a cancelled caller
        # must not leave children behind. The cancellation is re-raised once they are gone.
        try:
            await finish_even_if_cancelled(_stop_all(launcher.children))
        finally:
            if own_logs:
                shutil.rmtree(logs, ignore_errors=True)


@asynccontextmanager
async def launch_local_engines(
    model_path: Path | str,
    *,
    num_engines: int,
    weights_root: Path | str | None = None,
    num_threads: int = 1,
    max_running_requests: int | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    log_dir: Path | str | None = None,
    api_key: str | None = None,
) -> AsyncIterator[list[str]]:
    """Start `num_engines` engines on loopback ports and yield their base URLs (in start order)."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    async with local_engines(
        model_path,
        weights_root=weights_root,
        num_threads=num_threads,
        max_running_requests=max_running_requests,
        extra_args=extra_args,
        ready_timeout_s=ready_timeout_s,
        log_dir=log_dir,
        api_key=api_key,
    ) as launcher:
        yield [c.url for c in await launcher.start_all(num_engines)]


async def _wait_ready(child: _Child) -> str:
    assert child.proc.stdout is not None
    while line := await child.proc.stdout.readline():
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # not ours (a library printing to stdout); keep waiting for the ready line
        if isinstance(msg, dict) and msg.get("event") == "ready":
            host = str(msg["host"])
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind: dial loopback
            return f"http://[{host}]:{msg['port']}" if ":" in host else f"http://{host}:{msg['port']}"
    rc = await child.proc.wait()
    raise EngineStartError(
        f"engine {child.index} exited with code {rc} before it was ready; stderr tail:\n{child.tail()}"
    )


async def _stop_all(children: list[_Child]) -> None:
    await asyncio.gather(*(_stop(c) for c in children))


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """Signal the child's own process group (it leads it): anything it started goes down with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(child: _Child) -> None:
    proc = child.proc
    if proc.returncode is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            _log.warning(
                "engine.kill",
                index=child.index,
                pid=proc.pid,
                hint=f"no exit {_TERM_GRACE_S} s after SIGTERM",
            )
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()
