"""Agent sessions over a real embedded engine process (`python -m miles_aio.engine`, a tiny chat model):
agents on the official `openai` client, multi-turn with tools, streamed and not, weight pushes in the
middle of a conversation (retract and in_place), 64 sessions at once; every sample's tokens are checked
against what the engine itself consumed and produced, call by call."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from miles_aio.controller import Controller
from miles_aio.inference.base import GenerateChunk
from miles_aio.inference.client import SGLangClient
from miles_aio.plugins import resolve_plugins
from miles_aio.rollout.agent import generate
from miles_aio.rollout.agent.session import trajectory_sample
from miles_aio.rollout.pool import RolloutPool
from miles_aio.testing import FakeTrainer
from miles_aio.testing.recording import RecordedCall, RecordingEngine
from miles_aio.types import GenerateOutput, Sample, Status
from tests.engine.helpers import EngineProcess, ModelPair
from tests.helpers import length_reward, make_config, make_source
from tests.rollout.agent import agents
from tests.rollout.agent.conftest import serving

pytestmark = [pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(120)]


def config(**kw: Any) -> Any:
    kw.setdefault("custom_agent_function_path", "tests.rollout.agent.agents:multi_turn_agent")
    return make_config(rollout_max_response_len=12, rollout_temperature=1.0, **kw)


def assert_engine_tokens(sample: Sample, calls: list[RecordedCall]) -> None:
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
async def engine_client(
    proc: EngineProcess, *, partial_rollout: bool = False
) -> AsyncIterator[tuple[SGLangClient, RecordingEngine]]:
    async with SGLangClient(proc.url, partial_rollout=partial_rollout) as client:
        await client.update_weight_version(1)
        yield client, RecordingEngine(client)


def by_session(calls: list[RecordedCall]) -> dict[Any, list[RecordedCall]]:
    out: dict[Any, list[RecordedCall]] = {}
    for c in calls:
        out.setdefault(c.routing_key, []).append(c)
    return out


def test_multi_turn_with_tools_streamed_and_not(engine_proc: EngineProcess, tokenizer: Any) -> None:
    cfg = config(n_samples_per_prompt=2)

    async def main() -> tuple[list[Sample], list[RecordedCall]]:
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


@pytest.mark.parametrize(
    ("mode", "stream"), [("retract", False), ("in_place", False), ("abort", False), ("abort", True)]
)
def test_weight_pushes_in_the_middle_of_a_conversation(
    engine_proc: EngineProcess, tokenizer: Any, chat_models: ModelPair, mode: str, stream: bool
) -> None:
    """Turn 1 under version 1, a push, turn 2 under version 2, and a push while turn 3 generates: its
    tokens carry 2 then 3. The sample keeps every token's version. Under `abort` (with partial rollout:
    `--pause-generation-mode abort --partial-rollout`) the push aborts turn 3 on the engine; the client
    resubmits prompt + partial output once the push is over, and the agent still gets one complete reply
    (streamed: the tokens before the push reach it before the push)."""

    async def main() -> tuple[Sample, list[RecordedCall], int, list[str], int]:
        async with (
            engine_client(engine_proc, partial_rollout=mode == "abort") as (client, engine),
            serving(config(), engine, tokenizer) as (ctx, server),
            httpx.AsyncClient(base_url=engine_proc.url) as admin,
        ):
            async with server.session(ctx, {"max_new_tokens": 12, "temperature": 1.0}) as session:
                c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
                msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
                for version in (2, 3):
                    r = await c.chat.completions.create(model="m", messages=msgs)
                    msgs += [{"role": "assistant", "content": r.choices[0].message.content}]
                    # a tool message answering no tool call (no tool_call_id): rendered all the same
                    msgs += [cast("ChatCompletionMessageParam", {"role": "tool", "content": "42"})]
                    if version == 2:
                        await push(client, mode, chat_models.m2, version)
                # turn 3: long and slowed down, so the push lands while it generates
                await admin.post("/slow_down", json={"forward_sleep_time": 0.03})
                engine.call_started.clear()
                deltas: list[str] = []
                before_push = asyncio.Event()
                kw: dict[str, Any] = {"max_tokens": 40, "extra_body": {"ignore_eos": True}, "logprobs": True}

                async def turn3() -> Any:
                    if not stream:
                        return await c.chat.completions.create(model="m", messages=msgs, **kw)
                    events = await c.chat.completions.create(model="m", messages=msgs, stream=True, **kw)
                    finish = None
                    async for e in events:
                        for ch in e.choices:
                            deltas.extend(
                                lp.token for lp in (ch.logprobs.content if ch.logprobs else None) or []
                            )
                            finish = ch.finish_reason or finish
                        if len(deltas) >= 5:
                            before_push.set()
                    return finish

                task = asyncio.create_task(turn3())
                await engine.call_started.wait()  # turn 3 reached the engine
                if stream:
                    await before_push.wait()  # the agent has tokens: the stream is under way
                    streamed_before_push = len(deltas)
                else:
                    await asyncio.sleep(0.4)
                    streamed_before_push = 0
                await admin.post("/slow_down", json={"forward_sleep_time": None})
                await push(client, mode, chat_models.m2, 3)
                reply = await task
                assert (reply if stream else reply.choices[0].finish_reason) == "length"
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
            return sample, engine.calls, client.continuations, deltas, streamed_before_push

    sample, calls, continuations, deltas, streamed_before_push = asyncio.run(main())
    assert_engine_tokens(sample, calls)
    assert len(calls) == 3  # one engine call per turn, whatever the push did to it
    v1, v2, v3 = (c.out.weight_versions for c in calls)
    assert set(v1) == {1} and set(v2) == {2}
    k = v3.index(3)  # turn 3: generated under 2, then, after the push, under 3
    assert 0 < k < 40 and v3 == [2] * k + [3] * (40 - k)
    assert [v for v in sample.weight_versions if v is not None] == v1 + v2 + v3
    assert continuations == (1 if mode == "abort" else 0)
    if mode == "abort":
        assert calls[2].out.meta["partial_rollout_segments"] == 2
    if stream:  # every token streamed, in order, and those before the push arrived before it
        assert deltas == [tokenizer.decode([t]) for t in calls[2].out.output_ids]
        # The engine may coalesce tokens into one chunk under load: the chunks join to the output.
        chunks = calls[2].chunks
        assert chunks is not None and len(chunks) > 1
        assert [t for ch in chunks for t in ch.output_ids] == calls[2].out.output_ids
        assert 5 <= streamed_before_push <= k


def test_the_client_streams_what_it_would_return_whole(engine_proc: EngineProcess) -> None:
    """SGLang's streaming /generate through the client: a chunk per token as the engine produces them,
    and the same GenerateOutput as the non-streamed call (same seed), token, log-prob and version."""
    params = {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}

    async def main() -> tuple[GenerateOutput, GenerateOutput, list[GenerateChunk]]:
        async with SGLangClient(engine_proc.url) as client:
            await client.update_weight_version(1)
            chunks: list[GenerateChunk] = []

            async def sink(chunk: GenerateChunk) -> None:
                chunks.append(chunk)

            await client.flush_cache()
            streamed = await client.generate_stream(
                input_ids=[3, 4, 5, 6], sampling_params=params, on_chunk=sink, routing_key="k"
            )
            await client.flush_cache()
            whole = await client.generate(input_ids=[3, 4, 5, 6], sampling_params=params, routing_key="k")
            return streamed, whole, chunks

    streamed, whole, chunks = asyncio.run(main())
    assert len(chunks) > 1 and len(streamed.output_ids) == 64
    assert [t for c in chunks for t in c.output_ids] == streamed.output_ids == whole.output_ids
    assert [lp for c in chunks for lp in c.output_log_probs] == streamed.output_log_probs
    assert streamed.output_log_probs == whole.output_log_probs
    assert [v for c in chunks for v in c.weight_versions] == streamed.weight_versions == whole.weight_versions
    assert (streamed.text, streamed.finish_reason, streamed.prompt_tokens) == (
        whole.text,
        whole.finish_reason,
        whole.prompt_tokens,
    )


def test_a_streamed_reply_reaches_the_agent_while_the_engine_generates(
    engine_proc: EngineProcess, tokenizer: Any
) -> None:
    """A 64-token reply streamed to the official client. The engine's stream is held after its first
    chunk until the agent has a delta of it: the agent got tokens while the generation was unfinished (its
    engine call had not returned). Many content chunks arrive, and the reply is the non-streamed one
    (same seed), token for token, log-prob for log-prob."""

    async def main() -> dict[bool, Any]:
        seen = asyncio.Event()
        held: list[int] = []

        async def hold(chunk: GenerateChunk) -> None:
            if not held:
                held.append(len(chunk.output_ids))
                async with asyncio.timeout(30):  # the agent must see this chunk while it is held here
                    await seen.wait()

        async with SGLangClient(engine_proc.url) as client:
            await client.update_weight_version(1)
            engine = RecordingEngine(client, on_stream_chunk=hold)
            out: dict[bool, Any] = {}
            async with serving(config(), engine, tokenizer) as (ctx, server):
                for stream in (True, False):
                    await client.flush_cache()
                    async with server.session(ctx, {"max_new_tokens": 64, "temperature": 1.0}) as session:
                        c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
                        kw: dict[str, Any] = {
                            "model": "m",
                            "messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 64,
                            "seed": 7,
                            "logprobs": True,
                            "extra_body": {"ignore_eos": True},
                        }
                        got: dict[str, Any] = {"content": [], "logprobs": [], "calls_at_first_token": None}
                        if stream:
                            events = await c.chat.completions.create(stream=True, **kw)
                            async for e in events:
                                for ch in e.choices:
                                    if ch.logprobs and ch.logprobs.content:
                                        if got["calls_at_first_token"] is None:
                                            got["calls_at_first_token"] = len(engine.calls)
                                            seen.set()
                                        got["logprobs"] += [lp.logprob for lp in ch.logprobs.content]
                                    if ch.delta.content:
                                        got["content"].append(ch.delta.content)
                        else:
                            r = await c.chat.completions.create(**kw)
                            got["content"] = [r.choices[0].message.content]
                            got["logprobs"] = [lp.logprob for lp in r.choices[0].logprobs.content]
                        await c.close()
                        got["tokens"] = session.turns[0].tokens
                        out[stream] = got
            out[True]["chunks"] = engine.calls[0].chunks
            return out

    out = asyncio.run(main())
    streamed, whole = out[True], out[False]
    assert streamed["calls_at_first_token"] == 0  # the engine call was still running (held at chunk 1)
    # the engine sends what each step produced since the last chunk: one token per chunk when the loop
    # keeps up, several when it is busy (a loaded machine); all 64 arrive, in more than one chunk
    chunks = streamed["chunks"]
    assert sum(len(c.output_ids) for c in chunks) == 64 and len(chunks) > 1 and len(streamed["content"]) > 1
    assert streamed["tokens"] == whole["tokens"]  # the same turn: prompt, output ids, log-probs, versions
    assert "".join(streamed["content"]) == "".join(whole["content"])
    assert streamed["logprobs"] == whole["logprobs"] == list(whole["tokens"].log_probs)


def test_64_concurrent_sessions(engine_proc: EngineProcess, tokenizer: Any) -> None:
    n = 64
    cfg = config(
        custom_agent_function_path="tests.rollout.agent.agents:barrier_agent", n_samples_per_prompt=4
    )

    async def main() -> tuple[list[Sample], list[RecordedCall], int]:
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
        custom_agent_function_path="tests.rollout.agent.agents:multi_turn_agent",
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
