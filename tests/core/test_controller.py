"""The whole controller over the fake engine and fake trainer, on virtual time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import structlog

from miles_aio.buffer import BufferItem, DefaultDataBuffer
from miles_aio.controller import Controller, RunSummary
from miles_aio.errors import EngineUnavailable
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import group_staleness
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


def run(
    vrun: Any,
    tmp_path: Path,
    *,
    latency: LogNormalLatency | None = None,
    step_time_s: float = 1.0,
    tokens_per_s: float = 20.0,
    **cfg: Any,
) -> tuple[Controller, RunSummary, FakeLatencyEngine, FakeTrainer]:
    config = make_config(tmp_path / "run", **cfg)
    n = config.rollout.n_samples_per_prompt
    engine = FakeLatencyEngine(latency or LogNormalLatency(1.0, 10.0), tokens_per_s=tokens_per_s, seed=3)
    trainer = FakeTrainer(step_time_s=step_time_s)
    controller = Controller(
        config,
        engine=engine,
        trainer=trainer,
        source=make_source(n=n),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    summary = vrun(controller.run())
    return controller, summary, engine, trainer


def metrics_lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_run_completes_num_rollout_steps_of_exactly_batch_size_groups(vrun: Any, tmp_path: Path) -> None:
    _, summary, engine, trainer = run(
        vrun, tmp_path, num_rollout=6, rollout_batch_size=3, n_samples_per_prompt=4
    )
    assert summary.steps == 6
    assert [step for step, _ in trainer.steps] == list(range(1, 7))  # step N: N steps done after it
    for _, batch in trainer.steps:
        assert len(batch) == 3 and all(len(g) == 4 for g in batch)
        indices = [g[0].index for g in batch]
        assert indices == sorted(indices)  # sorted by sample index
    trained = [g[0].group_index for _, b in trainer.steps for g in b]
    assert len(trained) == len(set(trained))  # no group trained twice
    # initial push (version 1) and one per step, in order, each pause → flush → stamp → continue
    assert trainer.synced_versions == list(range(1, 8))
    assert engine.calls[:4] == ["pause:retract", "flush", "version:1", "continue"]
    assert summary.version == 7
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    counts = check_conservation(events)
    assert counts["trained"] == 18
    assert counts["admitted"] == counts["trained"] + counts.get("pending_at_exit", 0)
    assert sorted(e["step"] for e in events if e["fate"] == "trained") == sorted([s for s in range(1, 7)] * 3)
    lines = metrics_lines(tmp_path)
    assert [m["step"] for m in lines] == list(range(1, 7))
    for key in (
        "queue_size",
        "aborted_groups_filtered",
        "stale_groups_filtered",
        "avg_staleness",
        "max_staleness",
    ):
        assert all(f"rollout/fully_async/{key}" in m for m in lines)
    for key in ("buffer_avg_staleness", "buffer_max_staleness"):  # unknown (absent) for an empty buffer
        assert all(
            (f"rollout/fully_async/{key}" in m) == (m["rollout/fully_async/queue_size"] > 0) for m in lines
        )


def test_weights_pushed_every_interval_steps(vrun: Any, tmp_path: Path) -> None:
    _, summary, _, trainer = run(vrun, tmp_path, num_rollout=6, update_weights_interval=3)
    assert trainer.synced_versions == [1, 2, 3]
    assert summary.version == 3


@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_in_flight_samples_never_exceed_the_bound(vrun: Any, tmp_path: Path, granularity: str) -> None:
    _, summary, engine, _ = run(
        vrun,
        tmp_path,
        num_rollout=5,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        async_max_concurrent_samples=6,
        rollout_submission_granularity=granularity,
    )
    assert summary.steps == 5
    assert 4 <= engine.max_in_flight <= 6


def test_admission_pacing_bounds_consumed_staleness_on_a_long_tail(vrun: Any, tmp_path: Path) -> None:
    _, summary, _, _ = run(
        vrun,
        tmp_path,
        num_rollout=12,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=32,
        max_admission_staleness=1,
        step_time_s=0.5,
        latency=LogNormalLatency(1.0, 30.0),
    )
    assert summary.steps == 12
    lines = metrics_lines(tmp_path)
    assert max(m["rollout/fully_async/max_staleness"] for m in lines) <= 1
    assert max(m["rollout/fully_async/max_staleness"] for m in lines) == 1  # really off-policy


def test_without_pacing_the_same_run_gets_staler(vrun: Any, tmp_path: Path) -> None:
    _, _, _, _ = run(
        vrun,
        tmp_path,
        num_rollout=12,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=32,
        step_time_s=0.5,
        async_data_buffer_capacity_factor=8,
        latency=LogNormalLatency(1.0, 30.0),
    )
    assert max(m["rollout/fully_async/max_staleness"] for m in metrics_lines(tmp_path)) > 1


def test_stale_groups_are_recycled_under_the_same_id_with_retry(vrun: Any, tmp_path: Path) -> None:
    _, summary, _, _ = run(
        vrun,
        tmp_path,
        num_rollout=8,
        max_weight_staleness=0,
        async_unused_samples_handler="retry",
        async_max_concurrent_samples=16,
        latency=LogNormalLatency(1.0, 20.0),
        step_time_s=0.5,
    )
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    counts = check_conservation(events)
    assert counts.get("recycled", 0) > 0
    recycled = {e["group_id"] for e in events if e["fate"] == "recycled"}
    readmitted = [e["group_id"] for e in events if e["fate"] == "admitted" and e["group_id"] in recycled]
    assert len(readmitted) > len(recycled)  # admitted again under the same id
    assert summary.steps == 8
    lines = metrics_lines(tmp_path)
    assert sum(m["rollout/fully_async/stale_groups_filtered"] for m in lines) == counts["recycled"]
    for m in lines:  # the groups get() returned are all fresh; max_staleness counts the rejected too (miles)
        rejected = m["rollout/fully_async/stale_groups_filtered"] > 0
        assert (m["rollout/fully_async/max_staleness"] > 0) == rejected


def test_dynamic_filter_drops_and_counts_by_reason(vrun: Any, tmp_path: Path) -> None:
    _, _, _, trainer = run(
        vrun, tmp_path, num_rollout=4, dynamic_sampling_filter_path="tests.helpers:keep_even_groups"
    )
    assert all(g[0].group_index % 2 == 0 for _, b in trainer.steps for g in b)
    counts = check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
    drops = sum(m.get("rollout/dynamic_filter/drop_odd_group", 0) for m in metrics_lines(tmp_path))
    assert counts["filtered"] >= drops > 0  # filtered after the last metrics window are not in metrics


def test_the_built_in_nonzero_std_filter_trains_only_groups_whose_rewards_differ(
    vrun: Any, tmp_path: Path
) -> None:
    _, summary, _, trainer = run(
        vrun,
        tmp_path,
        num_rollout=4,
        custom_rm_path="tests.helpers:uniform_reward_every_third_group",
        dynamic_sampling_filter_path="miles_aio.rollout.filters:reward_nonzero_std",
    )
    assert summary.steps == 4
    assert all(len({s.reward for s in g}) == 2 for _, b in trainer.steps for g in b)
    counts = check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
    drops = sum(m.get("rollout/dynamic_filter/drop_zero_std_1.0", 0) for m in metrics_lines(tmp_path))
    assert counts["filtered"] >= drops > 0


def test_a_worker_exception_surfaces_at_the_drain(vrun: Any, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="reward exploded") as e:  # the user's own error, not a wrapper
        run(vrun, tmp_path, custom_rm_path="tests.helpers:raising_reward")
    assert any("raised in the rollout worker, which died before step" in n for n in e.value.__notes__)
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))  # nothing admitted goes unaccounted


def test_a_starved_drain_logs_a_warning(vrun: Any, tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        run(
            vrun,
            tmp_path,
            num_rollout=1,
            latency=LogNormalLatency(100.0, 101.0),
            tokens_per_s=0.5,
            stall_warning_s=30.0,
        )
    assert any(e["event"].startswith("No completed rollout groups for 30.0s") for e in logs)


class CountingBuffer(DefaultDataBuffer):
    puts = 0

    async def put(self, item: BufferItem) -> None:
        CountingBuffer.puts += 1
        await super().put(item)


def test_custom_buffer_replaces_the_default(vrun: Any, tmp_path: Path) -> None:
    controller, summary, _, _ = run(
        vrun, tmp_path, custom_async_data_buffer_path="tests.core.test_controller:CountingBuffer"
    )
    assert isinstance(controller.buffer, CountingBuffer)
    assert CountingBuffer.puts >= summary.steps * 2


def test_bubble_accounting_with_a_trainer_three_times_slower_than_rollout(vrun: Any, tmp_path: Path) -> None:
    # one batch of rollout takes 1 s (fixed latency, in-flight bound = one batch); a train step 3 s
    run(
        vrun,
        tmp_path,
        num_rollout=20,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        step_time_s=3.0,
        latency=LogNormalLatency(1.0, 1.0),
        tokens_per_s=10,
        async_data_buffer_capacity_factor=1,
    )
    steady = metrics_lines(tmp_path)[5:]
    idle = sum(m["perf/trainer_idle_ratio"] for m in steady) / len(steady)
    blocked = sum(m["perf/rollout_blocked_ratio"] for m in steady) / len(steady)
    assert idle == pytest.approx(0.0, abs=0.02)
    assert blocked == pytest.approx(2 / 3, abs=0.05)
    assert all(m["perf/rollout_blocked_ratio/buffer_full"] == m["perf/rollout_blocked_ratio"] for m in steady)


def test_bubble_accounting_with_rollout_three_times_slower_than_the_trainer(
    vrun: Any, tmp_path: Path
) -> None:
    run(
        vrun,
        tmp_path,
        num_rollout=20,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        step_time_s=1.0,
        latency=LogNormalLatency(3.0, 3.0),
        tokens_per_s=10,
    )
    steady = metrics_lines(tmp_path)[5:]
    idle = sum(m["perf/trainer_idle_ratio"] for m in steady) / len(steady)
    blocked = sum(m["perf/rollout_blocked_ratio"] for m in steady) / len(steady)
    assert idle == pytest.approx(2 / 3, abs=0.05)
    assert blocked == pytest.approx(0.0, abs=0.02)
    tokens = [m["perf/generated_tokens_per_s"] for m in steady]
    assert sum(tokens) / len(tokens) == pytest.approx(4 * 30 / 3.0, rel=0.1)  # 4 samples × 30 tokens per 3 s


@pytest.mark.parametrize(("policy", "fate"), [("drop", "failed"), ("retry", "recycled")])
def test_failure_policy_turns_user_exceptions_into_failed_samples(
    vrun: Any, tmp_path: Path, policy: str, fate: str
) -> None:
    _, summary, _, trainer = run(
        vrun,
        tmp_path,
        num_rollout=4,
        custom_rm_path="tests.helpers:flaky_reward",
        rollout_failure_policy=policy,
    )
    assert summary.steps == 4
    assert all(g[0].group_index % 3 for _, b in trainer.steps for g in b)  # no failed group is trained
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    counts = check_conservation(events)
    assert counts[fate] > 0
    failed_metric = sum(m["rollout/failed_groups"] for m in metrics_lines(tmp_path))
    assert failed_metric > 0


class FlakyEngine(FakeLatencyEngine):
    """A FAKE engine whose every fifth request fails as an unreachable server would (after retries)."""

    async def generate(self, **kw: Any) -> Any:
        if self.requests % 5 == 4:
            self.requests += 1
            raise EngineUnavailable("no healthy engine")
        return await super().generate(**kw)


def test_engine_failures_abort_samples_and_the_run_goes_on(vrun: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path / "run", num_rollout=4, async_unused_samples_handler="retry")
    trainer = FakeTrainer(step_time_s=1.0)
    controller = Controller(
        config,
        engine=FlakyEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=10),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    assert vrun(controller.run()).steps == 4
    assert sum(m["rollout/fully_async/aborted_groups_filtered"] for m in metrics_lines(tmp_path)) > 0
    counts = check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
    assert counts["recycled"] > 0


class PoisonedPromptEngine(FakeLatencyEngine):
    """A FAKE engine that fails every request for the prompt "prompt 7", as if it crashed the server."""

    async def generate(self, **kw: Any) -> Any:
        if bytes(kw["input_ids"]).decode() == "prompt 7":
            self.requests += 1
            raise EngineUnavailable("the engine fails on this prompt")
        return await super().generate(**kw)


def test_a_prompt_that_always_fails_is_dropped_after_max_group_recycles(vrun: Any, tmp_path: Path) -> None:
    config = make_config(
        tmp_path / "run", num_rollout=12, async_unused_samples_handler="retry", max_group_recycles=3
    )
    controller = Controller(
        config,
        engine=PoisonedPromptEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=10),
        trainer=FakeTrainer(step_time_s=1.0),
        source=make_source(n_prompts=20, n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    assert vrun(controller.run()).steps == 12  # more steps than prompts: every prompt comes up again
    events = read_ledger(tmp_path / "run" / "ledger.jsonl")
    check_conservation(events)
    poisoned = {e["group_id"] for e in events if e.get("prompt_index") == 7}
    fates = [e for e in events if e["group_id"] in poisoned and e["fate"] in ("recycled", "dropped")]
    # per epoch: recycled 3 times under one id, then dropped, never trained
    assert [e["fate"] for e in fates[:4]] == ["recycled", "recycled", "recycled", "dropped"]
    assert fates[3]["reason"] == "aborted, recycled 3 times"
    assert not any(e["fate"] == "trained" for e in events if e["group_id"] in poisoned)


class StalenessRecordingBuffer(DefaultDataBuffer):
    """The default buffer, recording each consumed group's staleness at the moment it was taken."""

    taken: ClassVar[dict[int, int]] = {}

    async def get(self, *, current_version: int | None = None, **context: Any) -> BufferItem:
        item = await super().get(current_version=current_version, **context)
        staleness = group_staleness(item.group, current_version)
        if staleness is not None:
            StalenessRecordingBuffer.taken[item.group_index] = staleness
        return item


def test_each_steps_buffer_metrics_describe_the_batch_trained_in_that_step(vrun: Any, tmp_path: Path) -> None:
    """The consume-time window (avg/max staleness) is cut when a step's drain completes, so step s's
    record describes batch s, as miles logs it with the batch it drained (not batch s+1, prefetched)."""
    StalenessRecordingBuffer.taken = {}
    _, _, _, trainer = run(
        vrun,
        tmp_path,
        num_rollout=8,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        async_max_concurrent_samples=16,
        step_time_s=3.0,
        custom_async_data_buffer_path=f"{__name__}:StalenessRecordingBuffer",
    )
    lines = metrics_lines(tmp_path)
    seen = set()
    for (step, batch), record in zip(trainer.steps, lines, strict=True):
        assert record["step"] == step
        values = [StalenessRecordingBuffer.taken[g[0].group_index] for g in batch]
        seen.update(values)
        assert record["rollout/fully_async/max_staleness"] == max(values), step
        assert record["rollout/fully_async/avg_staleness"] == pytest.approx(sum(values) / len(values)), step
    assert len(seen) > 1  # the staleness varied across steps: a window off by one step would show
