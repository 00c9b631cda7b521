"""Eval modes 2/3 plumbing on virtual time: external evals (mode 3), snapshot sources, overflow, retirement.

The mode-2 fleet on real embedded engines is in tests/eval/test_eval_fleet.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

from miles_aio.config import RunConfig
from miles_aio.controller import Controller
from miles_aio.eval import CheckpointEvalFn, CheckpointEvalInput, EvalSkip, SnapshotEvalDispatcher
from miles_aio.eval.snapshots import ReuseSource
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]

MODULE = "tests.eval.test_eval_modes"


class FakeExportTrainer(FakeTrainer):
    """A FAKE trainer that can `export_hf`: writes a placeholder safetensors file (or fails on request)."""

    def __init__(self, *, fail_at: frozenset[int] = frozenset(), **kw: Any) -> None:
        super().__init__(**kw)
        self.fail_at = fail_at
        self.exports: list[Path] = []

    async def export_hf(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a fake: tiny, test-only write
        (directory / "model.safetensors").write_bytes(b"fake")
        self.exports.append(directory)
        if int(directory.name.rsplit("_", 1)[1]) in self.fail_at:
            raise OSError("disk full (fake)")
        return directory

    async def remove_hf(self, directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)  # a fake: tiny, test-only directories


class RecordingEval(CheckpointEvalFn):
    """Sleeps `duration_s` (virtual), records what it was given, returns its step as a score."""

    duration_s: ClassVar[float] = 0.5
    calls: ClassVar[list[tuple[int, int, Path, bool]]] = []

    async def evaluate_checkpoint(self, checkpoint_dir: Path, input: CheckpointEvalInput) -> dict[str, float]:
        assert input.config is self.config
        exists = (checkpoint_dir / "model.safetensors").is_file()
        await asyncio.sleep(self.duration_s)
        type(self).calls.append((input.step, input.version, checkpoint_dir, exists))
        return {"ext/score": float(input.step), "eval/ext/datasets": float(len(input.datasets))}


class FlakyEval(CheckpointEvalFn):
    """Crashes on step 2, skips step 4 with a reason, evaluates the rest."""

    async def evaluate_checkpoint(self, checkpoint_dir: Path, input: CheckpointEvalInput) -> dict[str, float]:
        await asyncio.sleep(0.2)
        if input.step == 2:
            raise RuntimeError("external eval service exploded")
        if input.step == 4:
            raise EvalSkip("Server Not Ready")
        return {"ext/score": 1.0}


@pytest.fixture(autouse=True)
def _reset_recording() -> None:
    RecordingEval.calls = []
    RecordingEval.duration_s = 0.5


def _run(vrun: Any, cfg: RunConfig, trainer: FakeExportTrainer) -> tuple[Controller, list[dict[str, Any]]]:
    controller = Controller(
        cfg,
        engine=FakeLatencyEngine(LogNormalLatency(0.5, 2.0), tokens_per_s=20, seed=3),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
    )
    vrun(controller.run())
    lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    return controller, [json.loads(x) for x in lines]


def _dispatcher(controller: Controller) -> SnapshotEvalDispatcher:
    assert isinstance(controller.evals, SnapshotEvalDispatcher)
    return controller.evals


def _total(records: list[dict[str, Any]], key: str) -> float:
    return float(sum(r.get(key, 0.0) for r in records))


def test_external_eval_points_at_the_right_steps_on_exported_snapshots(vrun: Any, tmp_path: Path) -> None:
    RecordingEval.duration_s = 2.5  # longer than a step: points lag behind training, pushes do not wait
    cfg = make_config(
        tmp_path / "run",
        num_rollout=6,
        eval_interval=2,
        eval_function_path=f"{MODULE}:RecordingEval",
        eval_hf_dir=tmp_path / "snaps",
        eval_keep_snapshots=2,
    )
    trainer = FakeExportTrainer(step_time_s=1.0)
    controller, records = _run(vrun, cfg, trainer)
    evals = _dispatcher(controller)
    assert [p.name for p in trainer.exports] == ["step_0", "step_2", "step_4", "step_6"]  # one each
    # before training (0), after steps 2, 4 and 6; each on the weights pushed right before it
    assert [(s, v) for s, v, _, _ in RecordingEval.calls] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [c[2] for c in RecordingEval.calls] == [(tmp_path / "snaps" / f"step_{s}") for s in (0, 2, 4, 6)]
    assert all(c[3] for c in RecordingEval.calls)  # each snapshot was complete when evaluated
    assert [m["eval/step"] for m in evals.results] == [0.0, 2.0, 4.0, 6.0]
    assert all(m["eval/ext/score"] == m["eval/step"] for m in evals.results)
    assert all("eval/export_time_seconds" in m for m in evals.results)
    logged = [r for r in records if "eval/lag_steps" in r]
    assert logged and max(r["eval/lag_steps"] for r in logged) >= 1  # fire-and-forget: they land later
    assert records[-1]["eval/step"] == 6.0  # the last point lands in the last record
    # every point has its own line in eval_points.jsonl, at its own step
    points = [json.loads(x) for x in (cfg.run_dir / "eval_points.jsonl").read_text().splitlines()]
    assert [(p["step"], p["eval/step"], p["eval/ext/score"]) for p in points] == [
        (s, float(s), float(s)) for s in (0, 2, 4, 6)
    ]
    # retirement: exactly --eval-keep-snapshots exported dirs are left, the newest
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["step_4", "step_6"]


def test_crashing_external_eval_is_skipped_and_training_continues(vrun: Any, tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path / "run",
        num_rollout=6,
        eval_interval=2,
        eval_function_path=f"{MODULE}:FlakyEval",
        eval_hf_dir=tmp_path / "snaps",
        eval_keep_snapshots=1,
    )
    trainer = FakeExportTrainer(step_time_s=1.0)
    controller, records = _run(vrun, cfg, trainer)
    assert len(trainer.steps) == 6
    assert [m["eval/step"] for m in _dispatcher(controller).results] == [0.0, 6.0]
    assert _total(records, "eval/skipped_crashed") == 1.0
    assert _total(records, "eval/skipped_server_not_ready") == 1.0  # EvalSkip reason, normalized
    # settled points retire their snapshots whatever the outcome
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["step_6"]


def test_failed_export_skips_the_point(vrun: Any, tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path / "run",
        num_rollout=4,
        eval_interval=2,
        eval_function_path=f"{MODULE}:RecordingEval",
        eval_hf_dir=tmp_path / "snaps",
        skip_eval_before_train=True,
    )
    trainer = FakeExportTrainer(step_time_s=1.0, fail_at=frozenset({2}))
    _, records = _run(vrun, cfg, trainer)
    assert len(trainer.steps) == 4
    assert _total(records, "eval/skipped_export_failed") == 1.0
    assert [c[0] for c in RecordingEval.calls] == [4]
    assert not (tmp_path / "snaps" / "step_2").exists()  # a half-written export is removed


@pytest.mark.parametrize("policy", ["skip", "backpressure"])
def test_overflow_policy(vrun: Any, tmp_path: Path, policy: str) -> None:
    RecordingEval.duration_s = 5.0  # five steps per point: points pile up
    cfg = make_config(
        tmp_path / "run",
        num_rollout=6,
        eval_interval=1,
        eval_function_path=f"{MODULE}:RecordingEval",
        eval_hf_dir=tmp_path / "snaps",
        eval_max_in_flight=1,
        eval_overflow_policy=policy,
    )
    controller, records = _run(vrun, cfg, FakeExportTrainer(step_time_s=1.0))
    evaluated = [c[0] for c in RecordingEval.calls]
    if policy == "skip":
        assert 0 < _total(records, "eval/skipped_busy") == 7 - len(evaluated)
        assert evaluated[0] == 0 and len(evaluated) < 7
        assert all(r.get("eval/backpressure_wait_seconds", 0.0) == 0.0 for r in records)
    else:
        assert evaluated == list(range(7))  # every due point ran, each waited for the one before
        assert _total(records, "eval/skipped_busy") == 0.0
        assert max(m["eval/backpressure_wait_seconds"] for m in _dispatcher(controller).results) > 1.0


def test_save_hf_checkpoints_are_reused_and_never_retired(vrun: Any, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    cfg = make_config(
        tmp_path / "run",
        num_rollout=4,
        eval_interval=2,
        save=tmp_path / "ckpt",
        save_interval=2,
        save_hf=str(hf / "step_{step}"),
        eval_function_path=f"{MODULE}:RecordingEval",
        eval_keep_snapshots=0,
    )
    _, records = _run(vrun, cfg, FakeExportTrainer(step_time_s=1.0))
    assert [(c[0], c[2]) for c in RecordingEval.calls] == [(2, hf / "step_2"), (4, hf / "step_4")]
    assert _total(records, "eval/skipped_ckpt_missing") == 1.0  # the initial weights have no checkpoint
    assert sorted(p.name for p in hf.iterdir()) == ["step_2", "step_4"]  # keep=0, yet nothing deleted
    assert not any("eval/export_time_seconds" in r for r in records)


def test_exported_snapshots_retire_while_save_hf_ones_stay(vrun: Any, tmp_path: Path) -> None:
    hf, snaps = tmp_path / "hf", tmp_path / "snaps"
    cfg = make_config(
        tmp_path / "run",
        num_rollout=6,
        eval_interval=1,
        save=tmp_path / "ckpt",
        save_interval=2,
        save_hf=str(hf / "step_{step}"),
        eval_hf_dir=snaps,  # export wins over reuse
        eval_function_path=f"{MODULE}:RecordingEval",
        eval_keep_snapshots=1,
        eval_max_in_flight=3,
    )
    _run(vrun, cfg, FakeExportTrainer(step_time_s=1.0))
    assert [c[2].parent for c in RecordingEval.calls] == [snaps] * 7
    assert sorted(p.name for p in snaps.iterdir()) == ["step_6"]
    assert sorted(p.name for p in hf.iterdir()) == ["step_2", "step_4", "step_6"]


class HangingEvaluator:
    """Never finishes: the point is in flight when the run is cancelled."""

    started = 0

    async def evaluate_snapshot(self, snapshot: Path, *, step: int, version: int) -> dict[str, float]:
        self.started += 1
        await asyncio.sleep(1e6)
        return {}


def test_cancellation_propagates_through_a_point_in_flight(vrun: Any, tmp_path: Path) -> None:
    (tmp_path / "hf_0").mkdir()
    evaluator = HangingEvaluator()
    evals = SnapshotEvalDispatcher(
        evaluator, ReuseSource(str(tmp_path / "hf_{step}")), interval=1, final_step=3
    )

    async def body() -> None:
        async with asyncio.TaskGroup() as tg:
            evals.dispatch(tg, steps_done=0, version=1)
            await asyncio.sleep(100)

    async def main() -> bool:
        task = asyncio.create_task(body())
        await asyncio.sleep(5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert vrun(main())
    assert evaluator.started == 1
    assert evals.skipped == [] and evals.results == []  # cancelled, not "crashed"
    assert evals.pending == 0
    assert (tmp_path / "hf_0").is_dir()
