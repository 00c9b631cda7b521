"""Engines lost mid-run: SIGKILL and SIGSTOP of a real engine process (1 of 2, and the only one), in whole
quickstart runs, and engines that answer 400 to a flush or a weight load (stub servers over real HTTP
behind the real router and controller).

Every case: the run goes on (pushes proceed on the engines left; a dead engine is restarted and rejoins
with the current weights; a frozen one is excluded at the admin deadline and rejoins when it thaws), or,
when no engine is left, fails with exit 1 and the reason; the ledger is conserved and no process is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from miles_aio.controller import Controller
from miles_aio.errors import EngineUnavailable
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.router import EngineRouter, RouterPolicy
from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeTokenizer, FakeTrainer
from miles_aio.testing.sglang_stub_server import SGLangStubServer
from tests.core._runs import Run, build_model
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.procs, pytest.mark.slow]
ADMIN = ["--engine-admin-timeout-s", "2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("engine-loss") / "model")


def excluded(url: str) -> Any:
    return lambda e: e.get("event") == "engine_excluded" and e.get("url") == url


@pytest.mark.timeout(150)
def test_one_of_two_engines_frozen_then_killed_the_run_goes_on(tmp_path: Path, model: Path) -> None:
    run = Run(tmp_path / "run", model, "--rollout-num-gpus", "2", *ADMIN)
    try:
        run.wait_steps(3)
        (pid0, pid1), (url0, url1) = run.engines()
        # SIGSTOP engine 1: the next push excludes it at the deadline, the following ones do not wait
        os.kill(pid1, signal.SIGSTOP)
        hit = run.wait(excluded(url1), "engine 1 excluded", timeout_s=30)
        assert "--engine-admin-timeout-s" in hit["error"]
        run.wait_steps(5, timeout_s=30)  # steps (each with a push) go on while it is frozen
        os.kill(pid1, signal.SIGCONT)
        run.event("engine_rejoined", url=url1, state="active", timeout_s=30)
        # SIGKILL engine 0: restarted on a new port, re-synced, rejoins; the run never stopped
        os.kill(pid0, signal.SIGKILL)
        run.event("engine_died", index=0, pid=pid0)
        new = run.event("engine_restarted", index=0, timeout_s=60)
        assert new["url"] != url0
        run.event("engine_rejoined", url=new["url"], state="active", timeout_s=30)
        run.wait_steps(3)
        rc = run.stop()
    finally:
        run.kill_if_running()
    assert rc == 128 + signal.SIGTERM, run.tail()
    assert "Traceback" not in "".join(run.text)
    run.check_aftermath()


@pytest.mark.timeout(210)
def test_the_only_engine_frozen_then_killed_the_run_goes_on(tmp_path: Path, model: Path) -> None:
    run = Run(tmp_path / "run", model, *ADMIN)
    try:
        run.wait_steps(3)
        (pid,), (url,) = run.engines()
        os.kill(pid, signal.SIGSTOP)
        # found by the health checks; on a loaded 2-core machine the run's loop may lag well past 30 s
        run.wait(excluded(url), "the engine excluded", timeout_s=90)
        os.kill(pid, signal.SIGCONT)  # thawed: it rejoins with the current weights, generation resumes
        run.event("engine_rejoined", url=url, state="active", timeout_s=30)
        run.wait_steps(3)
        os.kill(pid, signal.SIGKILL)
        new = run.event("engine_restarted", index=0, timeout_s=60)
        run.event("engine_rejoined", url=new["url"], state="active", timeout_s=30)
        run.wait_steps(3)
        rc = run.stop()
    finally:
        run.kill_if_running()
    assert rc == 128 + signal.SIGTERM, run.tail()
    run.check_aftermath()


@pytest.mark.timeout(120)
def test_the_only_engine_killed_with_no_restarts_left_fails_the_run_with_the_reason(
    tmp_path: Path, model: Path
) -> None:
    run = Run(tmp_path / "run", model, "--engine-max-restarts", "0")
    try:
        run.wait_steps(2)
        (pid,), _ = run.engines()
        os.kill(pid, signal.SIGKILL)
        rc = run.finish(timeout_s=60)
    finally:
        run.kill_if_running()
    assert rc == 1, run.tail()
    assert "no engine left: all 1 engines died and their restarts are spent" in run.tail(20)
    run.check_aftermath()


@pytest.mark.timeout(150)
def test_broadcast_mode_forms_a_new_group_without_a_dead_engine_and_with_its_restart(
    tmp_path: Path, model: Path
) -> None:
    """The group spans rank 0 and the engines of the push: it is formed again when that set changes,
    and a restarted engine (which has no copy of broadcast weights) waits on standby for the next push."""
    run = Run(
        tmp_path / "run", model, "--rollout-num-gpus", "2", "--update-weight-transfer-mode", "broadcast"
    )
    try:
        run.wait_steps(3)
        (pid0, _), _ = run.engines()
        first = run.event("trainer: weight-update group formed")
        assert first["engines"] == 2
        os.kill(pid0, signal.SIGKILL)
        new = run.event("engine_restarted", index=0, timeout_s=60)
        run.event("engine_rejoined", url=new["url"], state="standby", timeout_s=30)
        run.event("engine_rejoined", url=new["url"], state="active", timeout_s=30)
        groups = [e for e in run.events if e.get("event") == "trainer: weight-update group formed"]
        assert [g["engines"] for g in groups][-2:] == [1, 2]  # without it, then with its restart
        run.wait_steps(3)
        rc = run.stop()
    finally:
        run.kill_if_running()
    assert rc == 128 + signal.SIGTERM, run.tail()
    run.check_aftermath()


# ---- engines that answer 400 (stub servers, real HTTP, the real router and controller) --------------------
class DiskTrainer(FakeTrainer):
    """A fake trainer whose push loads `/w/v<version>` on the engines, as disk mode does; `script` runs
    first (it queues the stub faults for that push)."""

    def __init__(self, script: Any) -> None:
        super().__init__(step_time_s=0.0)
        self.script = script

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        await super().sync_weights(engine, version=version)
        self.script(version)
        await engine.update_weights_from_disk(f"/w/v{version}", version=version)


POLICY = RouterPolicy(
    health_check_interval_s=0.05, retry_backoff_s=0.01, admin_timeout_s=5.0, flush_backoff_s=0.01
)
CFG = {"num_rollout": 6, "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 4}


async def controller_run(
    run_dir: Path, servers: list[SGLangStubServer], script: Any, policy: RouterPolicy
) -> Any:
    async with EngineRouter.open([s.url for s in servers], policy=policy) as router:
        cfg = make_config(run_dir, **CFG)
        controller = Controller(
            cfg,
            engine=router,
            trainer=DiskTrainer(script),
            source=make_source(n=2),
            plugins=resolve_plugins(cfg),
            tokenizer=FakeTokenizer(),
            num_engines=len(servers),
        )
        summary = await controller.run()
        async with asyncio.timeout(10):
            await router.wait_for_healthy()  # the excluded engines are back, with the last weights
        return summary, router.stats()


@pytest.mark.timeout(60)
def test_engines_answering_400_to_a_flush_or_a_weight_load_are_excluded_and_rejoin(tmp_path: Path) -> None:
    async def main() -> None:
        async with SGLangStubServer.open() as s0, SGLangStubServer.open() as s1:

            def script(version: int) -> None:
                if version == 2:  # the next push's flush fails on engine 1, every try of it
                    s1.refuse_flushes = POLICY.flush_attempts
                if version == 4:  # this push's weight load fails on engine 0
                    s0.add_faults([{"kind": "status", "status": 400, "path": "/update_weights_from_disk"}])

            summary, stats = await controller_run(tmp_path / "run", [s0, s1], script, POLICY)
            assert summary.steps == 6
            assert stats["router/engine0/exclusions"] == 1 and stats["router/engine1/exclusions"] == 1
            last = f"/w/v{summary.version}"
            assert s0.model_path == s1.model_path == last  # both rejoined with the current weights
            assert s0.weight_version == s1.weight_version == str(summary.version)

    asyncio.run(main())
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))


@pytest.mark.timeout(60)
def test_the_only_engine_refusing_every_weight_load_fails_the_run_after_the_deadline(tmp_path: Path) -> None:
    policy = RouterPolicy(health_check_interval_s=0.05, admin_timeout_s=5.0, unavailable_deadline_s=2.0)

    async def main() -> None:
        async with SGLangStubServer.open() as s0:

            def script(version: int) -> None:
                if version == 2:  # from here on it refuses every load, its resyncs too
                    s0.add_faults(
                        [
                            {
                                "kind": "status",
                                "status": 400,
                                "path": "/update_weights_from_disk",
                                "times": 10**6,
                            }
                        ]
                    )

            await controller_run(tmp_path / "run", [s0], script, policy)

    with pytest.raises(EngineUnavailable, match="no engine left: none of 1 engines has been usable for 2"):
        asyncio.run(main())
    check_conservation(read_ledger(tmp_path / "run" / "ledger.jsonl"))
