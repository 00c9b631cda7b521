"""`launch_local_engines`: start N embedded engines as child processes and always take them down again.

    async with launch_local_engines(model_dir, num_engines=2) as urls:
        ...  # urls == ["http://127.0.0.1:41233", "http://127.0.0.1:40111"]

Each child is `python -m miles_aio.inference.local --port 0 --exit-on-stdin-eof ...`. The launcher reads
each child's stdout until its one JSON "ready" line (so no port is guessed and nothing polls), and drains
stderr into a bounded tail in the meantime (a full pipe would block the child). A child that exits before
it is ready raises `EngineStartError` with that tail.

Cleanup, on every exit path (normal, exception, cancellation): SIGTERM, up to `_TERM_GRACE_S` to exit, then
SIGKILL. If the controller itself is SIGKILLed, the children see stdin EOF and exit on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import structlog

from miles_aio._aio import finish_even_if_cancelled

__all__ = ["EngineStartError", "launch_local_engines"]

_log = structlog.get_logger(__name__)
_TERM_GRACE_S: Final = 10.0
_STDERR_TAIL_LINES: Final = 60


class EngineStartError(RuntimeError):
    """An engine process exited, or stayed silent, before printing its ready line."""


@dataclass(eq=False)
class _Child:
    index: int
    proc: asyncio.subprocess.Process
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    drains: list[asyncio.Task[None]] = field(default_factory=list)

    def tail(self) -> str:
        return "".join(self.stderr_tail) or "(no stderr output)"


@asynccontextmanager
async def launch_local_engines(
    model_path: Path | str,
    *,
    num_engines: int,
    weights_root: Path | str | None = None,
    num_threads: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
) -> AsyncIterator[list[str]]:
    """Start `num_engines` engines on loopback ports and yield their base URLs (in start order)."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    cmd = [
        sys.executable,
        "-m",
        "miles_aio.inference.local",
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
    cmd += list(extra_args)
    children: list[_Child] = []
    try:
        for i in range(num_engines):
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            child = _Child(i, proc)
            children.append(child)
            child.drains.append(asyncio.create_task(_drain_stderr(child), name=f"engine-{i}-stderr"))
        try:
            async with asyncio.timeout(ready_timeout_s):
                urls = [await _wait_ready(c) for c in children]
        except TimeoutError:
            raise EngineStartError(
                f"engine not ready after {ready_timeout_s} s; stderr tail:\n"
                + "\n".join(f"[engine {c.index}] {c.tail()}" for c in children)
            ) from None
        for child in children:  # nothing else is expected on stdout, but a full pipe would block the child
            child.drains.append(
                asyncio.create_task(_drain_stdout(child), name=f"engine-{child.index}-stdout")
            )
        _log.info("engines.ready", urls=urls, pids=[c.proc.pid for c in children])
        yield urls
    finally:
        # The stop runs to completion even if this task is cancelled (again) meanwhile: a cancelled caller
        # must not leave children behind. The cancellation is re-raised once they are gone.
        await finish_even_if_cancelled(_stop_all(children))


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
    for task in child.drains:  # let stderr reach EOF so the tail is complete
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(task), timeout=2.0)
    raise EngineStartError(
        f"engine {child.index} exited with code {rc} before it was ready; stderr tail:\n{child.tail()}"
    )


async def _drain_stderr(child: _Child) -> None:
    assert child.proc.stderr is not None
    while line := await child.proc.stderr.readline():
        child.stderr_tail.append(line.decode(errors="replace"))


async def _drain_stdout(child: _Child) -> None:
    assert child.proc.stdout is not None
    while await child.proc.stdout.read(4096):
        pass


async def _stop_all(children: list[_Child]) -> None:
    await asyncio.gather(*(_stop(c) for c in children))
    for child in children:
        for task in child.drains:
            task.cancel()
        await asyncio.gather(*child.drains, return_exceptions=True)


async def _stop(child: _Child) -> None:
    proc = child.proc
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            _log.warning(
                "engine.kill",
                index=child.index,
                pid=proc.pid,
                hint=f"no exit {_TERM_GRACE_S} s after SIGTERM",
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()
