"""Kill a run mid-way and resume it from its last checkpoint: nothing lost, nothing trained twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.controller import Controller
from miles_aio.inference.base import InferenceEngine
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


def controller(tmp_path: Path, trainer: FakeTrainer, **cfg: Any) -> Controller:
    config = make_config(
        tmp_path / "run",
        num_rollout=10,
        save=tmp_path / "ckpt",
        save_interval=3,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=12,
        **cfg,
    )
    return Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 10.0), tokens_per_s=10, seed=7),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )


def test_kill_and_resume_loses_and_duplicates_nothing(vrun: Any, tmp_path: Path) -> None:
    first = FakeTrainer(step_time_s=1.0)

    async def killed() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(8.5):  # dies after the step_6 checkpoint, before step 9
                await controller(tmp_path, first).run()

    vrun(killed())
    trained_first = [step for step, _ in first.steps]
    assert 6 <= len(trained_first) < 10
    saved = int((tmp_path / "ckpt" / "latest").read_text())
    assert saved == 6  # --save-interval 3: step_3, step_6 (the steps done)

    second = FakeTrainer(step_time_s=1.0)
    resumed = controller(tmp_path, second, load=tmp_path / "ckpt")
    summary = vrun(resumed.run())
    assert second.loaded_step == saved
    assert [step for step, _ in second.steps] == list(range(saved + 1, 11))  # neither redone nor skipped
    assert summary.steps == 10

    # the history that survives: run 1 up to the checkpoint, then run 2
    kept = [g[0].group_index for step, b in first.steps if step <= saved for g in b]
    kept += [g[0].group_index for _, b in second.steps for g in b]
    assert len(kept) == len(set(kept)) == 10 * 2
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert any(e.get("event") == "resume" for e in events)
    counts = check_conservation(events)
    assert counts["trained"] > 20  # steps trained after the checkpoint in run 1 were voided, then redone
    # the batch drained before the checkpoint is trained first after the resume
    ckpt_state = json.loads((tmp_path / "ckpt" / f"step_{saved}" / "controller_state.json").read_text())
    carried = sorted(it["group"][0]["group_index"] for it in ckpt_state["carry"])
    assert sorted(g[0].group_index for g in second.steps[0][1]) == carried
    # groups in flight at the checkpoint were re-submitted and every one got a fate
    resubmitted = {e["group_id"] for e in events if e.get("fate") == "resubmitted"}
    assert resubmitted == {g[0]["group_index"] for g in ckpt_state["in_flight"]}
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 10


def test_check_conservation_catches_a_duplicate_and_a_lost_group() -> None:
    ok = [{"group_id": 1, "epoch": 0, "fate": "admitted"}, {"group_id": 1, "epoch": 0, "fate": "trained"}]
    check_conservation(ok)
    with pytest.raises(AssertionError, match="trained twice"):
        check_conservation(
            [
                *ok,
                {"group_id": 1, "epoch": 0, "fate": "admitted"},
                {"group_id": 1, "epoch": 0, "fate": "trained"},
            ]
        )
    with pytest.raises(AssertionError, match="no fate"):
        check_conservation([*ok, {"group_id": 2, "epoch": 0, "fate": "admitted"}])
    with pytest.raises(AssertionError, match="no checkpoint"):
        check_conservation([*ok, {"event": "resume", "from_step": 3}])


@pytest.mark.parametrize("stop_at_s", [3.3, 6.05, 9.7])
def test_stop_saves_every_pending_group_and_resume_continues(
    vrun: Any, tmp_path: Path, stop_at_s: float
) -> None:
    first = FakeTrainer(step_time_s=1.0)
    ctl = controller(tmp_path, first, max_admission_staleness=1)

    async def stopped() -> None:
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(ctl.run())
            await asyncio.sleep(stop_at_s)
            ctl.request_stop()
            summary = await run
        assert ctl.stopped and summary.steps < 10

    vrun(stopped())
    saved = int((tmp_path / "ckpt" / "latest").read_text())
    assert saved == len(first.steps)  # the stop saved right after the last trained step
    second = FakeTrainer(step_time_s=1.0)
    vrun(controller(tmp_path, second, load=tmp_path / "ckpt", max_admission_staleness=1).run())
    kept = [g[0].group_index for _, b in first.steps for g in b] + [
        g[0].group_index for _, b in second.steps for g in b
    ]
    assert len(kept) == len(set(kept)) == 20
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))


class StopDuringPush(FakeTrainer):
    """Asks the controller to stop while it pushes `stop_version`; records every save."""

    def __init__(self, stop_version: int) -> None:
        super().__init__(step_time_s=1.0)
        self.stop_version = stop_version
        self.ctl: Controller | None = None
        self.saves: list[int] = []

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        if version == self.stop_version and self.ctl is not None:
            self.ctl.request_stop()  # the step's batch is drained by now: the step goes on to its save
        await super().sync_weights(engine, version=version)

    async def save(self, step: int, directory: Path) -> None:
        self.saves.append(step)
        await super().save(step, directory)


def test_a_stop_in_a_step_that_saves_anyway_saves_it_once(vrun: Any, tmp_path: Path) -> None:
    trainer = StopDuringPush(stop_version=4)  # the push after step 3; --save-interval 3 saves step_3
    ctl = controller(tmp_path, trainer)
    trainer.ctl = ctl
    vrun(ctl.run())
    assert ctl.stopped
    assert trainer.saves == [3]
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert [e["step"] for e in events if e.get("event") == "checkpoint"] == [3]
    check_conservation(events)
