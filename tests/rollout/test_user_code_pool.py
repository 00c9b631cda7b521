"""User code that returns unusable samples, or whose group reward / dynamic filter raises, follows
--rollout-failure-policy: FAILED samples (drop/retry) or a loud stop (fail), never a later crash."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import structlog

from miles_aio.buffer.fates import normalize_filter
from miles_aio.controller import Controller
from miles_aio.errors import primary_error
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.pool import InvalidSampleError, RolloutPool
from miles_aio.rollout.single_turn import generate as single_turn_generate
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from miles_aio.types import GenerateOutput, Group, Sample, Status
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(60)]


def finish(s: Sample, n: int = 2) -> Sample:
    s.append(
        GenerateOutput(
            text="ab",
            output_ids=[7] * n,
            output_log_probs=[0.0] * n,
            weight_versions=[1] * n,
            finish_reason="stop",
        )
    )
    return s


def make_pool(
    generate: Callable[..., Any], reward: Callable[..., Any] | None, *, group_rm: bool = False, **cfg: Any
) -> RolloutPool:
    ctx = RolloutContext(
        engine=cast("Any", None), tokenizer=None, config=make_config(**cfg), log=structlog.get_logger("test")
    )
    return RolloutPool(ctx=ctx, generate_fn=generate, reward_fn=reward, group_rm=group_rm, sampling_params={})


def prompt_group(n: int = 2) -> Group:
    return [Sample(group_index=4, index=8 + k, prompt="p", tokens=[1, 2]) for k in range(n)]


async def ok_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> Sample:
    return finish(s)


async def one_reward(ctx: Any, s: Sample) -> float:
    return 1.0


def reward_of(value: Any) -> Callable[..., Any]:
    async def reward(ctx: Any, s: Sample) -> Any:
        return value

    return reward


async def pending_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> Sample:
    return s  # forgot to call the engine


async def mismatched_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> Sample:
    finish(s).loss_mask.append(1)
    return s


async def none_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> Any:
    return None


async def two_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> list[Sample]:
    twin = Sample(group_index=s.group_index, index=s.index + 100, prompt=s.prompt, tokens=[1, 2])
    return [finish(s), finish(twin)]


async def empty_generate(ctx: Any, s: Sample, params: dict[str, Any]) -> list[Sample]:
    return []


CASES: list[tuple[str, Callable[..., Any], Callable[..., Any] | None, dict[str, Any], str]] = [
    ("pending", pending_generate, one_reward, {}, "status 'pending'"),
    ("mismatched lists", mismatched_generate, one_reward, {}, "inconsistent sample"),
    ("not a sample", none_generate, one_reward, {}, "returned NoneType None, not a Sample"),
    ("reward None", ok_generate, reward_of(None), {}, "reward function returned None"),
    ("reward text", ok_generate, reward_of("good"), {}, "reward is str 'good', not a number"),
    ("reward nan", ok_generate, reward_of(math.nan), {}, "not a finite number"),
    ("dict without --reward-key", ok_generate, reward_of({"acc": 1.0}), {}, "needs --reward-key"),
    ("dict lacks the key", ok_generate, reward_of({"acc": 1.0}), {"reward_key": "r"}, "no --reward-key 'r'"),
    ("dict value text", ok_generate, reward_of({"r": "x"}), {"reward_key": "r"}, "reward['r'] is str"),
    ("two samples, fixed batch", two_generate, one_reward, {"global_batch_size": 4}, "returned 2 samples"),
    ("empty list", empty_generate, one_reward, {}, "returned an empty list"),
]


@pytest.mark.parametrize("policy", ["drop", "fail"])
@pytest.mark.parametrize(("name", "gen", "reward", "cfg", "why"), CASES, ids=[c[0] for c in CASES])
def test_an_unusable_return_is_a_failed_sample_or_stops_the_group(
    vrun: Any,
    policy: str,
    name: str,
    gen: Callable[..., Any],
    reward: Callable[..., Any] | None,
    cfg: dict[str, Any],
    why: str,
) -> None:
    """Under `drop`, a FAILED sample with the reason; under `fail` (the default), the group stops with it."""
    pool = make_pool(gen, reward, rollout_failure_policy=policy, **cfg)
    if policy == "fail":
        with pytest.raises(BaseExceptionGroup) as e:
            vrun(pool.run_group(prompt_group(), on_sample_done=lambda: None))
        err = primary_error(e.value)
        assert isinstance(err, InvalidSampleError) and why in str(err)
        return
    done: list[int] = []
    with structlog.testing.capture_logs() as logs:
        out = vrun(pool.run_group(prompt_group(), on_sample_done=lambda: done.append(1)))
    assert len(done) == 2 and len(out) == 2  # slot accounting conserved, one carrier per prompt sample
    assert all(s.status == Status.FAILED for s in out)
    assert all(why in s.metadata["error"] for s in out), out[0].metadata["error"]
    assert any(e["event"] == "user code returned an invalid sample; sample failed" for e in logs)


def test_valid_returns_pass_and_several_samples_are_kept_when_the_step_takes_any_count(vrun: Any) -> None:
    out = vrun(
        make_pool(ok_generate, reward_of({"r": 1}), reward_key="r").run_group(
            prompt_group(), on_sample_done=lambda: None
        )
    )
    assert [s.status for s in out] == [Status.COMPLETED] * 2
    out = vrun(make_pool(two_generate, one_reward).run_group(prompt_group(), on_sample_done=lambda: None))
    assert len(out) == 4 and all(s.status == Status.COMPLETED and s.reward == 1.0 for s in out)
    # no reward function: generate owns the reward, and must set one (the trainer needs it)
    out = vrun(
        make_pool(ok_generate, None, rollout_failure_policy="drop").run_group(
            prompt_group(), on_sample_done=lambda: None
        )
    )
    assert [s.status for s in out] == [Status.FAILED] * 2
    assert "no --custom-rm-path" in out[0].metadata["error"]


def test_eval_samples_get_only_the_structural_checks(vrun: Any) -> None:
    pool = make_pool(two_generate, reward_of({"accuracy": 1.0}), global_batch_size=4)
    pool.ctx = RolloutContext(
        engine=pool.ctx.engine, tokenizer=None, config=pool.ctx.config, log=pool.ctx.log, evaluation=True
    )
    out = vrun(pool.run_group(prompt_group(), on_sample_done=lambda: None))
    assert len(out) == 4 and all(s.status == Status.COMPLETED for s in out)


# ---- --group-rm -----------------------------------------------------------------------------------------
async def raising_group_reward(ctx: Any, samples: list[Sample]) -> list[float]:
    raise RuntimeError("group rm exploded")


async def short_group_reward(ctx: Any, samples: list[Sample]) -> list[float]:
    return [1.0]


async def none_group_reward(ctx: Any, samples: list[Sample]) -> list[Any]:
    return [1.0, None]


@pytest.mark.parametrize(
    ("reward", "why"),
    [
        (raising_group_reward, "group rm exploded"),
        (short_group_reward, "must return a list of 2 rewards, got list [1.0]"),
        (none_group_reward, "reward function returned None"),
    ],
)
def test_a_group_reward_failure_fails_the_group_under_drop_and_stops_under_fail(
    vrun: Any, reward: Callable[..., Any], why: str
) -> None:
    pool = make_pool(ok_generate, reward, group_rm=True, rollout_failure_policy="retry")
    with structlog.testing.capture_logs() as logs:
        out = vrun(pool.run_group(prompt_group(), on_sample_done=lambda: None))
    assert [s.status for s in out] == [Status.FAILED] * 2
    assert all(why in s.metadata["error"] for s in out)
    assert any(e["event"] == "group reward (--group-rm) failed; group failed" for e in logs)
    with pytest.raises(Exception, match=re.escape(why)):
        vrun(
            make_pool(ok_generate, reward, group_rm=True).run_group(
                prompt_group(), on_sample_done=lambda: None
            )
        )


# ---- the dynamic filter ---------------------------------------------------------------------------------
def crashing_filter(ctx: Any, group: Group) -> bool:
    if group[0].group_index % 3 == 0:
        raise KeyError("reward")
    return True


def test_a_crashing_filter_rejects_as_filter_crashed_unless_the_policy_is_fail() -> None:
    group = prompt_group()  # group index 4: keeps
    crash = [Sample(group_index=3, index=6, prompt="p")]
    for policy in ("drop", "retry"):
        decide = normalize_filter(crashing_filter, None, failure_policy=policy)
        assert decide is not None
        assert decide(group).keep
        with structlog.testing.capture_logs() as logs:
            d = decide(crash)
        assert (d.keep, d.reason) == (False, "filter_crashed")
        assert logs[0]["event"] == "dynamic filter raised; group rejected"
    decide = normalize_filter(crashing_filter, None, failure_policy="fail")
    assert decide is not None
    with pytest.raises(KeyError, match="reward"):
        decide(crash)
    bad_tuple = normalize_filter(lambda ctx, g: (True,), None, failure_policy="drop")
    assert bad_tuple is not None and bad_tuple(group).reason == "filter_crashed"


# ---- whole controller runs ------------------------------------------------------------------------------
async def sometimes_broken_generate(ctx: RolloutContext, sample: Sample, params: dict[str, Any]) -> Any:
    """Every third group's samples come back with a loss mask one entry too long."""
    out = await single_turn_generate(ctx, sample, params)
    if sample.group_index % 3 == 0:
        out.loss_mask.append(1)
    return out


