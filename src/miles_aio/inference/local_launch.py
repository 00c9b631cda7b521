"""`launch_local_engines`: start N embedded engines as child processes and always take them down again.

    async with launch_local_engines(model_dir, num_engines=2) as urls:
        ...  # urls == ["http://127.0.0.1:41233", "http://127.0.0.1:40111"]

Each child is `python -m miles_aio.engine --port 0 --exit-on-stdin-eof ...`. The launcher reads
each child's stdout until its one JSON "ready" line (so no port is guessed and nothing polls); after that
line the child points its stdout at its stderr, so the pipe never fills. Stderr goes to
`<log_dir>/engine-<i>.log` (a fresh temporary folder if none is given, removed again on exit), so no task
has to drain it. A child that exits before it is ready raises `EngineStartError` with the tail of its log.

Cleanup, on every exit path (normal, exception, cancellation): SIGTERM, up to `_TERM_GRACE_S` to exit, then
SIGKILL. If the controller itself is SIGKILLed, the children get SIGTERM from the kernel
(`PR_SET_PDEATHSIG`, see `_pdeathsig`) and also see stdin EOF, and exit on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.inference._pdeathsig import die_with_parent

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
    log_path: Path

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_STDERR_TAIL_LINES:]
        except OSError:
            lines = []
        return "\n".join(lines) or "(no stderr output)"


@asynccontextmanager
async def launch_local_engines(
    model_path: Path | str,
    *,
    num_engines: int,
    weights_root: Path | str | None = None,
    num_threads: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    log_dir: Path | str | None = None,
) -> AsyncIterator[list[str]]:
    """Start `num_engines` engines on loopback ports and yield their base URLs (in start order)."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
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
    cmd += list(extra_args)
    own_logs = log_dir is None  # a temporary folder of ours: removed once the engines are down
    logs = Path(tempfile.mkdtemp(prefix="miles-aio-engines-")) if log_dir is None else Path(log_dir)
    children: list[_Child] = []
    try:
        logs.mkdir(parents=True, exist_ok=True)
        for i in range(num_engines):
            log_path = logs / f"engine-{i}.log"
            with log_path.open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *die_with_parent(cmd),  # SIGTERM when this process dies, even by SIGKILL
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log_file,
                )
            children.append(_Child(i, proc, log_path))
        try:
            async with asyncio.timeout(ready_timeout_s):
                urls = [await _wait_ready(c) for c in children]
        except TimeoutError:
            raise EngineStartError(
                f"engine not ready after {ready_timeout_s} s; stderr tail:\n"
                + "\n".join(f"[engine {c.index}] {c.tail()}" for c in children)
            ) from None
        _log.info("engines.ready", urls=urls, pids=[c.proc.pid for c in children])
        yield urls
    finally:
        # The stop runs to completion even if this task is cancelled (again) meanwhile: a cancelled caller
        # must not leave children behind. The cancellation is re-raised once they are gone.
        try:
            await finish_even_if_cancelled(_stop_all(children))
        finally:
            if own_logs:
                shutil.rmtree(logs, ignore_errors=True)


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
