"""The timeline trace: a Chrome/Perfetto trace (JSON trace-event format) of one run.

Open `<run-dir>/trace.json` in https://ui.perfetto.dev or chrome://tracing. Tracks:

  controller / trainer   one slice per driver step (`step <n>`), with sub-slices `wait data`, `train`,
                         `push weights` (itself with `pause`, `transfer`, `continue`), `save`
  controller / eval      one slice per eval point (dispatch → finished), args: step, version, metrics
  controller counters    `buffer_depth` (groups), `in_flight_samples`, `engine_requests` (calls holding
                         a limiter slot), sampled at each step, around each push and on every engine call
  engine <k> / slot <j>  one slice per engine request (`generate`, or `eval generate`), args: group id
                         (the routing key), prompt/output tokens, first and last policy version, finish
                         reason. `k` is the engine *slot* `hash(routing_key) % num_engines` (the router's
                         actual choice is not visible through the `InferenceEngine` interface; a group's
                         requests always land in one slot), `j` a lane: the lowest one free when the
                         request started, so slices on one lane never overlap.

Timestamps come from the event loop's clock (`loop.time()`, virtual under looptime); the file has them
in microseconds since the earliest event. Events stay in memory (at most `max_events`; later ones are
counted in `otherData.dropped_events` and left out) and the file is written once, by `close()`.
`NullTracer` has the same methods and records nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_aio.types import GenerateOutput

__all__ = ["CONTROLLER_PID", "ENGINE_PID_BASE", "NullTracer", "RequestSpan", "Tracer", "read_trace"]

CONTROLLER_PID = 1
ENGINE_PID_BASE = 100
_THREADS = {"trainer": 1, "eval": 2}


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@dataclass(slots=True)
class RequestSpan:
    """One engine request in progress: where its slice goes and when it started."""

    engine: int
    lane: int
    start: float


class Tracer:
    """Records trace events in memory; `close()` writes `path` (see the module docstring)."""

    enabled = True

    def __init__(self, path: Path, *, num_engines: int = 1, max_events: int = 500_000) -> None:
        self.path = path
        self.num_engines = max(1, num_engines)
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._lanes: dict[int, list[bool]] = {}  # engine slot → busy flag per lane
        self._round_robin = 0
        self._in_flight_requests = 0
        self._closed = False

    # -- clock ----------------------------------------------------------------------------------------
    def now(self) -> float:
        """The loop clock (seconds): pass it back as `start` of `complete()`."""
        return _loop_time()

    # -- controller tracks ------------------------------------------------------------------------------
    def complete(self, name: str, *, track: str, start: float, end: float | None = None, **args: Any) -> None:
        """A finished slice on a controller track (`trainer`, `eval`) from `start` to `end` (default now)."""
        end = self.now() if end is None else end
        self._add(
            {
                "name": name,
                "ph": "X",
                "pid": CONTROLLER_PID,
                "tid": _THREADS.get(track, 3),
                "ts": start,
                "dur": max(0.0, end - start),
                "args": _jsonable(args),
            }
        )

    @contextmanager
    def slice(self, name: str, *, track: str, **args: Any) -> Iterator[dict[str, Any]]:
        """`with tracer.slice("push weights", track="trainer", version=3) as a:` — a slice around the
        block (also when it raises); `a` is its args dict, to add to before the block ends."""
        start = self.now()
        try:
            yield args
        finally:
            self.complete(name, track=track, start=start, **args)

    def counter(self, name: str, value: float, *, at: float | None = None) -> None:
        """A sample of the counter track `name`."""
        self._add(
            {
                "name": name,
                "ph": "C",
                "pid": CONTROLLER_PID,
                "ts": self.now() if at is None else at,
                "args": {"value": float(value)},
            }
        )

    # -- engine tracks ----------------------------------------------------------------------------------
    def request_start(self, routing_key: Hashable | None) -> RequestSpan:
        """An engine request begins: take the lowest free lane of its engine slot."""
        if routing_key is None:
            engine, self._round_robin = self._round_robin % self.num_engines, self._round_robin + 1
        else:
            engine = hash(routing_key) % self.num_engines
        lanes = self._lanes.setdefault(engine, [])
        lane = next((i for i, busy in enumerate(lanes) if not busy), len(lanes))
        if lane == len(lanes):
            lanes.append(True)
        lanes[lane] = True
        self._in_flight_requests += 1
        start = self.now()
        self.counter("engine_requests", self._in_flight_requests, at=start)
        return RequestSpan(engine=engine, lane=lane, start=start)

    def request_end(
        self, span: RequestSpan, name: str, *, group: Hashable | None, output: GenerateOutput | None
    ) -> None:
        """The request ended (`output` None: it failed or was cancelled): its slice; the lane is free."""
        args: dict[str, Any] = {"group": group}
        if output is None:
            args["finish"] = "error"
        else:
            versions = [v for v in output.weight_versions if v is not None]
            args |= {
                "prompt_tokens": output.prompt_tokens,
                "tokens": len(output.output_ids),
                "version_first": versions[0] if versions else None,
                "version_last": versions[-1] if versions else None,
                "finish": output.finish_reason,
            }
        self._lanes[span.engine][span.lane] = False
        self._in_flight_requests -= 1
        end = self.now()
        self.counter("engine_requests", self._in_flight_requests, at=end)
        self._add(
            {
                "name": name,
                "ph": "X",
                "pid": ENGINE_PID_BASE + span.engine,
                "tid": span.lane,
                "ts": span.start,
                "dur": max(0.0, end - span.start),
                "args": _jsonable(args),
            }
        )

    # -- output -----------------------------------------------------------------------------------------
    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append(event)

    def _metadata(self) -> list[dict[str, Any]]:
        def meta(kind: str, pid: int, name: str, tid: int = 0) -> dict[str, Any]:
            return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}

        out = [meta("process_name", CONTROLLER_PID, "controller")]
        out += [meta("thread_name", CONTROLLER_PID, track, tid) for track, tid in _THREADS.items()]
        for engine, lanes in sorted(self._lanes.items()):
            out.append(meta("process_name", ENGINE_PID_BASE + engine, f"engine {engine}"))
            out += [meta("thread_name", ENGINE_PID_BASE + engine, f"slot {j}", j) for j in range(len(lanes))]
        return out

    def close(self) -> None:
        """Write the trace file (once). Slices are sorted by start, longer first, so parents precede
        the children that start with them."""
        if self._closed:
            return
        self._closed = True
        origin = min((e["ts"] for e in self.events), default=0.0)
        events = sorted(self.events, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        for e in events:  # loop seconds → microseconds since the first event (rounding keeps nesting)
            start = e["ts"]
            e["ts"] = round((start - origin) * 1e6, 3)
            if "dur" in e:
                e["dur"] = round(round((start + e["dur"] - origin) * 1e6, 3) - e["ts"], 3)
        doc = {
            "traceEvents": self._metadata() + events,
            "displayTimeUnit": "ms",
            "otherData": {"clock": "event loop time", "dropped_events": self.dropped},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
        tmp.replace(self.path)


class NullTracer(Tracer):
    """The tracer of a run without `--trace`: every method does nothing."""

    enabled = False

    def __init__(self) -> None:
        super().__init__(Path("/dev/null"))

    def complete(self, name: str, *, track: str, start: float, end: float | None = None, **args: Any) -> None:
        return None

    def counter(self, name: str, value: float, *, at: float | None = None) -> None:
        return None

    def request_start(self, routing_key: Hashable | None) -> RequestSpan:
        return RequestSpan(engine=0, lane=0, start=0.0)

    def request_end(
        self, span: RequestSpan, name: str, *, group: Hashable | None, output: GenerateOutput | None
    ) -> None:
        return None

    def close(self) -> None:
        return None


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, int | float | str | bool | None) else str(v) for k, v in args.items()}


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file (for tests and tools)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    events: list[dict[str, Any]] = doc["traceEvents"]
    return events
