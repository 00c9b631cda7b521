"""`http_servers`: start third-party inference servers (SGLang, vLLM) as child processes, always take them
down again. `sglang_launch` and `vllm_launch` each describe their server as a `ServerKind`; this module is
the one launcher both use.

    async with http_servers(SGLANG, model_path, log_dir=run_dir / "logs") as launcher:
        servers = await launcher.start_all(2)   # [s.url for s in servers] == ["http://127.0.0.1:4..", ...]

Engine i gets GPUs `gpu_offset + i*G .. gpu_offset + (i+1)*G - 1` (`CUDA_VISIBLE_DEVICES`, after the
trainer's), a fresh port on each start (unless `commands` fixes it) and logs to `<log_dir>/<kind>-<i>.log`
(a restart appends to it). Neither server prints a machine-readable ready line, so readiness is the
kind's health route answering 200, probed every `_PROBE_INTERVAL_S` while the process is watched: one
that exits first raises the kind's start error with the tail of its log, as does a deadline.

Each server runs in its own session (process group), because both fork helpers (SGLang's scheduler and
detokenizer, vLLM's engine core and workers): teardown signals the whole group — SIGTERM,
`_TERM_GRACE_S` to exit, then SIGKILL — on every exit path (normal, exception, Ctrl-C), so no orphan
keeps a GPU or the CPU. A terminal's Ctrl-C reaches only the controller's group, which then stops the
servers itself. If the controller dies without a teardown (SIGKILL, the OOM killer), each server gets
SIGTERM from the kernel (`PR_SET_PDEATHSIG`, see `_pdeathsig`) and takes its own children down.
`HTTPServers.start(i)` starts server i again (first killing what is left of the dead one's group) for
the supervisor that restarts dead engines (`inference.supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol, TypedDict, Unpack

import httpx
import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.errors import primary_error
from miles_aio.inference._pdeathsig import die_with_parent

__all__ = ["HTTPServers", "LaunchOptions", "ServerKind", "ServerProcess", "free_port", "http_servers"]

log = structlog.get_logger(__name__)
_PROBE_INTERVAL_S: Final = 2.0  # how often an unready server's health route is asked
_TERM_GRACE_S: Final = 15.0
_TAIL_LINES: Final = 80


class ServerCommand(Protocol):
    def __call__(
        self, model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
    ) -> list[str]: ...


def _same_env(env: dict[str, str]) -> dict[str, str]:
    return env


@dataclass(frozen=True, slots=True)
class ServerKind:
    """What differs between the servers this launcher starts."""

    name: str
    """"sglang": the log files are `<name>-<i>.log`, the tasks `<name>-ready-<i>`."""
    title: str
    """"SGLang": how messages name it."""
    health_path: str
    """Answers 200 once the server can generate."""
    command: ServerCommand
    start_error: type[RuntimeError]
    child_env: Callable[[dict[str, str]], dict[str, str]] = field(default=_same_env)
    """The server's environment from this process's (and the caller's `env`), before the GPUs are set."""


class LaunchOptions(TypedDict, total=False):
    """How `http_servers` starts servers (every key optional)."""

    gpus_per_engine: int
    """G GPUs per server (its tensor-parallel size); default 1."""
    gpu_offset: int
    """The first server's first GPU (the trainer's come first); default 0."""
    host: str
    """Where the servers listen; default 127.0.0.1."""
    extra_args: Sequence[str]
    """Appended to every server's command line."""
    ready_timeout_s: float
    """How long a start may take until the server is healthy; default 900 s."""
    log_dir: Path | str
    """Where `<kind>-<i>.log` goes; default the working directory."""
    commands: Sequence[Sequence[str]] | None
    """Replaces the command lines (one per engine, each serving on the port after its `--port`): the
    tests run other servers through this same launcher."""
    env: Mapping[str, str] | None
    """Added to the servers' environment."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class ServerProcess:
    """One started server (`supervisor.EngineProcess`)."""

    index: int
    url: str
    proc: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait(self) -> int:
        return await self.proc.wait()

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        except OSError:
            return "(no output)"
        return "\n".join(lines) or "(no output)"


class HTTPServers:
    """The launcher of `http_servers()` (`supervisor.EngineLauncher`): `start_all`, `start`; the context
    manager stops every server it ever started."""

    def __init__(self, kind: ServerKind, model_path: Path | str, **options: Unpack[LaunchOptions]) -> None:
        self.kind, self._model_path = kind, str(model_path)
        self._gpus, self._offset = options.get("gpus_per_engine", 1), options.get("gpu_offset", 0)
        self._host, self._extra = options.get("host", "127.0.0.1"), list(options.get("extra_args", ()))
        self._ready_timeout_s = options.get("ready_timeout_s", 900.0)
        self._log_dir = Path(options.get("log_dir", "."))
        self._commands, self._env = options.get("commands"), options.get("env")
        self.servers: list[ServerProcess] = []

    def child_env(self, i: int) -> dict[str, str]:
        """Server i's environment: the kind's, with its own GPUs."""
        gpus = range(self._offset + i * self._gpus, self._offset + (i + 1) * self._gpus)
        env = self.kind.child_env({**os.environ, **(self._env or {})})
        return {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}

    async def _spawn(self, i: int) -> ServerProcess:
        for old in self.servers:  # a dead server's own children may still hold its GPUs
            if old.index == i:
                _signal_group(old.proc, signal.SIGKILL)
        port = free_port(self._host)
        if self._commands is not None:
            cmd = list(self._commands[i])
            port = int(cmd[cmd.index("--port") + 1])
        else:
            cmd = self.kind.command(
                self._model_path, host=self._host, port=port, tp_size=self._gpus, extra_args=self._extra
            )
        log_path = self._log_dir / f"{self.kind.name}-{i}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *die_with_parent(cmd),  # SIGTERM when this process dies, even by SIGKILL
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self.child_env(i),
                start_new_session=True,  # its own process group: teardown reaches the server's children
            )
        server = ServerProcess(i, f"http://{self._host}:{port}", proc, log_path)
        self.servers.append(server)
        log.info(f"{self.kind.name}_server_started", index=i, url=server.url, pid=proc.pid, log=str(log_path))
        return server

    async def _ready(self, servers: list[ServerProcess]) -> None:
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False) as client,
                asyncio.timeout(self._ready_timeout_s),
            ):
                await self._all_healthy(client, servers)
        except TimeoutError:
            raise self.kind.start_error(
                f"{self.kind.title} servers not healthy after {self._ready_timeout_s} s:\n"
                + "\n".join(f"[engine {s.index}] {s.log_tail()}" for s in servers)
            ) from None

    async def start_all(self, num_engines: int) -> list[ServerProcess]:
        """Start engines 0..num_engines-1 together; return them once every one is healthy."""
        servers = [await self._spawn(i) for i in range(num_engines)]
        await self._ready(servers)
        log.info(f"{self.kind.name}_servers_ready", urls=[s.url for s in servers])
        return servers

    async def start(self, index: int) -> ServerProcess:
        """Start engine `index` again (after it died); return it once it is healthy."""
        server = await self._spawn(index)
        await self._ready([server])
        return server

    async def _all_healthy(self, client: httpx.AsyncClient, servers: Sequence[ServerProcess]) -> None:
        """Wait until every server is healthy (one task each); the first that dies fails the wait."""
        try:
            async with asyncio.TaskGroup() as tg:
                for s in servers:
                    tg.create_task(self._wait_healthy(client, s), name=f"{self.kind.name}-ready-{s.index}")
        except BaseExceptionGroup as eg:
            raise primary_error(eg)  # noqa: B904 - the server's own error, with its cause chain

    async def _wait_healthy(self, client: httpx.AsyncClient, server: ServerProcess) -> None:
        """Return once the health route answers 200; raise the kind's start error if the process exits."""
        while True:
            if server.proc.returncode is not None:
                raise self.kind.start_error(
                    f"{self.kind.title} engine {server.index} exited with code {server.proc.returncode} "
                    f"before it was healthy:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if (await client.get(f"{server.url}{self.kind.health_path}")).status_code == 200:
                    return
            # A deliberate probe interval: the server offers nothing to wait on until it listens.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.proc.wait(), timeout=_PROBE_INTERVAL_S)


@asynccontextmanager
async def http_servers(
    kind: ServerKind, model_path: Path | str, **options: Unpack[LaunchOptions]
) -> AsyncIterator[HTTPServers]:
    """A launcher of `kind` servers; every server it started is taken down on exit (the whole group)."""
    launcher = HTTPServers(kind, model_path, **options)
    launcher._log_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield launcher
    finally:  # even when cancelled: no orphan may keep a GPU or the CPU
        await finish_even_if_cancelled(_stop_all(launcher.kind, launcher.servers))


async def _stop_all(kind: ServerKind, servers: list[ServerProcess]) -> None:
    async with asyncio.TaskGroup() as tg:
        for s in servers:
            tg.create_task(_stop(kind, s), name=f"{kind.name}-stop-{s.index}")


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(kind: ServerKind, server: ServerProcess) -> None:
    proc = server.proc
    _signal_group(proc, signal.SIGTERM)  # even if the leader exited, its children may not have
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            log.warning(
                f"{kind.title} server did not exit after SIGTERM; killing", index=server.index, pid=proc.pid
            )
    _signal_group(proc, signal.SIGKILL)
    await proc.wait()
