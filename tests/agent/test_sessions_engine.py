"""Agent sessions over a real embedded engine process (`python -m miles_aio.engine`, a tiny chat model):
agents on the official `openai` client, multi-turn with tools, streamed and not, weight pushes in the
middle of a conversation (retract and in_place), 64 sessions at once; every sample's tokens are checked
against what the engine itself consumed and produced, call by call."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from miles_aio.controller import Controller
from miles_aio.inference.client import SGLangClient
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.agent import generate
from miles_aio.rollout.agent.session import trajectory_sample
from miles_aio.rollout.pool import RolloutPool
from miles_aio.testing import FakeTrainer
from miles_aio.types import Sample, Status
from tests.agent import agents
from tests.agent.conftest import Call, RecordingEngine, serving
from tests.engine.helpers import EngineProcess, ModelPair
from tests.helpers import length_reward, make_config, make_source

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def config(**kw: Any) -> Any:
    kw.setdefault("custom_agent_function_path", "tests.agent.agents:multi_turn_agent")
    return make_config(rollout_max_response_len=12, rollout_temperature=1.0, **kw)


def assert_engine_tokens(sample: Sample, calls: list[Call]) -> None:
    """The sample is exactly the engine's tokens: each call's input is a prefix of it, its output follows
    at loss mask 1 with the engine's log-probs and versions; nothing else is trained."""
    p = sample.prompt_length
    assert sample.tokens[:p] == calls[0].input_ids
    for c in calls:
        n, m = len(c.input_ids), len(c.out.output_ids)
        assert sample.tokens[:n] == c.input_ids
        assert sample.tokens[n : n + m] == c.out.output_ids
        assert sample.loss_mask[n - p : n - p + m] == [1] * m
        assert sample.rollout_log_probs[n - p : n - p + m] == c.out.output_log_probs
        assert sample.weight_versions[n - p : n - p + m] == c.out.weight_versions
    assert sum(sample.loss_mask) == sum(len(c.out.output_ids) for c in calls)
    assert sample.tokens == calls[-1].input_ids + calls[-1].out.output_ids
    sample.validate()


@contextlib.asynccontextmanager
async def engine_client(proc: EngineProcess) -> AsyncIterator[tuple[SGLangClient, RecordingEngine]]:
    async with SGLangClient(proc.url) as client:
        await client.update_weight_version(1)
        yield client, RecordingEngine(client)


def by_session(calls: list[Call]) -> dict[Any, list[Call]]:
    out: dict[Any, list[Call]] = {}
    for c in calls:
        out.setdefault(c.routing_key, []).append(c)
    return out


def test_multi_turn_with_tools_streamed_and_not(engine_proc: EngineProcess, tokenizer: Any) -> None:
    cfg = config(n_samples_per_prompt=2)

    async def main() -> tuple[list[Sample], list[Call]]:
        async with (
            engine_client(engine_proc) as (_, engine),
            serving(cfg, engine, tokenizer) as (ctx, server),
        ):
            pool = RolloutPool(ctx=ctx, generate_fn=generate, reward_fn=length_reward)
            group = [
                Sample(
                    group_index=0, index=k, prompt=f"what is 1{k}+2", metadata={"turns": 3, "stream": k == 1}
                )
                for k in range(2)
            ]
            done = await pool.run_group(group, on_sample_done=lambda: None)
            assert server.open_sessions == 0
            return done, engine.calls

    samples, calls = asyncio.run(main())
    sessions = by_session(calls)
    assert len(sessions) == 2 and all(len(cs) == 3 for cs in sessions.values())
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        mine = next(cs for cs in sessions.values() if s.tokens[: len(cs[0].input_ids)] == cs[0].input_ids)
        assert_engine_tokens(s, mine)
        # the first prompt is what transformers' apply_chat_template makes of the conversation and tools
        hf = tokenizer.apply_chat_template(
            [{"role": "user", "content": s.prompt}], tools=agents.TOOLS, add_generation_prompt=True
        )
        assert mine[0].input_ids == list(
            hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
        )
        # what the session appended between turns is the template's rendering of the user messages
        for k, (a, b) in enumerate(itertools.pairwise(mine)):
            gap = b.input_ids[len(a.input_ids) + len(a.out.output_ids) :]
            assert tokenizer.decode(gap) == f"<|user|>more {k}<|end|><|assistant|>"
        usages = s.metadata["usages"]
        assert [u["prompt_tokens"] for u in usages] == [len(c.input_ids) for c in mine]
        assert [u["completion_tokens"] for u in usages] == [len(c.out.output_ids) for c in mine]
        assert set(s.weight_versions) <= {1, None}
    assert {s.metadata["session"]["turns"] for s in samples} == {3}


