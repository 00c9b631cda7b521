"""The timeline trace: a Chrome/Perfetto trace (JSON trace-event format) of one run.

Open `<run-dir>/trace.json` in https://ui.perfetto.dev or chrome://tracing. Tracks:

  controller / trainer   one slice per driver step (`step <n>`), with sub-slices `wait data`, `train`,
                         `push weights` (itself with `pause`, `transfer`, `continue`), `save`
  controller / eval      one slice per eval point (dispatch → finished), args: step, version, metrics
  controller counters    `buffer_depth` (groups), `in_flight_samples`, `engine_requests` (calls holding
                         a limiter slot), sampled at each step, around each push and on every engine call
  engine <k> / lane <j>  one slice per engine request (`generate`, or `eval generate`), args: group id
                         (the routing key), prompt/output tokens, first and last policy version, finish
                         reason. `k` is the engine that served it (the router stamps `engine_index` into
                         the output's `meta`; outputs of a bare client, without it, go to engine 0), `j`
                         a lane: a slice is placed when it ends, on the lowest lane of its engine whose
                         last slice ended before this one started, so slices on one lane never overlap.
  failed requests        requests that raised (no engine answered for them): one slice each, `finish`
                         = "error", on their own track since no engine can be named.

Timestamps come from the event loop's clock (`loop.time()`, virtual under looptime); the file has them
in microseconds since the earliest event. Events stay in memory (at most `max_events`; later ones are
counted in `otherData.dropped_events` and left out) and the file is written once, by `close()`.
`NullTracer` has the same methods and records nothing.

A run that resumes in the same run directory appends to its trace, as to `metrics.jsonl`: `close()`
reads the trace already there and writes it back with this process's events after it, one segment per
process, shifted to start `SEGMENT_GAP_S` after the previous segment's last event (two processes' loop
clocks have no common origin). Each later segment begins with a global instant event `resumed`, and
`otherData.segments` lists each segment's start (µs); `max_events` bounds the whole file. A file there
that is not a readable trace is kept aside as `<name>.unreadable` and a new one started.
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

import structlog

from miles_aio.types import GenerateOutput

__all__ = [
    "CONTROLLER_PID",
    "ENGINE_PID_BASE",
    "FAILED_PID",
    "SEGMENT_GAP_S",
    "NullTracer",
    "RequestSpan",
    "Tracer",
    "merge_segments",
    "read_trace",
]

CONTROLLER_PID = 1
ENGINE_PID_BASE = 100
_THREADS = {"trainer": 1, "eval": 2}
SEGMENT_GAP_S = 1.0
"""Seconds of trace time between the end of one process's segment and the start of the next."""

log = structlog.get_logger("miles_aio.observability")


def _first_last_known(versions: list[int | None]) -> tuple[int | None, int | None]:
    """The first and the last known (not None) version of a request's tokens; None, None if none is."""
    if not versions:
        return None, None
    first, last = versions[0], versions[-1]
    if first is not None and last is not None:  # the common case: no per-token loop
        return first, last
    first = next((v for v in versions if v is not None), None)
    last = next((v for v in reversed(versions) if v is not None), None)
    return first, last


def _loop_time() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


@dataclass(slots=True)
class RequestSpan:
    """One engine request in progress: when it started (its track is known when it ends)."""

    start: float


FAILED_PID = ENGINE_PID_BASE - 1


