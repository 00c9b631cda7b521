"""Engine load, read once per step (while it trains): `perf/engine/*` metrics.

From each engine's `/server_info` `internal_states` (summed over an engine's data-parallel states):
  perf/engine/num_running_reqs, perf/engine/queue_len               totals over the engines
  perf/engine/<i>/num_running_reqs, perf/engine/<i>/queue_len       per engine
From the router's `stats()`: perf/engine/latency_p50_s, perf/engine/latency_p99_s (seconds, over its
recent requests), the same per engine (perf/engine/<i>/latency_p50_s, ..._p99_s), perf/engine/in_flight,
perf/engine/active (engines in rotation), perf/engine/excluded and perf/engine/restarts (counts so far).
Engines out of rotation (`router/engine<i>/healthy` 0: excluded, down, restarting) are not asked.

Only an engine handle that has `clients` (each with `server_info()`) and `stats()` — the
`EngineRouter` every recipe uses — reports; anything else (the fakes) gives no metric. An engine that
does not answer within `timeout_s`, or fails, is left out of that step's numbers (logged at debug).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import structlog

__all__ = ["LoadReporting", "engine_load_metrics"]

log = structlog.get_logger("miles_aio.observability")

RUNNING_KEYS = ("num_running_reqs", "#running-req")
QUEUE_KEYS = ("num_waiting_reqs", "num_queue_reqs", "queue_len", "#queue-req")
STAT_KEYS = {
    "router/latency_p50_s": "perf/engine/latency_p50_s",
    "router/latency_p99_s": "perf/engine/latency_p99_s",
    "router/in_flight": "perf/engine/in_flight",
    "router/engines_healthy": "perf/engine/active",
    "router/exclusions": "perf/engine/excluded",
    "router/restarts": "perf/engine/restarts",
}


class _InfoClient(Protocol):
    async def server_info(self) -> dict[str, Any]: ...


@runtime_checkable
class LoadReporting(Protocol):
    """What engine load is read from (`EngineRouter`)."""

    @property
    def clients(self) -> Sequence[_InfoClient]: ...

    def stats(self) -> dict[str, float]: ...


def _first(state: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for k in keys:
        v = state.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


async def _one(client: _InfoClient, timeout_s: float) -> tuple[float, float] | None:
    try:
        async with asyncio.timeout(timeout_s):
            info = await client.server_info()
    except Exception as e:  # a metric must never fail the run (CancelledError is not an Exception)
        log.debug("engine load unavailable", error=repr(e))
        return None
    states = info.get("internal_states") or []
    running = [r for s in states if isinstance(s, Mapping) and (r := _first(s, RUNNING_KEYS)) is not None]
    queued = [q for s in states if isinstance(s, Mapping) and (q := _first(s, QUEUE_KEYS)) is not None]
    if not running and not queued:
        return None
    return sum(running), sum(queued)


async def engine_load_metrics(engine: object, *, timeout_s: float = 2.0) -> dict[str, float]:
    """`perf/engine/*` of `engine` now (empty if it does not report load)."""
    if not isinstance(engine, LoadReporting):
        return {}
    stats = engine.stats()
    asked = [(i, c) for i, c in enumerate(engine.clients) if stats.get(f"router/engine{i}/healthy", 1.0)]
    async with asyncio.TaskGroup() as tg:  # a frozen engine must not hold every step for timeout_s
        tasks = [(i, tg.create_task(_one(c, timeout_s), name=f"engine-load-{i}")) for i, c in asked]
    out: dict[str, float] = {}
    answered = [(i, r) for i, t in tasks if (r := t.result()) is not None]
    for i, (running, queued) in answered:
        out[f"perf/engine/{i}/num_running_reqs"] = running
        out[f"perf/engine/{i}/queue_len"] = queued
    if answered:
        out["perf/engine/num_running_reqs"] = sum(r for _, (r, _) in answered)
        out["perf/engine/queue_len"] = sum(q for _, (_, q) in answered)
    out |= {name: stats[key] for key, name in STAT_KEYS.items() if key in stats}
    for i in range(len(engine.clients)):
        if (p50 := stats.get(f"router/engine{i}/latency_p50_s")) is not None:
            out[f"perf/engine/{i}/latency_p50_s"] = p50
        if (p99 := stats.get(f"router/engine{i}/latency_p99_s")) is not None:
            out[f"perf/engine/{i}/latency_p99_s"] = p99
    return out
