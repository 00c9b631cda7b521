"""The agentic rollout: run the user's agent against a session of its own, then train on its tokens.

    async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs) -> dict | None

(`--custom-agent-function-path pkg.mod:run_agent`, miles' contract.) `base_url` is an OpenAI-compatible
endpoint scoped to this one rollout (`openai.AsyncOpenAI(base_url=base_url, api_key=...)`); `prompt` is
the sample's prompt (a string or chat messages); `request_kwargs` are the rollout's sampling settings as
chat-completion arguments (`max_tokens`, `temperature`, `top_p`, `stop`), which the endpoint also applies
when a request leaves them out; `metadata` is the sample's metadata (plus `max_seq_len` when
`--max-seq-len` is set); with `--session-server-api-key`, `api_key=` is passed as well. The dict the agent
returns is merged into the sample's metadata, where the reward function reads it. The module may also
define `abort(args)` (plain or async): called once with the RunConfig when the run's session server shuts
down, to tear down what the agents hold (sandboxes, connections).

Outcomes: the session's turns become one sample (`Session` → `trajectory_sample`: the model's tokens at
loss mask 1 with their log-probs and versions, everything else at 0). An agent that raises, returns
something other than a dict or None, or never gets a reply from its endpoint makes the sample FAILED
under `--rollout-failure-policy` (`AgentFailed`: one log line); an agent whose failure follows an engine
failure (the endpoint answered 503) makes it ABORTED instead, like any engine failure, so the buffer
recycles or drops the group. So does a conversation whose first prompt already fills `--max-seq-len`
(as miles: nothing to train on).
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any

from miles_aio.errors import ConfigError, PluginError
from miles_aio.import_paths import load_object
from miles_aio.rollout.agent.session import trajectory_sample
from miles_aio.rollout.context import RolloutContext
from miles_aio.rollout.pool import RolloutFailed
from miles_aio.types import Sample, Status

__all__ = ["AGENT_GENERATE_PATH", "Agent", "AgentFailed", "chat_request_kwargs", "generate", "load_agent"]

AGENT_GENERATE_PATH = "miles_aio.rollout.agent:generate"
"""The generate function the run uses when --custom-agent-function-path is set."""


class AgentFailed(RolloutFailed):
    """The agent raised, returned something unusable, or produced no model turn."""


@dataclass(frozen=True, slots=True)
class Agent:
    run: Any
    """The `async def run_agent(...)`."""
    abort: Any | None
    """The module's `abort(args)` teardown hook, if it has one."""


@functools.cache
def load_agent(path: str) -> Agent:
    """The agent at `path` and its module's `abort` hook; ConfigError naming the flag if unusable."""
    flag = ["--custom-agent-function-path"]
    try:
        run = load_object(path)
    except PluginError as e:
        raise ConfigError(str(e), flags=flag) from e
    if not inspect.iscoroutinefunction(run):
        raise ConfigError(f"{path!r} must be an `async def` function, got {type(run).__name__}", flags=flag)
    module = inspect.getmodule(run)
    abort = getattr(module, "abort", None) if module is not None else None
    if abort is not None and not callable(abort):
        raise ConfigError(f"the abort hook next to {path!r} is not callable", flags=flag)
    return Agent(run=run, abort=abort)


def chat_request_kwargs(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The rollout's sampling settings as `chat.completions.create` arguments (miles'
    `build_chat_request_kwargs`, limited to what the official client accepts)."""
    out: dict[str, Any] = {}
    for src, dst in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if sampling_params.get(src) is not None:
            out[dst] = sampling_params[src]
    if sampling_params.get("stop"):
        out["stop"] = list(sampling_params["stop"])
    return out


async def generate(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Run the agent with a fresh session; the session's turns become the sample (module docstring)."""
    server = ctx.sessions
    path = ctx.config.rollout.custom_agent_function_path
    if server is None or path is None:
        raise RuntimeError(
            f"{AGENT_GENERATE_PATH} needs --custom-agent-function-path (which starts the session server)"
        )
    agent = load_agent(path)
    metadata = dict(sample.metadata)
    if (max_seq_len := ctx.config.rollout.max_seq_len) is not None:
        metadata["max_seq_len"] = max_seq_len
    extra = {"api_key": server.api_key} if server.api_key is not None else {}
    async with server.session(ctx, sampling_params) as session:
        try:
            result = await agent.run(
                base_url=session.base_url,
                prompt=copy.deepcopy(sample.prompt),
                request_kwargs=chat_request_kwargs(sampling_params),
                metadata=metadata,
                **extra,
            )
        except Exception as e:
            if session.engine_error is not None:
                return _aborted(
                    sample, f"the engine failed during the agent's session: {session.engine_error}"
                )
            if server.stopping:
                return _aborted(sample, "the session server shut down (the run is ending)")
            raise AgentFailed(f"the agent raised {type(e).__name__}: {e}") from e
    if result is not None and not isinstance(result, dict):
        raise AgentFailed(f"the agent returned {type(result).__name__}, not a dict or None")
    if not session.turns:
        if session.engine_error is not None:
            return _aborted(sample, f"the engine failed during the agent's session: {session.engine_error}")
        if session.out_of_budget:  # as miles: nothing to train on, the buffer's unused handler decides
            sample.status = Status.ABORTED
            sample.metadata["error"] = (
                "the first prompt leaves no room for a reply under --max-seq-len / --rollout-max-context-len"
            )
            return sample
        refused = f" ({session.calls} requests, all refused)" if session.calls else ""
        raise AgentFailed(
            f"the agent returned without a model reply from its session endpoint{refused}: nothing to "
            "train on"
        )
    out = trajectory_sample(
        sample,
        session.turns,
        tokenizer=server.tokenizer,
        max_seq_len=ctx.config.rollout.max_seq_len,
        out_of_budget=session.out_of_budget,
        skip_special_tokens=ctx.config.rollout.rollout_skip_special_tokens,
    )
    out.metadata["session"] |= {"requests": session.calls, "rollbacks": session.rollbacks}
    out.metadata.update(result or {})
    return out


def _aborted(sample: Sample, reason: str) -> Sample:
    sample.status = Status.ABORTED
    sample.metadata["error"] = reason
    return sample
