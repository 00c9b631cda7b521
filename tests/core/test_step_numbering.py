"""One step numbering everywhere: steps done. Step N is the N-th step; after it N steps are trained, its
metrics record has `step` N, the eval point on its weights `eval/step` N, its checkpoint is `step_N`
(`latest` names N), the ledger marks its groups trained at step N, its log lines and trace slice say
step N, and a run resumed from `step_N` goes on with step N+1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.checkpoint import read_controller_state, read_latest
from miles_aio.controller import Controller
from miles_aio.data.source import PromptRecord
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.observability.trace import read_trace
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source

pytestmark = pytest.mark.timeout(120)

HELD = {"held": [PromptRecord(f"q{i}", label=i) for i in range(4)]}


def controller(tmp_path: Path, trainer: FakeTrainer, **cfg: Any) -> Controller:
    config = make_config(
        tmp_path / "run",
        **{
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "async_max_concurrent_samples": 8,
            "save": tmp_path / "ckpt",
            "trace": "trace.json",
            **cfg,
        },
    )
    return Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 8.0), tokens_per_s=10, seed=3),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
        eval_datasets=HELD if cfg.get("eval_interval") else None,
    )


def rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def checkpoints(tmp_path: Path) -> list[str]:
    return sorted((p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()), key=lambda n: int(n[5:]))


def test_every_number_of_a_run_counts_steps_done(vrun: Any, tmp_path: Path) -> None:
    trainer = FakeTrainer(step_time_s=1.0)
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        summary = vrun(controller(tmp_path, trainer, num_rollout=6, save_interval=3, eval_interval=3).run())
    assert summary.steps == 6
    records = rows(tmp_path)
    last = records[-1]
    # the last record, its eval point and the last checkpoint all say 6: the steps trained
    assert last["step"] == last["eval/step"] == read_latest(tmp_path / "ckpt") == len(trainer.steps) == 6
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["eval/step"] for r in records if "eval/step" in r] == [0, 3, 6]  # 0: before training
    assert checkpoints(tmp_path) == ["step_3", "step_6"]
    assert read_controller_state(tmp_path / "ckpt" / "step_6").steps_done == 6
    assert [s for s, _ in trainer.steps] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "ckpt" / "step_6" / "fake_trainer.json").read_text())["step"] == 6
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    check_conservation(events)
    assert sorted({e["step"] for e in events if e.get("fate") == "trained"}) == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in events if e.get("event") == "checkpoint"] == [3, 6]
    trace = read_trace(tmp_path / "run" / "trace.json")
    assert [e["name"] for e in trace if e["ph"] == "X" and e["name"].startswith("step ")] == [
        f"step {n}" for n in range(1, 7)
    ]
    assert [e["step"] for e in logs if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in logs if e["event"] == "saved checkpoint"] == [3, 6]


def test_intervals_count_steps_done(vrun: Any, tmp_path: Path) -> None:
    """--num-rollout 300 --save-interval 100 saves step_100, step_200, step_300 (and nothing else)."""
    trainer = FakeTrainer(step_time_s=0.01, keep_batches=False)
    vrun(controller(tmp_path, trainer, num_rollout=300, save_interval=100, trace=None).run())
    assert checkpoints(tmp_path) == ["step_100", "step_200", "step_300"]
    assert read_latest(tmp_path / "ckpt") == 300 == rows(tmp_path)[-1]["step"]


def test_resume_from_step_n_continues_with_step_n_plus_one(vrun: Any, tmp_path: Path) -> None:
    vrun(controller(tmp_path, FakeTrainer(step_time_s=1.0), num_rollout=4, save_interval=2).run())
    assert read_latest(tmp_path / "ckpt") == 4
    second = FakeTrainer(step_time_s=1.0)
    ckpt = tmp_path / "ckpt"
    resumed = controller(tmp_path, second, num_rollout=7, save_interval=2, eval_interval=2, load=ckpt)
    summary = vrun(resumed.run())
    assert second.loaded_step == 4
    assert [s for s, _ in second.steps] == [5, 6, 7]  # none redone, none skipped
    assert summary.steps == 7
    records = rows(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert records[-1]["eval/step"] == 7  # the final point, on the weights after step 7
    assert checkpoints(tmp_path) == ["step_2", "step_4", "step_6", "step_7"]
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert [e["from_step"] for e in events if e.get("event") == "resume"] == [4]
    check_conservation(events)
    trace = read_trace(tmp_path / "run" / "trace.json")
    assert [e["name"] for e in trace if e["ph"] == "X" and e["name"].startswith("step ")] == [
        f"step {n}" for n in range(1, 8)
    ]


def as_old_checkpoint(save: Path, run_dir: Path, steps_done: int) -> None:
    """Rewrite `step_<steps_done>` the way a run before steps-done numbering saved it: named by the
    0-based index of its last step (`step_<i>`, `latest` i), `step` i in controller_state.json and its
    ledger marker."""
    old = steps_done - 1
    (save / f"step_{steps_done}").rename(save / f"step_{old}")
    (save / "latest").write_text(str(old))
    state_file = save / f"step_{old}" / "controller_state.json"
    state = json.loads(state_file.read_text())
    del state["steps_done"]
    state_file.write_text(json.dumps({"step": old, **state}))
    ledger = run_dir / "ledger.jsonl"
    events = read_ledger(ledger)
    for e in events:
        if "step" in e:
            e["step"] -= 1
    ledger.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_checkpoint_from_before_the_numbering_still_resumes(vrun: Any, tmp_path: Path) -> None:
    vrun(controller(tmp_path, FakeTrainer(step_time_s=1.0), num_rollout=3, save_interval=3).run())
    as_old_checkpoint(tmp_path / "ckpt", tmp_path / "run", 3)
    assert read_controller_state(tmp_path / "ckpt" / "step_2").steps_done == 3  # step_2 held 3 steps
    second = FakeTrainer(step_time_s=1.0)
    vrun(controller(tmp_path, second, num_rollout=5, save_interval=3, load=tmp_path / "ckpt").run())
    assert [s for s, _ in second.steps] == [4, 5]
    assert read_latest(tmp_path / "ckpt") == 5 and (tmp_path / "ckpt" / "step_5").is_dir()
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert [e["from_step"] for e in events if e.get("event") == "resume"] == [2]  # its marker's step
    check_conservation(events)
