"""Eval mode 2 pins each point's snapshot all-or-nothing across the dedicated fleet: health first, load,
read back, one retry, else the point is skipped (`unhealthy`, `pin_violation`), never evaluated on
mixed weights. Two SGLang stubs over real HTTP behind the real router."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from miles_aio.data.source import PromptRecord
from miles_aio.eval import EvalSkip, SnapshotEvalDispatcher
from miles_aio.eval.fleet import DedicatedEngineEval
from miles_aio.eval.snapshots import Snapshot
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.single_turn import generate
from miles_aio.testing import FakeTokenizer
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from tests.helpers import make_config

pytestmark = [pytest.mark.procs, pytest.mark.timeout(20)]

FAST = RouterPolicy(health_check_interval_s=0.05, retry_backoff_s=0.01, flush_backoff_s=0.01)
DATASETS = {"arith": [PromptRecord(f"prompt {i}", label=str(i)) for i in range(3)]}


@contextlib.asynccontextmanager
async def fleet(
    n: int = 2,
) -> AsyncIterator[tuple[list[SGLangStubServer], EngineRouter, DedicatedEngineEval]]:
    async with contextlib.AsyncExitStack() as stack:
        stubs = [await stack.enter_async_context(SGLangStubServer.open()) for _ in range(n)]
        router = await stack.enter_async_context(EngineRouter.open([s.url for s in stubs], policy=FAST))
        ctx = RolloutContext(
            engine=router,
            tokenizer=FakeTokenizer(),
            config=make_config(eval_max_response_len=3, rollout_max_response_len=4),
            log=structlog.get_logger("test"),
        )
        evaluator = DedicatedEngineEval(
            engine=router,
            ctx=ctx,
            datasets=DATASETS,
            generate_fn=generate,
            reward_fn=None,
            concurrency=4,
            ready_timeout_s=0.5,
        )
        yield stubs, router, evaluator


def test_a_point_runs_once_every_engine_serves_the_snapshot(tmp_path: Path) -> None:
    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            metrics = await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)
            assert metrics["eval/arith/weight_version/mean"] == 3.0
            assert metrics["eval/arith/mixed_version_ratio"] == 0.0
            for s in stubs:
                assert s.model_path == str(tmp_path / "step_2") and s.weight_version == "3"
                assert s.counts["/health_generate"] >= 1  # health first
                assert s.counts["/update_weights_from_disk"] == 1
                assert s.counts["/flush_cache"] == 1  # the previous snapshot's prefix cache is dropped
            assert sum(s.counts["/generate"] for s in stubs) == len(DATASETS["arith"])

    asyncio.run(main())


def test_an_engine_that_acknowledged_but_serves_other_weights_is_loaded_again(tmp_path: Path) -> None:
    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            stubs[1].stale_loads = 1  # says "Succeeded." and keeps its weights, once
            with structlog.testing.capture_logs() as logs:
                metrics = await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)
            assert stubs[1].counts["/update_weights_from_disk"] == 2  # the one retry
            assert stubs[0].counts["/update_weights_from_disk"] == 1
            assert metrics["eval/arith/weight_version/mean"] == 3.0  # every sample from the snapshot
            assert metrics["eval/arith/mixed_version_ratio"] == 0.0
            [warning] = [e for e in logs if e["event"] == "eval engines do not serve the point's snapshot"]
            assert warning["engines"] == {stubs[1].url: "serves version None"}

    asyncio.run(main())


def test_an_engine_never_serving_the_snapshot_skips_the_point_as_a_pin_violation(tmp_path: Path) -> None:
    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            stubs[1].stale_loads = 10
            with pytest.raises(EvalSkip) as skip:
                await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)
            assert skip.value.reason == "pin_violation"
            assert stubs[1].counts["/update_weights_from_disk"] == 2  # one load, one retry, no more
            assert all(s.counts["/generate"] == 0 for s in stubs)  # nothing evaluated on mixed weights

    asyncio.run(main())


def test_a_served_path_other_than_the_snapshot_is_a_pin_violation(tmp_path: Path) -> None:
    """The version alone is not enough: an engine reporting the point's version from another directory
    does not serve the snapshot."""

    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            stubs[0].stale_loads = 10
            stubs[0].weight_version = "3"  # the right stamp on the wrong weights
            with structlog.testing.capture_logs() as logs, pytest.raises(EvalSkip, match="pin_violation"):
                await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)
            engines = [
                e["engines"] for e in logs if e["event"] == "eval engines do not serve the point's snapshot"
            ]
            assert engines[-1] == {stubs[0].url: "serves stub-model"}

    asyncio.run(main())


def test_an_engine_that_never_comes_up_skips_the_point_as_unhealthy_before_any_load(tmp_path: Path) -> None:
    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            stubs[1].healthy = False  # /health_generate answers 503, and keeps doing so
            with pytest.raises(EvalSkip) as skip:
                await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)
            assert skip.value.reason == "unhealthy"
            assert all(s.counts["/update_weights_from_disk"] == 0 for s in stubs)
            stubs[1].healthy = True  # it comes back: the next point is pinned and evaluated
            metrics = await evaluator.evaluate_snapshot(tmp_path / "step_4", step=4, version=5)
            assert metrics["eval/arith/weight_version/mean"] == 5.0

    asyncio.run(main())


def test_tokens_from_other_weights_in_the_point_skip_it_as_a_pin_violation(tmp_path: Path) -> None:
    """An engine that changes weights mid-point (restarted, say) shows in the tokens' versions."""

    async def main() -> None:
        async with fleet() as (stubs, _, evaluator):
            for s in stubs:
                s.add_faults([{"kind": "mutate", "set": {"meta_info.weight_version": "2"}}])
            with pytest.raises(EvalSkip, match="pin_violation"):
                await evaluator.evaluate_snapshot(tmp_path / "step_2", step=2, version=3)

    asyncio.run(main())


class OneSnapshot:
    """A SnapshotSource handing out a directory per point (nothing exported, nothing retired)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    async def take(self, steps_done: int) -> Snapshot:
        path = self.root / f"step_{steps_done}"
        path.mkdir(parents=True, exist_ok=True)
        return Snapshot(path, exported=False)

    async def discard(self, snapshot: Snapshot) -> None:
        return None


def test_the_skip_reaches_the_metrics_as_eval_skipped_pin_violation(tmp_path: Path) -> None:
    async def main() -> dict[str, Any]:
        async with fleet() as (stubs, _, evaluator):
            stubs[0].stale_loads = 10
            dispatcher = SnapshotEvalDispatcher(
                evaluator, OneSnapshot(tmp_path), interval=2, final_step=4, before_train=False
            )
            async with asyncio.TaskGroup() as tg:
                await dispatcher.wait_before_push(steps_done=2)
                dispatcher.dispatch(tg, steps_done=2, version=3)
            report = dispatcher.collect()
            assert report.points == []
            return report.skipped

    assert asyncio.run(main()) == {"eval/skipped_pin_violation": 1.0}
