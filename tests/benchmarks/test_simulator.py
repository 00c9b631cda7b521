"""The simulator runs the real controller on virtual time; the tuner's Pareto front and recommendation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.simulate import SimConfig, load_config, main, run_sim
from benchmarks.tune import pareto_front, recommend

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]

SMALL = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "num_rollout": 6, "warmup_steps": 2}


def test_simulator_smoke_predicts_figures(tmp_path: Path) -> None:
    res = run_sim(SimConfig(**SMALL, train_step_s=1.0, max_running=8))  # type: ignore[arg-type]
    assert res["steps"] == 6
    assert res["step_time_s"] > 0 and res["samples_per_s"] == pytest.approx(16 / res["step_time_s"])
    assert 0 <= res["trainer_idle_ratio"] <= 1 and 0 <= res["rollout_blocked_ratio"] <= 1
    assert res["engine_max_in_flight"] <= 16  # the in-flight bound B × N holds at the engine
    assert sum(res["token_staleness"].values()) == pytest.approx(1.0, abs=1e-6)
    assert run_sim(SimConfig(**SMALL, train_step_s=1.0, max_running=8))["step_time_s"] == res["step_time_s"]  # type: ignore[arg-type]


def test_simulator_auto_adapts_the_limiter_and_cli_writes_json(tmp_path: Path) -> None:
    cfg = tmp_path / "sim.toml"
    cfg.write_text("rollout-batch-size = 4\nn_samples_per_prompt = 4\nnum_rollout = 8\nmax_running = 8\n")
    out = tmp_path / "out.json"
    main(
        [
            "--config",
            str(cfg),
            "--async-max-concurrent-samples",
            "auto",
            "--adaptive-concurrency-interval-s",
            "1",
            "--adaptive-concurrency-min",
            "4",
            "--output",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert (
        res["config"]["rollout_batch_size"] == 4 and res["config"]["async_max_concurrent_samples"] == "auto"
    )
    limits = res["limit_per_step"]
    assert all(4 <= x <= 4096 for x in limits) and len(set(limits)) > 1  # it moved, within bounds


def test_load_config_rejects_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"no_such_knob": 1}))
    with pytest.raises(ValueError, match="no_such_knob"):
        load_config(path)


def test_pareto_front_and_recommendation() -> None:
    pts = [(10.0, 5.0), (8.0, 2.0), (9.0, 6.0), (5.0, 1.0), (8.0, 2.0), (4.0, 3.0), (9.6, 3.0)]
    front = pareto_front(pts)
    assert front == [3, 1, 6, 0]  # sorted by staleness; dominated and duplicate points are left out
    for i, (t, s) in enumerate(pts):  # every point off the front is dominated by one on it
        if i not in front:
            assert any(pts[j][0] >= t and pts[j][1] <= s for j in front)
    assert recommend(pts, tolerance=0.05) == 6  # 9.6 >= 95% of 10, and less stale
    assert recommend(pts, tolerance=0.0) == 0
    assert pareto_front([(1.0, 1.0)]) == [0]


def test_recorded_lengths_from_a_run_trace_or_a_list(tmp_path: Path) -> None:
    from benchmarks.simulate import recorded_lengths

    events = [
        {"name": "generate", "ph": "X", "args": {"tokens": 7, "finish": "stop"}},
        {"name": "generate", "ph": "X", "args": {"tokens": 3, "finish": "length"}},
        {"name": "generate", "ph": "X", "args": {"tokens": 2, "finish": "abort"}},  # cut short: left out
        {"name": "eval generate", "ph": "X", "args": {"tokens": 9, "finish": "stop"}},  # not rollout
        {"name": "buffer_depth", "ph": "C", "args": {"value": 1.0}},
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    assert recorded_lengths(tmp_path) == [7, 3]
    (tmp_path / "l.json").write_text("[1, 2, 3]")
    assert recorded_lengths(tmp_path / "l.json") == [1, 2, 3]
