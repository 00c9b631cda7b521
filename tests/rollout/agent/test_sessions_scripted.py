"""The session logic alone, against a scripted FAKE engine at the engine seam (the model's replies are
given, so tool calls and failures happen on cue); agents use the official `openai` client over HTTP."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import operator
from collections.abc import Hashable, Mapping
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall, ChatCompletionMessageParam

from miles_aio.errors import ConfigError, EngineUnavailable
from miles_aio.rollout.agent import AgentFailed, generate
from miles_aio.rollout.agent.session import trajectory_sample
from miles_aio.rollout.pool import RolloutPool
from miles_aio.types import GenerateOutput, Sample, Status
from tests.helpers import make_config
from tests.rollout.agent import agents
from tests.rollout.agent.conftest import serving
from tests.rollout.test_user_code_pool import my_error_generate

pytestmark = pytest.mark.timeout(60)

CALL = '<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>'


class ScriptedEngine:
    """A FAKE engine: each call answers with the next scripted reply (text → tokens, then `<|end|>`), or
    raises it if it is an exception. Tokens carry `version`; log-probs are -(id+1)/100."""

    def __init__(self, tokenizer: Any, replies: list[str | Exception], *, finish: str = "stop") -> None:
        self.tok, self.replies, self.finish = tokenizer, list(replies), finish
        self.version = 1
        self.calls: list[dict[str, Any]] = []
        self.end_id = tokenizer.convert_tokens_to_ids("<|end|>")

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        reply = self.replies.pop(0)
        self.calls.append({"input_ids": list(input_ids), "params": dict(sampling_params), "key": routing_key})
        if isinstance(reply, Exception):
            raise reply
        full = [*self.tok.encode(reply, add_special_tokens=False), self.end_id]
        ids = full[: int(sampling_params["max_new_tokens"])]
        finish = self.finish if len(ids) == len(full) else "length"
        return GenerateOutput(
            text=reply,
            output_ids=ids,
            output_log_probs=[-(t + 1) / 100 for t in ids],
            weight_versions=[self.version] * len(ids),
            finish_reason=finish,  # type: ignore[arg-type]
            meta={"finish_reason": {"type": finish, "matched": self.end_id}},
        )


def config(agent: str = "multi_turn_agent", **kw: Any) -> Any:
    return make_config(custom_agent_function_path=f"tests.rollout.agent.agents:{agent}", **kw)


PARAMS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0}


def run_agent_rollout(
    tokenizer: Any, engine: ScriptedEngine, sample: Sample, cfg: Any = None
) -> tuple[Sample, list[dict[str, Any]]]:
    async def main() -> Sample:
        async with serving(cfg or config(), engine, tokenizer) as (ctx, server):
            out = await generate(ctx, sample, dict(PARAMS))
            assert server.open_sessions == 0
            return out

    return asyncio.run(main()), engine.calls


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip_and_only_the_models_tokens_are_trained(tokenizer: Any, stream: bool) -> None:
    engine = ScriptedEngine(tokenizer, [CALL, "it is 42", CALL])
    sample = Sample(group_index=0, index=0, prompt="12+30", metadata={"turns": 3, "stream": stream})
    out, calls = run_agent_rollout(tokenizer, engine, sample)
    assert out.status == Status.COMPLETED
    # the agent saw parsed tool calls (finish reason tool_calls) and a plain answer
    assert out.metadata["finish_reasons"] == ["tool_calls", "stop", "tool_calls"]
    history = out.metadata["final_history"]
    assert history[1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"e": "12+30"}'}
    assert history[1]["content"] is None and history[2] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": "42",
    }
    assert [u["prompt_tokens"] for u in out.metadata["usages"]] == [len(c["input_ids"]) for c in calls]
    # every turn's input is the previous input + the model's own output + the rendered suffix
    for prev, nxt in itertools.pairwise(calls):
        n = len(prev["input_ids"])
        assert nxt["input_ids"][:n] == prev["input_ids"]
    assert {c["key"] for c in calls} == {calls[0]["key"]}  # one routing key: the session
    # the sample: the first prompt, then turns; the model's tokens (3 replies + <|end|>) at loss mask 1
    replies = [
        [*tokenizer.encode(r, add_special_tokens=False), engine.end_id] for r in (CALL, "it is 42", CALL)
    ]
    assert out.tokens[: out.prompt_length] == calls[0]["input_ids"]
    assert [
        t for t, m in zip(out.tokens[out.prompt_length :], out.loss_mask, strict=True) if m
    ] == functools.reduce(operator.iadd, replies, [])
    assert out.rollout_log_probs == [
        (-(t + 1) / 100 if m else 0.0)
        for t, m in zip(out.tokens[out.prompt_length :], out.loss_mask, strict=True)
    ]
    context = [t for t, m in zip(out.tokens[out.prompt_length :], out.loss_mask, strict=True) if not m]
    assert tokenizer.decode(context) == "<|tool|>42<|end|><|assistant|><|user|>more 1<|end|><|assistant|>"
    assert out.metadata["session"] == {
        "turns": 3, "model_tokens": sum(map(len, replies)), "context_tokens": len(context),
        "truncated_by_max_seq_len": False, "requests": 3, "rollbacks": 0,
    }  # fmt: skip
    out.validate()


async def _converse(server: Any, ctx: Any, script: Any) -> Any:
    async with server.session(ctx, dict(PARAMS)) as session:
        c = openai.AsyncOpenAI(base_url=session.base_url, api_key="x", max_retries=0)
        result = await script(c)
        await c.close()
        return session, result


def test_resent_arguments_strict_rolls_back_loose_matches(tokenizer: Any) -> None:
    """A client that re-serializes tool-call arguments: strict sees another reply (and retries that step,
    regenerating it), loose_tool_call sees the same one."""

    async def script(c: openai.AsyncOpenAI) -> list[Any]:
        msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "q"}]
        first = await c.chat.completions.create(model="m", messages=msgs, tools=agents.TOOLS)
        assert first.choices[0].message.tool_calls
        call = first.choices[0].message.tool_calls[0]
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        respelled = json.dumps(json.loads(call.function.arguments), indent=2)
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "calc", "arguments": respelled}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "42"},
        ]  # fmt: skip
        return [await c.chat.completions.create(model="m", messages=msgs, tools=agents.TOOLS)]

    for matcher, rollbacks, calls in [("strict", 1, 2), ("loose_tool_call", 0, 2)]:
        engine = ScriptedEngine(tokenizer, [CALL, "42"])

        async def main(m: str = matcher, e: ScriptedEngine = engine) -> Any:
            async with serving(config(session_message_matcher=m), e, tokenizer) as (ctx, server):
                return await _converse(server, ctx, script)

        session, _ = asyncio.run(main())
        assert (session.rollbacks, len(engine.calls)) == (rollbacks, calls), matcher
        assert len(session.turns) == 2 - rollbacks


def test_a_diverging_history_is_refused_with_a_reason_and_changes_nothing(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["a", "b", "c", "d"])

    async def script(c: openai.AsyncOpenAI) -> Any:
        msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "q"}]
        for k in range(3):
            r = await c.chat.completions.create(model="m", messages=msgs)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": str(k)},
            ]
        errors = []
        back: list[ChatCompletionMessageParam] = [
            msgs[0],
            {"role": "assistant", "content": "rewritten"},
            *msgs[2:],
        ]
        other: list[ChatCompletionMessageParam] = [{"role": "user", "content": "another question"}]
        for bad in (back, other):  # back 3 replies; another conversation
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(model="m", messages=bad)
            errors.append(info.value)
        return errors

    async def main() -> Any:
        async with serving(config(), engine, tokenizer) as (ctx, server):
            return await _converse(server, ctx, script)

    session, errors = asyncio.run(main())
    assert [e.code for e in errors] == ["history_diverged"] * 2
    assert "would roll back 3 replies, at most 1" in errors[0].message
    assert "another conversation" in errors[1].message
    assert len(session.turns) == 3 and len(engine.calls) == 3  # nothing generated, nothing lost


def test_failures_follow_the_rollout_failure_policy(
    tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    def pool_run(agent: str, policy: str, replies: list[str | Exception]) -> Sample:
        engine = ScriptedEngine(tokenizer, replies)
        cfg = config(agent, rollout_failure_policy=policy, n_samples_per_prompt=1)

        async def main() -> Sample:
            async with serving(cfg, engine, tokenizer) as (ctx, _):
                pool = RolloutPool(ctx=ctx, generate_fn=generate, reward_fn=None)
                group = await pool.run_group(
                    [Sample(group_index=0, index=0, prompt="q")], on_sample_done=lambda: None
                )
                return group[0]

        return asyncio.run(main())

    raised = pool_run("raising_agent", "drop", ["x"])
    assert raised.status == Status.FAILED
    assert "the agent raised ValueError: the sandbox exploded" in raised.metadata["error"]
    silent = pool_run("silent_agent", "retry", [])
    assert silent.status == Status.FAILED
    assert "without a model reply from its session endpoint" in silent.metadata["error"]
    # the engine failed (503 to the agent, which gave up): aborted like any engine failure, not FAILED
    down = pool_run("echo_agent", "fail", [EngineUnavailable("connection refused")])
    assert down.status == Status.ABORTED and "engine failed" in down.metadata["error"]
    with pytest.raises(ExceptionGroup) as info:  # under "fail" it propagates: the run stops, loudly
        pool_run("raising_agent", "fail", ["x"])
    leaf: BaseException = info.value
    while isinstance(leaf, ExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, AgentFailed) and "sandbox exploded" in str(leaf)
    assert isinstance(leaf.__cause__, ValueError)
    logged = "".join(capsys.readouterr())  # stdout by structlog's default, stderr once logging is configured
    assert logged.count("rollout failed; sample failed") == 2 and "Traceback" not in logged  # one line each


def test_a_call_after_the_session_ended_is_404_and_the_hook_runs_at_shutdown(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["hi"])
    agents.ABORT_CALLS.clear()
    cfg = config("echo_agent")

    async def main() -> Any:
        async with serving(cfg, engine, tokenizer) as (ctx, _server):
            sample = await generate(ctx, Sample(group_index=0, index=0, prompt="q"), dict(PARAMS))
            c = openai.AsyncOpenAI(base_url=agents.SEEN_BASE_URLS[-1], api_key="x", max_retries=0)
            with pytest.raises(openai.NotFoundError) as info:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
            await c.close()
            assert agents.ABORT_CALLS == []
            return sample, info.value

    sample, err = asyncio.run(main())
    assert sample.status == Status.COMPLETED and err.code == "session_not_found"
    assert [cfg] == agents.ABORT_CALLS  # the module's abort(args), once, at shutdown


def test_max_seq_len_caps_replies_and_cuts_the_sample(tokenizer: Any) -> None:
    long = "x" * 60
    engine = ScriptedEngine(tokenizer, [long, long, long])
    sample = Sample(group_index=0, index=0, prompt="q", metadata={"turns": 3})
    out, calls = run_agent_rollout(tokenizer, engine, sample, config(max_seq_len=200))
    assert len(calls) == 2  # the third request found no room: answered "length" without an engine call
    assert out.metadata["finish_reasons"] == ["stop", "length", "length"]
    assert all(len(c["input_ids"]) + c["params"]["max_new_tokens"] == 200 for c in calls)  # capped to fit
    assert len(out.tokens) == 200 and out.status == Status.TRUNCATED
    assert out.metadata["told"]["max_seq_len"] == 200  # the agent was told


def test_the_api_key_is_enforced_and_off_loopback_needs_one(tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match="--session-server-api-key"):
        config(session_server_host="0.0.0.0")
    engine = ScriptedEngine(tokenizer, ["ok"])

    async def main() -> Any:
        async with serving(config(session_server_api_key="s3cret"), engine, tokenizer) as (ctx, server):
            async with server.session(ctx, dict(PARAMS)) as session:
                msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "q"}]
                bad = openai.AsyncOpenAI(base_url=session.base_url, api_key="wrong", max_retries=0)
                with pytest.raises(openai.AuthenticationError):
                    await bad.chat.completions.create(model="m", messages=msgs)
                good = openai.AsyncOpenAI(base_url=session.base_url, api_key="s3cret", max_retries=0)
                r = await good.chat.completions.create(model="m", messages=msgs)
                await bad.close()
                await good.close()
                return r

    assert asyncio.run(main()).choices[0].message.content == "ok"


def test_trajectory_sample_refuses_nothing_silently(tokenizer: Any) -> None:
    """The sample builder checks the engine's tokens: a turn whose prompt lost a token cannot be assembled."""
    from miles_aio.rollout.agent.session import Turn
    from miles_aio.rollout.agent.tito import TokenMismatch, TurnTokens

    t1 = Turn([], {}, None, TurnTokens([1, 2], [3], [-0.1], [1]), "stop")
    t2 = Turn([], {}, None, TurnTokens([1, 2, 9, 4], [5], [-0.1], [1]), "stop")  # 3 became 9
    with pytest.raises(TokenMismatch):
        trajectory_sample(
            Sample(group_index=0, index=0, prompt="q"), [t1, t2], tokenizer=tokenizer, max_seq_len=None,
            out_of_budget=False, skip_special_tokens=False,
        )  # fmt: skip


