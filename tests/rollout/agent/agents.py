"""Agents the tests plug in (`--custom-agent-function-path tests.rollout.agent.agents:<name>`): ordinary
code on the official `openai` client, as a user would write it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam

SEEN_BASE_URLS: list[str] = []
"""Every base_url an agent here was given (a test reuses one after its session ended)."""
ABORT_CALLS: list[Any] = []
BARRIER: asyncio.Barrier | None = None
"""`barrier_agent`s wait here after their first reply (a test sets it inside its event loop)."""


async def abort(args: Any) -> None:
    """The module's teardown hook: the session server calls it once when it shuts down."""
    ABORT_CALLS.append(args)


def client(base_url: str, api_key: str | None = None) -> openai.AsyncOpenAI:
    SEEN_BASE_URLS.append(base_url)
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "unused", max_retries=0)


async def ask(
    c: openai.AsyncOpenAI, messages: Sequence[dict[str, Any]], *, stream: bool, **kw: Any
) -> dict[str, Any]:
    """One chat call; the reply as the message dict the agent appends to its history, plus its finish."""
    # the history is plain dicts, as a user keeps it; the client declares its messages as TypedDicts
    history = cast("list[ChatCompletionMessageParam]", list(messages))
    if not stream:
        resp = await c.chat.completions.create(model="default", messages=history, **kw)
        msg = resp.choices[0].message
        out: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
        return {"message": out, "finish_reason": resp.choices[0].finish_reason, "usage": resp.usage}
    content, finish, usage = "", None, None
    calls: dict[int, dict[str, Any]] = {}
    events = await c.chat.completions.create(
        model="default", messages=history, stream=True, stream_options={"include_usage": True}, **kw
    )
    async for chunk in events:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "type": "function", "function": {}})
                slot["function"] = {"name": tc.function.name, "arguments": tc.function.arguments}
            finish = choice.finish_reason or finish
    out = {"role": "assistant", "content": content or None}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": out, "finish_reason": finish, "usage": usage}


def calc(expression: str) -> str:
    a, _, b = expression.partition("+")
    return str(int(a) + int(b))


TOOLS: list[ChatCompletionToolUnionParam] = [
    {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
]


async def multi_turn_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> dict[str, Any]:
    """`metadata["turns"]` calls (default 3): every tool call is answered with a tool message, any other
    reply with a user message; `metadata["stream"]` streams."""
    c = client(base_url, kwargs.get("api_key"))
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    finishes, usages = [], []
    for k in range(int(metadata.get("turns", 3))):
        got = await ask(c, messages, stream=bool(metadata.get("stream")), tools=TOOLS, **request_kwargs)
        messages.append(got["message"])
        finishes.append(got["finish_reason"])
        usages.append(got["usage"].model_dump() if got["usage"] else None)
        for tc in got["message"].get("tool_calls") or []:
            args = json.loads(tc["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": calc(args["e"])})
        if not got["message"].get("tool_calls"):
            messages.append({"role": "user", "content": f"more {k}"})
    await c.close()
    return {"finish_reasons": finishes, "usages": usages, "final_history": messages, "told": metadata}


async def raising_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> dict[str, Any]:
    async with client(base_url) as c:
        await ask(c, [{"role": "user", "content": str(prompt)}], stream=False)
        raise ValueError("the sandbox exploded")


async def silent_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> dict[str, Any]:
    SEEN_BASE_URLS.append(base_url)
    return {"did": "nothing"}


async def echo_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> None:
    """One call, nothing returned."""
    async with client(base_url) as c:
        await ask(c, [{"role": "user", "content": str(prompt)}], stream=False, **request_kwargs)


async def barrier_agent(
    base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], **kwargs: Any
) -> dict[str, Any]:
    """Two turns; between them, waits at `BARRIER` until every other barrier agent had its first reply."""
    assert BARRIER is not None
    async with client(base_url) as c:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": str(prompt)}]
        got = await ask(c, msgs, stream=False, **request_kwargs)
        await BARRIER.wait()
        msgs += [got["message"], {"role": "user", "content": "again"}]
        await ask(c, msgs, stream=True, **request_kwargs)
    return {"waited": True}
