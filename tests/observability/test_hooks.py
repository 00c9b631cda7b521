"""miles' logging hooks: called with the documented arguments; True suppresses the default logging."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from miles_aio.errors import ConfigError
from miles_aio.observability.hooks import eval_hook_data, resolve_log_hooks
from miles_aio.types import Sample
from tests.helpers import make_config
from tests.observability._run import RecordingSink, run_controller

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]

ROLLOUT_CALLS: list[tuple[int, SimpleNamespace, list[Sample], dict[str, float], float]] = []
EVAL_CALLS: list[tuple[int, SimpleNamespace, dict[str, Any], dict[str, float]]] = []


def log_rollout_data(
    rollout_id: int, args: SimpleNamespace, samples: list[Sample], extra: dict[str, float], seconds: float
) -> bool:
    ROLLOUT_CALLS.append((rollout_id, args, samples, dict(extra), seconds))
    return rollout_id % 2 == 0  # steps 2, 4, ...: skip the default logging


async def log_eval_rollout_data(
    rollout_id: int, args: SimpleNamespace, data: dict[str, Any], extra: dict[str, float]
) -> bool:
    EVAL_CALLS.append((rollout_id, args, data, extra))
    return True


@pytest.fixture(autouse=True)
def _clear() -> None:
    ROLLOUT_CALLS.clear()
    EVAL_CALLS.clear()


def test_rollout_hook_gets_each_steps_batch_and_true_skips_the_sinks(vrun: Any, tmp_path: Path) -> None:
    sink = RecordingSink()
    run_controller(
        vrun,
        tmp_path / "run",
        sinks=[sink],
        num_rollout=4,
        rollout_batch_size=2,
        n_samples_per_prompt=3,
        custom_rollout_log_function_path=f"{__name__}:log_rollout_data",
    )
    assert [c[0] for c in ROLLOUT_CALLS] == [1, 2, 3, 4]  # step N: N steps done
    for _step, args, samples, extra, seconds in ROLLOUT_CALLS:
        assert args.rollout_batch_size == 2 and args.n_samples_per_prompt == 3  # miles-style flat args
        assert args.config.rollout.rollout_batch_size == 2 and args.run_dir == tmp_path / "run"
        assert len(samples) == 6 and all(isinstance(s, Sample) for s in samples)
        assert extra["rollout/samples"] == 6.0 and "perf/step_time_s" in extra
        # miles' rollout_time: the drain, i.e. the time this step waited for its batch
        idle = extra["perf/trainer_idle_ratio"] * extra["perf/step_time_s"]
        assert seconds == pytest.approx(idle, abs=1e-6) and seconds < extra["perf/step_time_s"]
    assert [step for step, _ in sink.records] == [1, 2, 3, 4]
    for step, record in sink.records:  # True (even steps) took over the rollout data only, as in miles
        has_rollout = any(k.startswith("rollout/") for k in record)
        assert has_rollout == (step % 2 == 1), step
        assert "perf/step_time_s" in record  # the rest of the step is still logged
    assert sink.closed
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]  # the run's record is always written


def test_eval_hook_per_point_and_true_keeps_eval_metrics_from_the_sinks(vrun: Any, tmp_path: Path) -> None:
    sink = RecordingSink()
    run_controller(
        vrun,
        tmp_path / "run",
        sinks=[sink],
        num_rollout=4,
        eval_prompts=4,
        eval_interval=2,
        custom_eval_rollout_log_function_path=f"{__name__}:log_eval_rollout_data",
    )
    assert [c[0] for c in EVAL_CALLS] == [0, 2, 4]  # one call per point: its eval/step
    for rollout_id, args, data, extra in EVAL_CALLS:
        assert args.eval_interval == 2
        assert extra["eval/step"] == rollout_id
        assert set(data) == {"held"}
        assert "accuracy" in data["held"]["metrics"]
        held = data["held"]["samples"]  # the point's own samples, all generated at its version
        assert len(held) == 4 and len(data["held"]["rewards"]) == 4
        assert {v for s in held for v in s.weight_versions} == {extra["eval/version"]}
    assert len(sink.records) == 4
    assert not any(k.startswith("eval/") for _, m in sink.records for k in m)  # suppressed
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval/step" in m for m in lines) == 3  # still in the run's record


def test_eval_hook_data_with_samples() -> None:
    s = Sample(index=0, group_index=0, prompt="p")
    s.reward = 1.0
    data = eval_hook_data({"eval/held/accuracy": 0.5, "eval/step": 2.0}, {"held": [s]})
    assert data == {
        "held": {"metrics": {"accuracy": 0.5}, "samples": [s], "rewards": [1.0], "truncated": [False]}
    }


def test_bad_hook_path_is_a_config_error(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, custom_rollout_log_function_path="tests.nowhere:fn")
    with pytest.raises(ConfigError, match="--custom-rollout-log-function-path"):
        resolve_log_hooks(cfg)


def raising_hook(*args: Any) -> bool:
    raise RuntimeError("bug in the user's logging code")


def test_a_raising_hook_is_logged_and_the_default_logging_kept(vrun: Any, tmp_path: Path) -> None:
    sink = RecordingSink()
    run_controller(
        vrun,
        tmp_path / "run",
        sinks=[sink],
        num_rollout=2,
        custom_rollout_log_function_path=f"{__name__}:raising_hook",
    )
    assert [step for step, _ in sink.records] == [1, 2]
    assert all("rollout/samples" in record for _, record in sink.records)