async def push(client: SGLangClient, mode: str, path: Any, version: int) -> None:
    """A weight push as the controller does it: pause, flush (unless in_place), load + stamp, continue."""
    await client.pause_generation(mode)  # type: ignore[arg-type]
    if mode != "in_place":
        await client.flush_cache()
    await client.update_weights_from_disk(str(path), version=version, flush_cache=False)
    await client.continue_generation()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_weight_pushes_in_the_middle_of_a_conversation(
    engine_proc: EngineProcess, tokenizer: Any, chat_models: ModelPair, mode: str
) -> None:
    """Turn 1 under version 1, a push, turn 2 under version 2, and a push while turn 3 generates: its
    tokens carry 2 then 3. The sample keeps every token's version."""

    async def main() -> tuple[Sample, list[Call]]:
        async with (
            engine_client(engine_proc) as (client, engine),
            serving(config(), engine, tokenizer) as (ctx, server),
            httpx.AsyncClient(base_url=engine_proc.url) as admin,
        ):
            async with server.session(ctx, {"max_new_tokens": 12, "temperature": 1.0}) as session:
                c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
                for version in (2, 3):
                    r = await c.chat.completions.create(model="m", messages=msgs)  # type: ignore[arg-type]
                    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
                    msgs += [{"role": "tool", "content": "42"}]
                    if version == 2:
                        await push(client, mode, chat_models.m2, version)
                # turn 3: long and slowed down, so the push lands while it generates
                await admin.post("/slow_down", json={"forward_sleep_time": 0.03})
                engine.call_started.clear()
                turn = asyncio.create_task(
                    c.chat.completions.create(
                        model="m",
                        messages=msgs,
                        max_tokens=40,
                        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
                    )
                )
                await engine.call_started.wait()  # turn 3 reached the engine
                await asyncio.sleep(0.4)
                await admin.post("/slow_down", json={"forward_sleep_time": None})
                await push(client, mode, chat_models.m2, 3)
                await turn
                await c.close()
                sample = trajectory_sample(
                    Sample(group_index=0, index=0, prompt="hello"),
                    session.turns,
                    tokenizer=tokenizer,
                    max_seq_len=None,
                    out_of_budget=False,
                    skip_special_tokens=False,
                )
            await push(client, "retract", chat_models.m1, 4)  # back to m1 for the other tests
            return sample, engine.calls

    sample, calls = asyncio.run(main())
    assert_engine_tokens(sample, calls)
    v1, v2, v3 = (c.out.weight_versions for c in calls)
    assert set(v1) == {1} and set(v2) == {2}
    k = v3.index(3)  # turn 3: generated under 2, then, after the push, under 3
    assert 0 < k < 40 and v3 == [2] * k + [3] * (40 - k)
    assert [v for v in sample.weight_versions if v is not None] == v1 + v2 + v3


def test_64_concurrent_sessions(engine_proc: EngineProcess, tokenizer: Any) -> None:
    n = 64
    cfg = config(custom_agent_function_path="tests.agent.agents:barrier_agent", n_samples_per_prompt=4)

    async def main() -> tuple[list[Sample], list[Call], int]:
        agents.BARRIER = asyncio.Barrier(n)  # every agent waits for all others after its first reply
        async with (
            engine_client(engine_proc) as (_, engine),
            serving(cfg, engine, tokenizer) as (ctx, server),
        ):
            pool = RolloutPool(ctx=ctx, generate_fn=generate, reward_fn=length_reward)
            groups = [
                [Sample(group_index=g, index=4 * g + k, prompt=f"q{4 * g + k}") for k in range(4)]
                for g in range(n // 4)
            ]
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(pool.run_group(grp, on_sample_done=lambda: None)) for grp in groups]
            return [s for t in tasks for s in t.result()], engine.calls, server.open_sessions

    samples, calls, still_open = asyncio.run(main())
    assert still_open == 0
    assert agents.BARRIER is not None and agents.BARRIER.n_waiting == 0
    sessions = by_session(calls)
    assert len(sessions) == n
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata.get("error")
        mine = next(cs for cs in sessions.values() if s.tokens[: len(cs[0].input_ids)] == cs[0].input_ids)
        assert len(mine) == 2
        assert_engine_tokens(s, mine)


def test_a_run_serves_agents_from_the_controllers_loop(
    engine_proc: EngineProcess, tokenizer: Any, tmp_path: Any
) -> None:
    """The whole controller (fake trainer): --custom-agent-function-path alone selects the agentic
    generate; the endpoint serves while the run runs, every trained sample is a session's trajectory,
    and the agent module's abort hook runs once at the end."""
    cfg = make_config(
        tmp_path / "run",
        custom_agent_function_path="tests.agent.agents:multi_turn_agent",
        rollout_max_response_len=8,
        num_rollout=2,
    )
    plugins = resolve_plugins(cfg)
    assert plugins.generate_fn is generate
    agents.ABORT_CALLS.clear()

    async def main() -> Any:
        async with SGLangClient(engine_proc.url) as client:
            controller = Controller(
                cfg, engine=client, trainer=FakeTrainer(step_time_s=0.01), source=make_source(n=2),
                plugins=plugins, tokenizer=tokenizer,
            )  # fmt: skip
            assert controller.ctx.sessions is not None
            summary = await controller.run()
            return summary, controller

    summary, controller = asyncio.run(main())
    assert summary.steps == 2
    trainer = controller.trainer
    assert isinstance(trainer, FakeTrainer)
    trained = [s for _, batch in trainer.steps for g in batch for s in g]
    assert len(trained) == 2 * 2 * 2
    for s in trained:
        assert s.metadata["session"]["turns"] == 3 and len(s.metadata["finish_reasons"]) == 3
        assert sum(s.loss_mask) == s.metadata["session"]["model_tokens"] > 0
        s.validate()
    assert [cfg] == agents.ABORT_CALLS
    assert controller.ctx.sessions.open_sessions == 0 and controller.ctx.sessions.stopping