class Tracer:
    """Records trace events in memory; `close()` writes `path` (see the module docstring)."""

    enabled = True

    def __init__(self, path: Path, *, max_events: int = 500_000) -> None:
        self.path = path
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._lanes: dict[int, list[float]] = {}  # engine pid → end time of each lane's last slice
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
        """An engine request begins (`routing_key` is kept by the caller for `request_end`)."""
        self._in_flight_requests += 1
        start = self.now()
        self.counter("engine_requests", self._in_flight_requests, at=start)
        return RequestSpan(start=start)

    def request_end(
        self, span: RequestSpan, name: str, *, group: Hashable | None, output: GenerateOutput | None
    ) -> None:
        """The request ended (`output` None: it failed or was cancelled): its slice on its engine's track."""
        self._in_flight_requests -= 1
        end = self.now()
        self.counter("engine_requests", self._in_flight_requests, at=end)
        if len(self.events) >= self.max_events:  # full for good: the slice is dropped, skip its layout
            self.dropped += 1
            return
        args: dict[str, Any] = {"group": group}
        if output is None:
            args["finish"] = "error"
            pid = FAILED_PID
        else:
            first, last = _first_last_known(output.weight_versions)
            args |= {
                "prompt_tokens": output.prompt_tokens,
                "tokens": len(output.output_ids),
                "version_first": first,
                "version_last": last,
                "finish": output.finish_reason,
            }
            engine = output.meta.get("engine_index", 0)
            pid = ENGINE_PID_BASE + (engine if isinstance(engine, int) else 0)
        # Slices are placed in order of their end, so a lane's last slice ends latest on that lane.
        lanes = self._lanes.setdefault(pid, [])
        lane = next((i for i, last_end in enumerate(lanes) if last_end <= span.start), len(lanes))
        if lane == len(lanes):
            lanes.append(end)
        lanes[lane] = end
        self._add(
            {
                "name": name,
                "ph": "X",
                "pid": pid,
                "tid": lane,
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
        for pid, lanes in sorted(self._lanes.items()):
            name = "failed requests" if pid == FAILED_PID else f"engine {pid - ENGINE_PID_BASE}"
            out.append(meta("process_name", pid, name))
            out += [meta("thread_name", pid, f"lane {j}", j) for j in range(len(lanes))]
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
        doc: dict[str, Any] = {
            "traceEvents": self._metadata() + events,
            "displayTimeUnit": "ms",
            "otherData": {"clock": "event loop time", "dropped_events": self.dropped, "segments": [0.0]},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        previous = self._previous()
        if previous is not None:
            doc = merge_segments(previous, doc, max_events=self.max_events)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
        tmp.replace(self.path)

    def _previous(self) -> dict[str, Any] | None:
        """The trace an earlier process of this run wrote (None: none); an unreadable one is moved aside."""
        if not self.path.exists():
            return None
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
                return doc
        except (OSError, UnicodeDecodeError, ValueError):
            pass
        aside = self.path.with_name(self.path.name + ".unreadable")
        self.path.replace(aside)
        log.warning(
            "trace: the trace already there is unreadable; kept aside, a new one started", kept=str(aside)
        )
        return None


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
        return RequestSpan(start=0.0)

    def request_end(
        self, span: RequestSpan, name: str, *, group: Hashable | None, output: GenerateOutput | None
    ) -> None:
        return None

    def close(self) -> None:
        return None


def merge_segments(previous: dict[str, Any], new: dict[str, Any], *, max_events: int) -> dict[str, Any]:
    """One trace document: `previous`'s events, then `new`'s shifted to start `SEGMENT_GAP_S` after the
    last of them (µs), behind an instant event `resumed`; track names merged, at most `max_events`
    events beyond the metadata (the newest left out and counted in `dropped_events`)."""
    old_meta = [e for e in previous["traceEvents"] if e.get("ph") == "M"]
    old = [e for e in previous["traceEvents"] if e.get("ph") != "M"]
    other = previous.get("otherData")
    old_other: dict[str, Any] = other if isinstance(other, dict) else {}
    end = max((e.get("ts", 0.0) + e.get("dur", 0.0) for e in old), default=0.0)
    start = round(end + SEGMENT_GAP_S * 1e6, 3) if old else 0.0
    shifted = [{**e, "ts": round(e["ts"] + start, 3)} for e in new["traceEvents"] if e.get("ph") != "M"]
    segments = [*old_other.get("segments", [0.0]), start]
    marker = {
        "name": "resumed",
        "ph": "i",
        "s": "g",
        "pid": CONTROLLER_PID,
        "tid": _THREADS["trainer"],
        "ts": start,
        "args": {"segment": len(segments) - 1},
    }
    events = [marker, *shifted]
    room = max(0, max_events - len(old))
    dropped = int(old_other.get("dropped_events", 0)) + new["otherData"]["dropped_events"]
    dropped += max(0, len(events) - room)
    meta, seen = [], set()
    for e in old_meta + [e for e in new["traceEvents"] if e.get("ph") == "M"]:
        key = (e.get("name"), e.get("pid"), e.get("tid"), json.dumps(e.get("args"), sort_keys=True))
        if key not in seen:
            seen.add(key)
            meta.append(e)
    return {
        "traceEvents": meta + old + events[:room],
        "displayTimeUnit": new.get("displayTimeUnit", "ms"),
        "otherData": {**new["otherData"], "dropped_events": dropped, "segments": segments},
    }


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, int | float | str | bool | None) else str(v) for k, v in args.items()}


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file (for tests and tools)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    events: list[dict[str, Any]] = doc["traceEvents"]
    return events
