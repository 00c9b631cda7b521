"""`launch_sglang_servers`: start SGLang servers for `--rollout-backend sglang`, always take them down.

    async with launch_sglang_servers(model_path, num_engines=2, gpus_per_engine=4, gpu_offset=8) as urls:
        ...  # urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]

Each engine is `python -m sglang.launch_server --model-path M --host H --port P --tp-size G ...` with
`CUDA_VISIBLE_DEVICES` set to its own G GPUs (after the trainer's, `gpu_offset`), plus every
`--sglang-<flag>` the user passed, forwarded as `--<flag>`. SGLang prints no machine-readable ready
line, so readiness is `/health_generate` answering 200 — probed every `_PROBE_INTERVAL_S` until a
deadline, while also watching for the process to die (then the tail of its log is raised). Each
server's output goes to `<log_dir>/sglang-<i>.log`.

Each engine runs in its own session (process group), because SGLang forks scheduler and detokenizer
processes: teardown signals the whole group — SIGTERM, `_TERM_GRACE_S` to exit, then SIGKILL — on every
exit path (normal, exception, Ctrl-C), so no GPU is left held by an orphan. If the controller dies
without a teardown (SIGKILL, OOM killer), each server gets SIGTERM from the kernel (`PR_SET_PDEATHSIG`,
see `_pdeathsig`) and takes its own children down.

`sglang_servers()` is the launcher underneath: `start(i)` starts server i again on its GPUs (first killing
what is left of the dead one's group) for the supervisor that restarts dead engines (`inference.supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.inference._pdeathsig import die_with_parent

__all__ = ["SGLangServers", "SGLangStartError", "launch_sglang_servers", "sglang_command", "sglang_servers"]

log = structlog.get_logger("miles_aio.inference.sglang_launch")
_PROBE_INTERVAL_S: Final = 2.0  # how often an unready server is asked /health_generate
_TERM_GRACE_S: Final = 15.0
_TAIL_LINES: Final = 80


class SGLangStartError(RuntimeError):
    """A server exited, or was not healthy by the deadline."""


@dataclass(eq=False)
class _Server:
    index: int
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait(self) -> int:
        return await self.proc.wait()

    def stderr_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        except OSError:
            return "(no output)"
        return "\n".join(lines) or "(no output)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def sglang_command(
    model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp_size),
        *extra_args,
    ]  # fmt: skip


class SGLangServers:
    """The launcher of `sglang_servers()`: starts SGLang servers (`start`, `start_all`); the context
    manager stops every one it ever started. Engine i always gets the same GPUs, a fresh port each start
    (unless `commands` fixes it), and logs to `<log_dir>/sglang-<i>.log` (a restart appends to it)."""

    def __init__(
        self,
        model_path: Path | str,
        *,
        gpus_per_engine: int,
        gpu_offset: int,
        host: str,
        extra_args: Sequence[str],
        ready_timeout_s: float,
        log_dir: Path,
        commands: Sequence[Sequence[str]] | None,
        env: Mapping[str, str] | None,
    ) -> None:
        self._model_path, self._gpus, self._offset = str(model_path), gpus_per_engine, gpu_offset
        self._host, self._extra, self._ready_timeout_s = host, list(extra_args), ready_timeout_s
        self._log_dir, self._commands, self._env = log_dir, commands, env
        self.servers: list[_Server] = []

    async def _spawn(self, i: int) -> _Server:
        for old in self.servers:  # a dead server's own children (schedulers) may still hold its GPUs
            if old.index == i:
                _signal_group(old.proc, signal.SIGKILL)
        host = self._host
        port = free_port(host)
        if self._commands is not None:
            cmd = list(self._commands[i])
            port = int(cmd[cmd.index("--port") + 1])
        else:
            cmd = sglang_command(
                self._model_path, host=host, port=port, tp_size=self._gpus, extra_args=self._extra
            )
        gpus = range(self._offset + i * self._gpus, self._offset + (i + 1) * self._gpus)
        child_env = {**os.environ, **(self._env or {}), "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        log_path = self._log_dir / f"sglang-{i}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *die_with_parent(cmd),  # SIGTERM when this process dies, even by SIGKILL
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=child_env,
                start_new_session=True,  # its own process group: teardown reaches SGLang's children
            )
        server = _Server(i, f"http://{host}:{port}", proc, log_path)
        self.servers.append(server)
        return server

    async def _ready(self, servers: list[_Server]) -> None:
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client,
                asyncio.timeout(self._ready_timeout_s),
            ):
                await asyncio.gather(*(_wait_healthy(client, s) for s in servers))
        except TimeoutError:
            raise SGLangStartError(
                f"SGLang servers not healthy after {self._ready_timeout_s} s:\n"
                + "\n".join(f"[engine {s.index}] {s.stderr_tail()}" for s in servers)
            ) from None

    async def start_all(self, num_engines: int) -> list[_Server]:
        """Start engines 0..num_engines-1 together; return them once every one is healthy."""
        servers = [await self._spawn(i) for i in range(num_engines)]
        await self._ready(servers)
        log.info("sglang servers ready", urls=[s.url for s in servers])
        return servers

    async def start(self, index: int) -> _Server:
        """Start engine `index` again (after it died); return it once it is healthy."""
        server = await self._spawn(index)
        await self._ready([server])
        return server


@asynccontextmanager
async def sglang_servers(
    model_path: Path | str,
    *,
    gpus_per_engine: int = 1,
    gpu_offset: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    log_dir: Path | str = ".",
    commands: Sequence[Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[SGLangServers]:
    """A launcher of SGLang servers; every server it started is taken down on exit (the whole group)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    launcher = SGLangServers(
        model_path,
        gpus_per_engine=gpus_per_engine,
        gpu_offset=gpu_offset,
        host=host,
        extra_args=extra_args,
        ready_timeout_s=ready_timeout_s,
        log_dir=log_dir,
        commands=commands,
        env=env,
    )
    try:
        yield launcher
    finally:  # even when cancelled: no orphan may keep a GPU
        await finish_even_if_cancelled(_stop_all(launcher.servers))


