"""perf/engine/* from the engines' /server_info internal_states and the router's stats."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from miles_aio.controller import Controller
from miles_aio.errors import EngineUnavailable
from miles_aio.observability.engine_load import engine_load_metrics
from miles_aio.plugins import resolve_plugins
from miles_aio.testing import FakeLatencyEngine, FakeTokenizer, FakeTrainer, LogNormalLatency
from tests.helpers import make_config, make_source

pytestmark = [pytest.mark.vtime, pytest.mark.timeout(30)]


class InfoClient:
    def __init__(self, states: list[dict[str, Any]] | None = None, *, hang: bool = False, fail: bool = False):
        self.states, self.hang, self.fail = states, hang, fail

    async def server_info(self) -> dict[str, Any]:
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise EngineUnavailable("down")
        return {"internal_states": self.states or []}


class FakeRouter:
    def __init__(self, clients: list[InfoClient]) -> None:
        self._clients = tuple(clients)

    @property
    def clients(self) -> tuple[InfoClient, ...]:
        return self._clients

    def stats(self) -> dict[str, float]:
        return {
            "router/latency_p50_s": 0.5,
            "router/latency_p99_s": 4.0,
            "router/in_flight": 7.0,
            "router/engine1/latency_p50_s": 0.25,
            "router/engine1/latency_p99_s": 3.0,
        }


def test_engine_load_sums_states_and_skips_engines_that_do_not_answer(vrun: Any) -> None:
    router = FakeRouter(
        [
            InfoClient([{"num_running_reqs": 3, "num_waiting_reqs": 1}, {"num_running_reqs": 2}]),
            InfoClient([{"#running-req": 4, "num_queue_reqs": 5}]),
            InfoClient(hang=True),
            InfoClient(fail=True),
            InfoClient([{}]),
        ]
    )

    async def main() -> tuple[dict[str, float], float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await engine_load_metrics(router, timeout_s=2.0)
        return out, loop.time() - t0

    metrics, waited = vrun(main())
    assert waited == pytest.approx(2.0, abs=0.01)  # bounded by the timeout (virtual time)
    assert metrics == {
        "perf/engine/0/num_running_reqs": 5.0,
        "perf/engine/0/queue_len": 1.0,
        "perf/engine/1/num_running_reqs": 4.0,
        "perf/engine/1/queue_len": 5.0,
        "perf/engine/num_running_reqs": 9.0,
        "perf/engine/queue_len": 6.0,
        "perf/engine/latency_p50_s": 0.5,
        "perf/engine/latency_p99_s": 4.0,
        "perf/engine/in_flight": 7.0,
        "perf/engine/1/latency_p50_s": 0.25,  # per engine, for the engines that have latencies
        "perf/engine/1/latency_p99_s": 3.0,
    }


def test_engines_without_load_reporting_give_no_metrics(vrun: Any) -> None:
    assert vrun(engine_load_metrics(FakeLatencyEngine(LogNormalLatency(1.0, 2.0)))) == {}


class LoadedEngine(FakeLatencyEngine):
    """The fake engine, reporting its in-flight requests as the engines' running requests."""

    @property
    def clients(self) -> tuple[InfoClient, ...]:
        return (InfoClient([{"num_running_reqs": self.in_flight, "num_waiting_reqs": 0}]),)

    def stats(self) -> dict[str, float]:
        return {"router/latency_p50_s": 1.0}


def test_controller_merges_engine_load_into_the_step_metrics(vrun: Any, tmp_path: Path) -> None:
    cfg = make_config(tmp_path / "run", num_rollout=3)
    controller = Controller(
        cfg,
        engine=LoadedEngine(LogNormalLatency(1.0, 5.0), tokens_per_s=10.0),
        trainer=FakeTrainer(step_time_s=1.0),
        source=make_source(n=2),
        plugins=resolve_plugins(cfg),
        tokenizer=FakeTokenizer(),
    )
    vrun(controller.run())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["perf/engine/num_running_reqs"] >= 0 and r["perf/engine/queue_len"] == 0
        assert r["perf/engine/latency_p50_s"] == 1.0


class TimedInfoClient(InfoClient):
    """One running request; answers `delay_s` after it is asked (a busy engine), and notes when."""

    def __init__(self, *, delay_s: float = 0.0) -> None:
        super().__init__([{"num_running_reqs": 1, "num_waiting_reqs": 0}])
        self.delay_s = delay_s
        self.asked: list[float] = []

    async def server_info(self) -> dict[str, Any]:
        self.asked.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.delay_s)
        return await super().server_info()


