"""The timeline trace: valid trace-event JSON, the expected tracks and slices, proper nesting."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.observability.trace import (
    CONTROLLER_PID,
    ENGINE_PID_BASE,
    FAILED_PID,
    NullTracer,
    Tracer,
    read_trace,
)
from miles_aio.types import GenerateOutput
from tests.observability._run import run_controller

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]


def check_nesting(events: list[dict[str, Any]]) -> None:
    """Complete ("X") slices on one (pid, tid) track must nest: each inside the one open, or after it."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    for slices in tracks.values():
        stack: list[float] = []
        for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-3, f"{e['name']} overlaps its parent"
            stack.append(end)


def inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    return bool(
        parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3
    )


def test_run_writes_a_valid_perfetto_trace(vrun: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_controller(vrun, run_dir, num_rollout=4, eval_prompts=3, eval_interval=2)
    events = read_trace(run_dir / "trace.json")
    for e in events:
        assert e["ph"] in {"X", "C", "M"} and isinstance(e["pid"], int) and e["name"]
        if e["ph"] != "M":
            assert e["ts"] >= 0.0
        if e["ph"] == "X":
            assert e["dur"] >= 0.0 and isinstance(e["tid"], int)
    names = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert ("process_name", "controller") in names
    assert ("process_name", "engine 0") in names
    assert {("thread_name", "trainer"), ("thread_name", "eval"), ("thread_name", "lane 0")} <= names
    slices = [e for e in events if e["ph"] == "X"]
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in slices:
        by_name[e["name"]].append(e)
    assert {f"step {i}" for i in range(1, 5)} <= set(by_name)
    assert len(by_name["push weights"]) == 5  # the initial push and one per step
    for sub in ("pause", "transfer", "continue"):
        assert len(by_name[sub]) == 5
        assert all(any(inside(s, p) for p in by_name["push weights"]) for s in by_name[sub])
    assert all(any(inside(t, s) for s in slices if s["name"].startswith("step ")) for t in by_name["train"])
    assert all(e["args"]["version"] >= 1 for e in by_name["push weights"])
    # the transfer (FakeTrainer.sync_time_s) takes time inside the push
    assert all(e["dur"] >= 0.5e6 for e in by_name["transfer"])
    assert len(by_name["eval point"]) == 3  # before training, after steps 2 and 4
    assert all(e["tid"] == 2 and "eval/held/accuracy" in e["args"] for e in by_name["eval point"])
    gens = by_name["generate"]
    answered = [e for e in gens if e["args"]["finish"] != "error"]  # others: cancelled at the run's end
    assert answered and all(e["pid"] == ENGINE_PID_BASE for e in answered)  # FakeLatencyEngine: no router
    assert all(e["pid"] == FAILED_PID for e in gens if e["args"]["finish"] == "error")
    assert by_name["eval generate"]
    assert {"group", "tokens", "version_first", "version_last", "finish"} <= set(gens[0]["args"])
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"buffer_depth", "in_flight_samples", "engine_requests"} <= counters
    assert all(e["pid"] == CONTROLLER_PID for e in events if e["ph"] == "C")
    check_nesting(events)


def test_empty_trace_flag_writes_no_trace(vrun: Any, tmp_path: Path) -> None:
    controller, _ = run_controller(vrun, tmp_path / "run", num_rollout=1, trace="")
    assert isinstance(controller.tracer, NullTracer)
    assert not (tmp_path / "run" / "trace.json").exists()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_tracer_tracks_are_the_serving_engines_and_lanes_never_overlap(vrun: Any, tmp_path: Path) -> None:
    import asyncio

    tracer = Tracer(tmp_path / "t.json")

    async def request(key: int, engine: int, start: float, seconds: float, fail: bool = False) -> None:
        await asyncio.sleep(start)
        span, out = tracer.request_start(key), None
        try:
            await asyncio.sleep(seconds)
            if fail:
                raise RuntimeError("boom")
            out = GenerateOutput(
                text="",
                output_ids=[1, 2],
                output_log_probs=[0.0, 0.0],
                weight_versions=[1, 2],
                finish_reason="stop",
                meta={"engine_index": engine},
            )
        finally:
            tracer.request_end(span, "generate", group=key, output=out)

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(6):  # engine 1: six concurrent requests → six lanes
                tg.create_task(request(i, 1, 0.0, 1.0 + i))
            tg.create_task(request(10, 0, 0.0, 2.0))  # engine 0: [0, 2] then [3, 4] share lane 0 ...
            tg.create_task(request(11, 0, 3.0, 1.0))
            tg.create_task(request(12, 0, 1.0, 3.0))  # ... and [1, 4] overlaps both: lane 1
        with pytest.raises(RuntimeError):
            await request(3, 0, 0.0, 1.0, fail=True)

    vrun(main())
    tracer.close()
    events = read_trace(tmp_path / "t.json")
    check_nesting(events)
    engine1 = [e for e in events if e["ph"] == "X" and e["pid"] == ENGINE_PID_BASE + 1]
    assert len(engine1) == 6 and len({e["tid"] for e in engine1}) == 6
    engine0 = {e["args"]["group"]: e["tid"] for e in events if e["ph"] == "X" and e["pid"] == ENGINE_PID_BASE}
    assert engine0 == {10: 0, 11: 0, 12: 1}
    lanes: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            lanes[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for lane in lanes.values():  # no two slices of one lane overlap
        lane.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(lane))
    ok = next(e for e in engine1 if e["args"]["group"] == 0)
    assert ok["args"]["version_first"] == 1 and ok["args"]["version_last"] == 2 and ok["args"]["tokens"] == 2
    failed = [e for e in events if e["ph"] == "X" and e["args"].get("finish") == "error"]
    assert len(failed) == 1 and failed[0]["pid"] == FAILED_PID
    names = {(e["args"]["name"], e["pid"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {
        ("engine 0", ENGINE_PID_BASE),
        ("engine 1", ENGINE_PID_BASE + 1),
        ("failed requests", FAILED_PID),
    } <= names
    last = [e for e in events if e["ph"] == "C" and e["name"] == "engine_requests"][-1]
    assert last["args"]["value"] == 0.0


def test_step_loop_log_lines_carry_step_and_version(vrun: Any, tmp_path: Path) -> None:
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        run_controller(vrun, tmp_path / "run", num_rollout=2)
    steps = [e for e in logs if e["event"] == "step"]
    assert [(e["step"], e["version"]) for e in steps] == [(1, 2), (2, 3)]  # step N: N steps done
    assert "step" not in structlog.contextvars.get_contextvars()  # unbound at the end of the run


def test_trace_keeps_at_most_max_events(vrun: Any, tmp_path: Path) -> None:
    tracer = Tracer(tmp_path / "t.json", max_events=3)

    async def main() -> None:
        for i in range(5):
            with tracer.slice(f"s{i}", track="trainer"):
                pass

    vrun(main())
    tracer.close()
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["s0", "s1", "s2"]
    assert doc["otherData"]["dropped_events"] == 2