@asynccontextmanager
async def launch_sglang_servers(
    model_path: Path | str,
    *,
    num_engines: int,
    gpus_per_engine: int = 1,
    gpu_offset: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    log_dir: Path | str = ".",
    commands: Sequence[Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[list[str]]:
    """Start `num_engines` servers and yield their URLs once every one is healthy.

    `commands` replaces the SGLang command lines (one per engine, each must serve on the port its
    URL names): the tests run the embedded engine through this same launcher.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    async with sglang_servers(
        model_path,
        gpus_per_engine=gpus_per_engine,
        gpu_offset=gpu_offset,
        host=host,
        extra_args=extra_args,
        ready_timeout_s=ready_timeout_s,
        log_dir=log_dir,
        commands=commands,
        env=env,
    ) as launcher:
        yield [s.url for s in await launcher.start_all(num_engines)]


async def _wait_healthy(client: httpx.AsyncClient, server: _Server) -> None:
    while True:
        if server.proc.returncode is not None:
            raise SGLangStartError(
                f"engine {server.index} exited with code {server.proc.returncode} before it was healthy:\n"
                f"{server.stderr_tail()}"
            )
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(f"{server.url}/health_generate")).status_code == 200:
                return
        # A deliberate probe interval: the server offers nothing to wait on until it listens.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.proc.wait(), timeout=_PROBE_INTERVAL_S)


async def _stop_all(servers: list[_Server]) -> None:
    await asyncio.gather(*(_stop(s) for s in servers))


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(server: _Server) -> None:
    proc = server.proc
    _signal_group(proc, signal.SIGTERM)  # even if the leader exited, its children may not have
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            log.warning("sglang server did not exit after SIGTERM; killing", index=server.index, pid=proc.pid)
    _signal_group(proc, signal.SIGKILL)
    await proc.wait()
