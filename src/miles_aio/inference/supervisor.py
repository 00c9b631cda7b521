"""`supervise_engines`: restart launched engines whose process died, and tell the router.

    async with local_engines(...) as launcher:                      # owns every process it starts
        procs = await launcher.start_all(n)
        async with EngineRouter.open([p.url for p in procs]) as router, asyncio.TaskGroup() as tg:
            tg.create_task(supervise_engines(router, launcher, procs, policy), name="engine-supervisor")

One task per engine (`engine-watch-<i>`) waits for its process to exit (never polls). An exit is a death:
the router marks the engine RESTARTING (`engine_died`); `availability.restart_delay` says how long to wait
before the next start, or to give up; a start that fails counts as a restart and is retried the same way.
A started engine (on a new port) replaces the old one in the router (`replace_engine`), which probes it,
loads the current weights into it and only then routes to it. Restarts spent: `engine_lost`, and once
every engine is lost the router's fleet task fails the run. Cancel the task to stop supervising (before the
launcher stops the processes, or their exits would look like deaths).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import structlog

from miles_aio.inference.availability import RestartPolicy, restart_delay
from miles_aio.inference.router import EngineRouter

__all__ = ["EngineLauncher", "EngineProcess", "supervise_engines"]

log = structlog.get_logger("miles_aio.inference.supervisor")


class EngineProcess(Protocol):
    """One started engine process, serving at `url`."""

    @property
    def url(self) -> str: ...

    @property
    def pid(self) -> int: ...

    async def wait(self) -> int:
        """Its exit code, once it has exited."""
        ...


class EngineLauncher(Protocol):
    async def start(self, index: int) -> EngineProcess:
        """Start engine `index` (again) and return it once it serves; raise if it cannot start."""
        ...


async def supervise_engines(
    router: EngineRouter,
    launcher: EngineLauncher,
    procs: Sequence[EngineProcess],
    policy: RestartPolicy,
) -> None:
    """Watch every engine process and restart those that die; runs until cancelled."""
    async with asyncio.TaskGroup() as tg:
        for i, proc in enumerate(procs):
            tg.create_task(_watch(router, launcher, i, proc, policy), name=f"engine-watch-{i}")


async def _watch(
    router: EngineRouter, launcher: EngineLauncher, index: int, proc: EngineProcess, policy: RestartPolicy
) -> None:
    restarts = 0
    while True:
        rc = await proc.wait()
        reason = f"engine process {proc.pid} exited with code {rc}"
        log.warning("engine_died", index=index, url=proc.url, pid=proc.pid, returncode=rc)
        router.engine_died(index, reason)
        while True:
            delay = restart_delay(policy, restarts)
            if delay is None:
                log.error("engine_lost", index=index, restarts=restarts, reason=reason)
                router.engine_lost(index, f"{reason}; {restarts} restarts spent (--engine-max-restarts)")
                return
            await asyncio.sleep(delay)
            restarts += 1
            try:
                proc = await launcher.start(index)
            except Exception as e:  # a failed start is one more spent restart, not a crash of the run
                reason = f"restart {restarts} failed: {e}"
                log.warning("engine_restart_failed", index=index, attempt=restarts, error=str(e)[-2000:])
                continue
            log.info("engine_restarted", index=index, url=proc.url, pid=proc.pid, attempt=restarts)
            await router.replace_engine(index, proc.url)
            break