class TimedLoadEngine(FakeLatencyEngine):
    """The fake engine, reporting its load through `client`."""

    def __init__(self, client: TimedInfoClient) -> None:
        super().__init__(LogNormalLatency(0.05, 0.2), tokens_per_s=1000.0, seed=3)
        self.client = client

    @property
    def clients(self) -> tuple[InfoClient, ...]:
        return (self.client,)

    def stats(self) -> dict[str, float]:
        return {}


def timed_run(
    vrun: Any,
    tmp_path: Path,
    trainer: FakeTrainer,
    *,
    client: TimedInfoClient,
    delay_s: float = 0.0,
    **cfg: Any,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Run a controller (data never waited for) whose records take `delay_s` more to write: the records,
    and when each record ended on the loop's clock."""
    config = make_config(tmp_path / "run", max_admission_staleness=4, **cfg)
    controller = Controller(
        config,
        engine=TimedLoadEngine(client),
        trainer=trainer,
        source=make_source(n=2),
        plugins=resolve_plugins(config),
        tokenizer=FakeTokenizer(),
    )
    end_step = controller.obs.end_step
    ended: list[float] = []

    async def slower_end_step(*args: Any, **kwargs: Any) -> dict[str, float]:
        await asyncio.sleep(delay_s)
        out = await end_step(*args, **kwargs)
        ended.append(asyncio.get_running_loop().time())
        return out

    controller.obs.end_step = slower_end_step  # type: ignore[method-assign]
    vrun(controller.run())
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return rows, ended


def test_the_engine_load_is_read_while_the_step_trains_not_after_it(vrun: Any, tmp_path: Path) -> None:
    """The load's round trip runs alongside the training (1 s here), so a slow answer (0.5 s) does not
    lengthen the steps: before, the record asked after training and the run took 1.5 s a step."""
    client = TimedInfoClient(delay_s=0.5)
    rows, ended = timed_run(vrun, tmp_path, FakeTrainer(step_time_s=1.0), client=client, num_rollout=6)
    assert [r["perf/engine/num_running_reqs"] for r in rows] == [1.0] * 6  # every step has its load
    between = [b - a for a, b in itertools.pairwise(ended)]  # wall time from record to record
    assert between == pytest.approx([1.0] * 5, abs=0.05)
    assert [r["perf/step_time_s"] for r in rows[1:]] == pytest.approx(between, abs=1e-6)


def test_writing_a_steps_record_counts_in_the_next_step_so_the_steps_add_up(
    vrun: Any, tmp_path: Path
) -> None:
    """A record that takes 0.5 s to write (a slow log hook, a sink) is wall time of the run: it counts
    in the next step's perf/step_time_s, so benchmarks that add the steps up see it."""
    trainer = FakeTrainer(step_time_s=1.0)
    rows, ended = timed_run(vrun, tmp_path, trainer, client=TimedInfoClient(), delay_s=0.5, num_rollout=6)
    assert [r["perf/step_time_s"] for r in rows[1:]] == pytest.approx([1.5] * 5, abs=0.05)
    # steps 2..6 cover the wall time from step 1's times to step 6's: each record is 0.5 s before its end
    assert sum(r["perf/step_time_s"] for r in rows[1:]) == pytest.approx(ended[-1] - ended[0], abs=0.01)


class PushTimes(FakeTrainer):
    """Records when each push's engine side ends."""

    def __init__(self) -> None:
        super().__init__(step_time_s=1.0, sync_time_s=0.5, stages=True)
        self.pushed_at: list[float] = []

    async def sync_weights(self, engine: Any, *, version: int) -> None:
        await super().sync_weights(engine, version=version)
        self.pushed_at.append(asyncio.get_running_loop().time())


def test_with_an_overlapped_push_the_load_is_read_once_the_push_is_done(vrun: Any, tmp_path: Path) -> None:
    """--overlap-weight-push: the push of step s's weights runs alongside step s+1's training; the load
    of step s+1 is read after it, not from engines paused for the load."""
    client, trainer = TimedInfoClient(), PushTimes()
    rows, _ = timed_run(
        vrun,
        tmp_path,
        trainer,
        client=client,
        num_rollout=5,
        update_weight_transfer_mode="disk",
        overlap_weight_push=True,
    )
    assert len(client.asked) == 5 and len(trainer.pushed_at) == 6  # the initial push, then one per step
    # step k (k >= 2) trains alongside the push of step k-1's weights (pushed_at[k-1]); it is asked after
    for k in range(2, 6):
        assert client.asked[k - 1] >= trainer.pushed_at[k - 1] - 1e-9
    # and still during its own training: the step did not get longer than training plus staging
    assert [r["perf/step_time_s"] for r in rows[1:-1]] == pytest.approx([1.0] * 3, abs=0.05)
