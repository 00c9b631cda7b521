"""Requests/s of `SGLangClient` against a bare aiohttp loop, on a zero-work local server.

    python -m benchmarks.client [--output PATH] [--requests N] [--max-seconds S] [--rounds R]

Starts `miles_aio.testing.sglang_stub_server` (a fake SGLang server that does no model work) as a separate
process on loopback, then, for 1, 64 and 1024 requests in flight, measures:

* `aiohttp`: a bare `aiohttp.ClientSession` loop that POSTs the same body, reads it and `json.loads` it;
* `SGLangClient`: the real client (rid, validation, per-token versions) on its default transport;
* `SGLangClient+httpcore`: the same client on httpx's own transport, to show why that is not the default
  (httpx's pool slows down sharply with many concurrent requests, encode/httpx#3215).

Every side is measured under the controller's `paced_gc()`, as the client runs in a run: what exists
at the start is frozen and full passes are paced (the young passes a run also paces by requests, in
the rollout context, are not: no side goes through one). Under CPython's defaults,
a full pass walks every imported module (~1 per 5,000 requests here), and the client's few extra
objects per request brought one pass more than the bare loop's: the 1,024-in-flight ratio moved
between 0.85 and 1.08 from run to run (session 20).

Each row is the best of `--rounds` interleaved rounds (the machine may be shared); each measurement is
bounded by a request count and a wall-clock cap. Besides requests/s it reports the client process's CPU
time per request, which other load on the machine disturbs less. The target is client/aiohttp >= 0.95
(issue [7/8]).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from miles_aio._gc import paced_gc
from miles_aio.inference.client import SGLangClient

CONCURRENCY = (1, 64, 1024)
PROMPT = list(range(1, 129))  # 128 prompt tokens
SAMPLING = {"max_new_tokens": 16, "temperature": 1.0}
READY_TIMEOUT_S = 30.0
TARGET_RATIO = 0.95
One = Callable[[], Awaitable[None]]


@contextlib.contextmanager
def stub_server_process() -> Iterator[str]:
    """Run the stub server as a child process on loopback; yield its URL; SIGTERM it on exit."""
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "miles_aio.testing.sglang_stub_server", "--host", "127.0.0.1", "--port", "0"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True) as proc:
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())  # the stub prints its ready line within ~1 s
            yield f"http://{ready['host']}:{ready['port']}"
        finally:
            proc.terminate()
            proc.wait(timeout=READY_TIMEOUT_S)


async def drive(one: One, *, in_flight: int, total: int, max_s: float) -> tuple[float, float]:
    """Run `one` up to `total` times with `in_flight` workers, stopping at `max_s` seconds.

    Returns (requests/s, this process's CPU µs per request).
    """
    done = started = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    deadline = t0 + max_s

    async def worker() -> None:
        nonlocal done, started
        while started < total and time.perf_counter() < deadline:
            started += 1
            await one()
            done += 1

    async with asyncio.TaskGroup() as tg:
        for i in range(in_flight):
            tg.create_task(worker(), name=f"bench-worker-{i}")
    return done / (time.perf_counter() - t0), (time.process_time() - cpu0) / max(done, 1) * 1e6


@contextlib.asynccontextmanager
async def bare_aiohttp(url: str) -> AsyncIterator[One]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2048)) as session:

        async def one() -> None:
            body = {"input_ids": PROMPT, "sampling_params": SAMPLING, "return_logprob": True, "stream": False}
            data, headers = json.dumps(body).encode(), {"Content-Type": "application/json"}
            async with session.post(f"{url}/generate", data=data, headers=headers) as resp:
                json.loads(await resp.read())

        yield one


@contextlib.asynccontextmanager
async def sglang_client(url: str, *, httpcore: bool) -> AsyncIterator[One]:
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=2048)) if httpcore else None
    async with SGLangClient(url, transport=transport) as client:

        async def one() -> None:
            await client.generate(input_ids=PROMPT, sampling_params=SAMPLING)

        yield one


async def bench(url: str, *, requests: int, max_s: float, rounds: int) -> list[dict[str, Any]]:
    impls: dict[str, Callable[[], contextlib.AbstractAsyncContextManager[One]]] = {
        "aiohttp": lambda: bare_aiohttp(url),
        "SGLangClient": lambda: sglang_client(url, httpcore=False),
        "SGLangClient+httpcore": lambda: sglang_client(url, httpcore=True),
    }
    rows = []
    for c in CONCURRENCY:
        total = max(requests, 4 * c)
        row: dict[str, Any] = {"in_flight": c, "requests": total}
        for rnd in range(rounds):
            for name, make in impls.items():
                if name.endswith("httpcore") and rnd > 0:
                    continue  # slow at high concurrency; one round shows it
                async with make() as one:
                    await drive(one, in_flight=c, total=2 * c + 50, max_s=max_s)  # warm-up: connections
                    async with paced_gc():  # the collector as in a run, for every side (module docstring)
                        rps, cpu_us = await drive(one, in_flight=c, total=total, max_s=max_s)
                row[f"{name}_rps"] = max(row.get(f"{name}_rps", 0.0), rps)
                row[f"{name}_cpu_us"] = min(row.get(f"{name}_cpu_us", float("inf")), cpu_us)
        row["ratio"] = row["SGLangClient_rps"] / row["aiohttp_rps"]
        row["ratio_httpcore"] = row["SGLangClient+httpcore_rps"] / row["aiohttp_rps"]
        rows.append(row)
        print(f"  {c} in flight: done", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--requests", type=int, default=4000, help="requests per measurement (>= 4x in flight)")
    p.add_argument("--max-seconds", type=float, default=10.0, help="wall-clock cap per measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best of each is kept")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1024 connections need > 1024 descriptors
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with stub_server_process() as url:
        rows = asyncio.run(bench(url, requests=args.requests, max_s=args.max_seconds, rounds=args.rounds))
    print(f"\nSGLangClient vs a bare aiohttp loop, zero-work stub server on loopback "
          f"({platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()})")  # fmt: skip
    print(f"{'in flight':>9} | {'aiohttp':>14} | {'SGLangClient':>14} | {'ratio':>5} | "
          f"{'client+httpcore':>15} | {'ratio':>5}")  # fmt: skip
    print(f"{'':>9} | {'req/s (µs CPU)':>14} | {'req/s (µs CPU)':>14} | {'':>5} | {'req/s':>15} |")
    for r in rows:
        a = f"{r['aiohttp_rps']:.0f} ({r['aiohttp_cpu_us']:.0f})"
        s = f"{r['SGLangClient_rps']:.0f} ({r['SGLangClient_cpu_us']:.0f})"
        print(f"{r['in_flight']:>9} | {a:>14} | {s:>14} | {r['ratio']:>5.2f} | "
              f"{r['SGLangClient+httpcore_rps']:>15.0f} | {r['ratio_httpcore']:>5.2f}")  # fmt: skip
    worst = min(r["ratio"] for r in rows)
    verdict = "OK" if worst >= TARGET_RATIO else "BELOW TARGET"
    print(f"worst ratio {worst:.2f} (target >= {TARGET_RATIO}): {verdict}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"rows": rows, "target_ratio": TARGET_RATIO}, indent=2) + "\n")


if __name__ == "__main__":
    main()
