"""Helpers for the inference client/router tests: stub servers as real processes, and SGLang's schema.

Every test talks HTTP to a real server: the in-process `SGLangStubServer` (a fake SGLang that does no
model work, scripted per test), the stub as a separate process (so it can be SIGKILLed and restarted on
the same port), or the embedded engine (`tests/inference/test_contract.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

import miles_aio

READY_TIMEOUT_S = 20.0
SRC_DIR = str(Path(miles_aio.__file__).resolve().parents[1])
"""Where miles_aio is imported from here, put on the stub process's PYTHONPATH."""


class StubProcess:
    """`python -m miles_aio.testing.sglang_stub_server` on loopback; `kill()` and `start()` it at will."""

    def __init__(self, *args: str, module: str = "miles_aio.testing.sglang_stub_server") -> None:
        self.args = args
        self.module = module
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start it (again, on the same port once it has one) and wait for its ready line."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            self.module,
            "--port",
            str(self.port),
            *(("--check-schema",) if self.module.endswith("stub_server") else ()),
            *self.args,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(READY_TIMEOUT_S):
            ready = json.loads(await self.proc.stdout.readline())
        assert ready["event"] == "ready", ready
        assert ready["pid"] == self.proc.pid, ready
        self.port = int(ready["port"])

    async def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed engine would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def stub_processes(n: int, *args: str) -> AsyncIterator[list[StubProcess]]:
    procs = [StubProcess(*args) for _ in range(n)]
    try:
        for p in procs:
            await p.start()
        yield procs
    finally:
        for p in procs:
            await p.stop()


async def script(url: str, *, faults: list[dict[str, Any]] | None = None, **config: Any) -> None:
    """Script a stub server (in-process or not) over its control endpoints."""
    async with httpx.AsyncClient(base_url=url, trust_env=False) as c:
        if faults:
            (await c.post("/_stub/faults", json={"faults": faults})).raise_for_status()
        if config:
            (await c.post("/_stub/config", json=config)).raise_for_status()


async def recorded(url: str, path: str = "/generate") -> list[dict[str, Any]]:
    """What a stub server received on `path`: [{"body", "routing_key"}, ...]."""
    async with httpx.AsyncClient(base_url=url, trust_env=False) as c:
        resp = await c.get("/_stub/requests", params={"path": path})
        resp.raise_for_status()
        data: list[dict[str, Any]] = resp.json()
        return data


def expected_tokens(input_ids: list[int], n: int, vocab_size: int = 1000) -> list[int]:
    """What the stub generates after `input_ids` (its arithmetic, see its module docstring)."""
    last = input_ids[-1] if input_ids else 0
    return [(last + 1 + i) % vocab_size for i in range(n)]