def test_bad_agent_flags_are_config_errors_naming_the_flag() -> None:
    from miles_aio.plugins import resolve_plugins

    for kw, flag in [
        ({"custom_agent_function_path": "nope.mod:run"}, "--custom-agent-function-path"),
        (
            {"custom_agent_function_path": "tests.rollout.agent.agents:calc"},
            "--custom-agent-function-path",
        ),  # not async
        ({"session_message_matcher": "exact"}, "--session-message-matcher"),
        ({"session_tool_call_parser": "hermes"}, "--session-tool-call-parser"),
    ]:
        overrides: dict[str, Any] = {
            "custom_agent_function_path": "tests.rollout.agent.agents:echo_agent",
            **kw,
        }
        cfg = make_config(**overrides)
        with pytest.raises(ConfigError) as info:
            resolve_plugins(cfg)
        assert info.value.flags == (flag,)
    assert resolve_plugins(config()).generate_fn is generate  # the agentic generate, selected by the agent
    mine = config(custom_generate_function_path="tests.rollout.test_user_code_pool:my_error_generate")
    assert resolve_plugins(mine).generate_fn is my_error_generate  # a generate given explicitly is kept
    with pytest.raises(ConfigError, match="has the signature") as info:  # an agent is no generate function
        resolve_plugins(config(custom_generate_function_path="tests.rollout.agent.agents:echo_agent"))
    assert info.value.flags == ("--custom-generate-function-path",)
    with pytest.raises(ConfigError, match="--max-seq-len"):
        config(max_seq_len=0)