def controller_run(vrun: Any, tmp_path: Path, **cfg: Any) -> tuple[FakeTrainer, list[dict[str, Any]]]:
    config = make_config(tmp_path / "run", **cfg)
    trainer = FakeTrainer(step_time_s=1.0)
    controller = Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 10.0), tokens_per_s=20.0, seed=3),
        trainer=trainer,
        source=make_source(n=config.rollout.n_samples_per_prompt),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    vrun(controller.run())
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, lines


@pytest.mark.parametrize("policy", ["drop", "retry"])
def test_a_run_with_inconsistent_samples_trains_only_valid_ones(
    vrun: Any, tmp_path: Path, policy: str
) -> None:
    trainer, lines = controller_run(
        vrun,
        tmp_path,
        num_rollout=4,
        custom_generate_function_path="tests.rollout.test_user_code_pool:sometimes_broken_generate",
        rollout_failure_policy=policy,
    )
    assert len(trainer.steps) == 4
    for _, batch in trainer.steps:
        for g in batch:
            assert g[0].group_index % 3
            for s in g:
                s.validate()
    assert sum(m["rollout/failed_groups"] for m in lines) > 0


def test_a_run_with_a_crashing_filter_drops_its_groups_as_filter_crashed(vrun: Any, tmp_path: Path) -> None:
    trainer, lines = controller_run(
        vrun,
        tmp_path,
        num_rollout=4,
        dynamic_sampling_filter_path="tests.rollout.test_user_code_pool:crashing_filter",
        rollout_failure_policy="drop",
    )
    assert len(trainer.steps) == 4
    assert all(g[0].group_index % 3 for _, b in trainer.steps for g in b)
    assert sum(m.get("rollout/dynamic_filter/drop_filter_crashed", 0) for m in lines) > 0


