"""Shared test helpers: run coroutines on virtual time (looptime) with a wall-clock and virtual deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def run_virtual(coro: Coroutine[Any, Any, T], *, virtual_timeout_s: float = 10_000.0) -> T:
    """Run `coro` on an event loop whose clock only advances when every task is waiting.

    Sleeps cost no wall time, so latency-driven fakes run in milliseconds and deterministically.
    `virtual_timeout_s` bounds the virtual time, pytest-timeout bounds the wall time.
    """

    async def bounded() -> T:
        async with asyncio.timeout(virtual_timeout_s):
            return await coro

    import looptime  # here, not at the top: tests/gpu runs on machines without the test extra

    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(bounded())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@pytest.fixture
def vrun() -> Callable[..., Any]:
    return run_virtual


KINDS = ("pure", "vtime", "procs")  # the kind of a test: a marker (tests/README.md), not a folder
# a test without a kind marker of its own (its module's `pytestmark`) gets one from the fixtures it uses
_PROCS_FIXTURES = {"engine", "client", "engine_proc", "parity_server", "server_url", "server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(k) for k in KINDS):
            continue
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _PROCS_FIXTURES:
            item.add_marker(pytest.mark.procs)
        elif "vrun" in fixtures:
            item.add_marker(pytest.mark.vtime)


def _live_children() -> dict[int, str]:
    """Live (non-zombie) child processes of this pytest process: pid → command line."""
    import os
    from pathlib import Path

    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().split(") ", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out[int(entry.name)] = cmd
    return out


@pytest.fixture(autouse=True, scope="module")
def no_orphan_processes(request: pytest.FixtureRequest) -> Any:
    """Every process a test module starts must be gone when the module ends (no orphans, ever)."""
    import os
    import signal
    import time

    before = set(_live_children())
    yield
    deadline = time.monotonic() + 10  # a child may still be on its way out
    while (
        left := {p: c for p, c in _live_children().items() if p not in before}
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{request.module.__name__} left child processes behind: {left}"
