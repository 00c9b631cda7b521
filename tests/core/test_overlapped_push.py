"""`--overlap-weight-push`: a disk push's engine side (pause, load, stamp, continue) runs alongside the
next step's training. On virtual time with the fake engine and a staging fake trainer: the steps stop
waiting for the push, every version is still pushed once and in order, what reads the pushed weights (a
checkpoint, an eval point, the run's end) waits for it, and a push that fails while the next step
trains fails the run with its own error, reported once."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from miles_aio.checkpoint import latest_checkpoint, read_controller_state
from miles_aio.controller import Controller
from miles_aio.data.source import PromptRecord
from miles_aio.inference.base import InferenceEngine
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source
from tests.observability._run import RecordingSink

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]

STEPS = 6


def controller(
    tmp_path: Path, trainer: FakeTrainer, *, sinks: Any = (), evals: int = 0, **cfg: Any
) -> Controller:
    config = make_config(
        tmp_path / "run",
        num_rollout=STEPS,
        max_admission_staleness=4,  # data is never what the steps wait for
        update_weight_transfer_mode="disk",
        **cfg,
    )
    held = {"held": [PromptRecord(f"q{i}", label=i) for i in range(evals)]} if evals else None
    return Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(0.05, 0.2), tokens_per_s=1000.0, seed=3),
        trainer=trainer,
        source=make_source(n=config.rollout.n_samples_per_prompt),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
        sinks=sinks,
        eval_datasets=held,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_the_steps_stop_waiting_for_the_push_and_every_version_is_pushed_in_order(
    vrun: Any, tmp_path: Path, overlap: bool
) -> None:
    trainer = FakeTrainer(step_time_s=1.0, sync_time_s=0.5, stages=True)
    sink = RecordingSink()
    ctl = controller(tmp_path, trainer, sinks=[sink], overlap_weight_push=overlap)
    summary = vrun(ctl.run())
    assert trainer.synced_versions == list(range(1, STEPS + 2))  # the initial push, then one per step
    assert summary.version == ctl.version == STEPS + 1  # the run ends on pushed weights
    records = dict(sink.records)
    middle = [records[s]["perf/step_time_s"] for s in range(2, STEPS)]  # the last step waits for its push
    assert statistics.median(middle) == pytest.approx(1.0 if overlap else 1.5, abs=0.05)
    assert all(records[s]["perf/weight_push_seconds"] >= 0.5 - 1e-6 for s in range(2, STEPS + 1))
    assert records[STEPS]["perf/step_time_s"] >= 1.5 - 1e-6  # the run's end waits for the last push


class SaveRecorder(FakeTrainer):
    """Records the controller's version when each checkpoint is written."""

    def __init__(self) -> None:
        super().__init__(step_time_s=1.0, sync_time_s=0.5, stages=True)
        self.ctl: Controller | None = None
        self.saved: list[tuple[int, int | None]] = []

    async def save(self, step: int, directory: Path) -> None:
        assert self.ctl is not None
        self.saved.append((step, self.ctl.version))
        await super().save(step, directory)


def test_a_checkpoint_and_an_eval_point_read_the_pushed_weights(vrun: Any, tmp_path: Path) -> None:
    trainer = SaveRecorder()
    ctl = controller(
        tmp_path,
        trainer,
        evals=3,
        eval_interval=2,
        save=tmp_path / "ckpt",
        save_interval=2,
        overlap_weight_push=True,
    )
    trainer.ctl = ctl
    dispatched: list[tuple[int, int]] = []
    dispatch = ctl.evals.dispatch

    def recording(tg: Any, *, steps_done: int, version: int) -> None:
        dispatched.append((steps_done, version))
        dispatch(tg, steps_done=steps_done, version=version)

    ctl.evals.dispatch = recording  # type: ignore[method-assign]
    vrun(ctl.run())
    # after step N the pushed weights are version N + 1: every reader saw them, none the version before
    assert trainer.saved == [(s, s + 1) for s in (2, 4, 6)]
    assert dispatched == [(0, 1)] + [(s, s + 1) for s in (2, 4, 6)]
    state = read_controller_state(latest_checkpoint(tmp_path / "ckpt"))
    assert (state.steps_done, state.version) == (6, 7)


class FailingPush(FakeTrainer):
    """The engines' load of `version` fails after a while (the next step is training by then)."""

    def __init__(self, version: int) -> None:
        super().__init__(step_time_s=1.0, sync_time_s=0.5, stages=True)
        self.failing = version

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        await super().sync_weights(engine, version=version)
        if version == self.failing:
            raise RuntimeError(f"engine lost while loading v{version}")


def test_a_push_that_fails_while_the_next_step_trains_fails_the_run_with_its_error_once(
    vrun: Any, tmp_path: Path
) -> None:
    ctl = controller(tmp_path, FailingPush(version=3), overlap_weight_push=True)
    with pytest.raises(RuntimeError, match="engine lost while loading v3") as info:
        vrun(ctl.run())
    assert not any("raised 2 times" in n for n in getattr(info.value, "__notes__", ()))
    assert ctl.steps_done == 2  # step 3 was training when its push failed: it never finished
    assert ctl.version == 2