def test_a_crashing_filter_under_fail_stops_the_run_with_the_users_error(vrun: Any, tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="reward"):
        controller_run(
            vrun,
            tmp_path,
            num_rollout=4,
            dynamic_sampling_filter_path="tests.rollout.test_user_code_pool:crashing_filter",
        )


class MyError(Exception):
    """A user's own exception type."""


async def my_error_generate(ctx: RolloutContext, sample: Sample, params: dict[str, Any]) -> Any:
    """Fine for the first groups, then raises the user's own exception (while handling another one)."""
    if sample.group_index >= 5:
        known: dict[int, str] = {}
        try:
            known[sample.group_index]
        except KeyError:
            raise MyError(f"my generate gave up on group {sample.group_index}")  # noqa: B904
    return await single_turn_generate(ctx, sample, params)


def test_a_producer_failure_surfaces_as_the_users_own_exception(vrun: Any, tmp_path: Path) -> None:
    """`except MyError` around the run works: the drain re-raises the worker's error itself (the
    rollout worker's death is a note), with the user's traceback and without a wrapper."""
    config = make_config(
        tmp_path / "run",
        num_rollout=6,
        custom_generate_function_path="tests.rollout.test_user_code_pool:my_error_generate",
        rollout_failure_policy="fail",  # the default: user code that raises stops the run
    )
    controller = Controller(
        config,
        engine=FakeLatencyEngine(LogNormalLatency(1.0, 10.0), tokens_per_s=20.0, seed=3),
        trainer=FakeTrainer(step_time_s=1.0),
        source=make_source(n=config.rollout.n_samples_per_prompt),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    with pytest.raises(MyError, match=r"my generate gave up on group \d+") as e:
        vrun(controller.run())
    assert type(e.value) is MyError
    notes = e.value.__notes__
    assert any(
        re.fullmatch(r"raised in the rollout worker, which died before step \d+'s batch was complete", n)
        for n in notes
    ), notes
    assert e.traceback[-1].name == "my_error_generate"  # the user's frame, where it was raised
    assert isinstance(e.value.__context__, KeyError)  # and its own context chain, not the task group
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
