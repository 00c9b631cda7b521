"""A resumed run appends to its trace: the steps before the resume stay, the new ones follow them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.observability.trace import CONTROLLER_PID, SEGMENT_GAP_S, Tracer, merge_segments, read_trace
from miles_aio.testing import FakeTrainer
from tests.core.test_resume import controller  # the same killable, resumable run
from tests.observability.test_trace import check_nesting

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


def steps_traced(events: list[dict[str, Any]]) -> list[int]:
    return [int(e["name"].split()[1]) for e in events if e["ph"] == "X" and e["name"].startswith("step ")]


def test_a_resumed_run_keeps_the_trace_of_the_steps_before_it(vrun: Any, tmp_path: Path) -> None:
    first = FakeTrainer(step_time_s=1.0)

    async def killed() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(8.5):  # dies after the step_6 checkpoint, before step 9
                await controller(tmp_path, first).run()

    vrun(killed())
    trace = tmp_path / "run" / "trace.json"
    before = read_trace(trace)
    first_steps = steps_traced(before)
    assert first_steps and max(first_steps) >= 6
    saved = int((tmp_path / "ckpt" / "latest").read_text())

    vrun(controller(tmp_path, FakeTrainer(step_time_s=1.0), load=tmp_path / "ckpt").run())
    after = read_trace(trace)
    assert steps_traced(after) == first_steps + list(range(saved + 1, 11))  # both segments, in order
    end_of_first = max(e["ts"] + e.get("dur", 0.0) for e in before if e["ph"] != "M")
    (marker,) = [e for e in after if e["name"] == "resumed"]
    assert marker["ph"] == "i" and marker["pid"] == CONTROLLER_PID
    assert marker["ts"] == pytest.approx(end_of_first + SEGMENT_GAP_S * 1e6)
    second = [e for e in after if e["ph"] != "M" and e["ts"] >= marker["ts"]]
    assert len(second) > len(before) // 10  # the new segment's events follow the marker
    check_nesting(after)
    meta = [(e["name"], e["pid"], e.get("tid")) for e in after if e["ph"] == "M"]
    assert len(meta) == len(set(meta))  # track names once, not once per segment
    other = json.loads(trace.read_text())["otherData"]
    assert other["segments"] == [0.0, marker["ts"]]


def test_a_third_segment_and_the_event_cap(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    for n in range(3):
        tracer = Tracer(path, max_events=5)
        for i in range(3):
            tracer.complete(f"s{n}.{i}", track="trainer", start=float(i), end=i + 0.5)
        tracer.close()
    doc = json.loads(path.read_text())
    names = [e["name"] for e in doc["traceEvents"] if e["ph"] != "M"]
    assert names == ["s0.0", "s0.1", "s0.2", "resumed", "s1.0"]  # five kept: the newest are left out
    assert doc["otherData"]["dropped_events"] == 2 + 4
    assert len(doc["otherData"]["segments"]) == 3


def test_merge_shifts_the_new_segment_after_the_old_one() -> None:
    old = {
        "traceEvents": [{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0}],
        "otherData": {},
    }
    new = {
        "traceEvents": [
            {"name": "b", "ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 5.0},
            {"name": "c", "ph": "C", "pid": 1, "ts": 2.0, "args": {"value": 1.0}},
        ],
        "otherData": {"dropped_events": 0, "segments": [0.0]},
    }
    merged = merge_segments(old, new, max_events=100)
    ts = {e["name"]: e["ts"] for e in merged["traceEvents"]}
    gap = SEGMENT_GAP_S * 1e6
    assert ts == {"a": 0.0, "resumed": 10.0 + gap, "b": 10.0 + gap, "c": 12.0 + gap}


def test_an_unreadable_trace_is_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("{not json")
    tracer = Tracer(path)
    tracer.complete("x", track="trainer", start=0.0, end=1.0)
    tracer.close()
    assert (tmp_path / "trace.json.unreadable").read_text() == "{not json"
    assert [e["name"] for e in read_trace(path) if e["ph"] == "X"] == ["x"]
