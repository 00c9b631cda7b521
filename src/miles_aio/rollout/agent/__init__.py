"""Agentic rollouts: an OpenAI-compatible session endpoint in the controller, token in / token out (TITO).

An agent (`--custom-agent-function-path pkg.mod:run_agent`) is ordinary OpenAI-client code; each rollout
gives it a `base_url` of its own. The endpoint renders the conversation with the model's chat template,
generates through the rollout's engine client (limiter, router, retries, partial rollout, per-token
versions) and keeps the exact tokens the engine produced, so the trajectory it trains on is the model's
own, never a re-tokenization of its text.

    generate.py   the agentic generate function and the agent contract (miles'); `AgentFailed`
    server.py     `SessionServer`: the aiohttp endpoint, served from the controller's event loop
    session.py    `Session` (one rollout's conversation) and the sample it becomes
    tito.py       the pure decisions: history matching and rollback, the next prompt, assembly + its check
    matchers.py   `--session-message-matcher`: strict, loose_tool_call, role_content_only, PKG.MOD:FN
    parsers.py    `--session-tool-call-parser`: qwen25 (<tool_call>{json}</tool_call>), none, PKG.MOD:FN
    protocol.py   OpenAI's chat-completions request and answer formats (JSON and SSE chunks)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from miles_aio.chat_template import ChatTemplate, ChatTemplateError
from miles_aio.errors import ConfigError, PluginError
from miles_aio.rollout.agent.generate import AGENT_GENERATE_PATH, AgentFailed, generate, load_agent
from miles_aio.rollout.agent.matchers import resolve_message_matcher
from miles_aio.rollout.agent.parsers import resolve_tool_call_parser
from miles_aio.rollout.agent.server import SessionServer

if TYPE_CHECKING:
    from miles_aio.config import RunConfig
    from miles_aio.rollout.context import Tokenizer

__all__ = [
    "AGENT_GENERATE_PATH",
    "AgentFailed",
    "SessionServer",
    "agent_sessions",
    "check_agent_config",
    "generate",
]


def check_agent_config(cfg: RunConfig) -> str:
    """Resolve the agent, matcher and parser of `cfg` (ConfigError naming the flag if one does not), and
    return the generate function's path: the agentic generate unless another was given."""
    r = cfg.rollout
    assert r.custom_agent_function_path is not None
    load_agent(r.custom_agent_function_path)
    for flag, selector, resolve in (
        ("--session-message-matcher", r.session_message_matcher, resolve_message_matcher),
        ("--session-tool-call-parser", r.session_tool_call_parser, resolve_tool_call_parser),
    ):
        try:
            resolve(selector)
        except PluginError as e:
            raise ConfigError(str(e), flags=[flag]) from e
    default = next(f.default for f in dataclasses.fields(r) if f.name == "custom_generate_function_path")
    return (
        AGENT_GENERATE_PATH if r.custom_generate_function_path == default else r.custom_generate_function_path
    )


def agent_sessions(cfg: RunConfig, tokenizer: Tokenizer | None) -> SessionServer | None:
    """The run's session server (not yet serving), or None without --custom-agent-function-path."""
    r = cfg.rollout
    if r.custom_agent_function_path is None:
        return None
    flags = ["--custom-agent-function-path"]
    try:
        template = ChatTemplate.from_tokenizer(tokenizer) if tokenizer is not None else None
    except ChatTemplateError as e:
        raise ConfigError(f"the model's chat template is unusable: {e}", flags=flags) from e
    if tokenizer is None or template is None:
        raise ConfigError("agent sessions need a tokenizer with a chat template", flags=flags)
    return SessionServer(
        tokenizer=tokenizer,
        template=template,
        matcher=resolve_message_matcher(r.session_message_matcher),
        parser=resolve_tool_call_parser(r.session_tool_call_parser),
        host=r.session_server_host,
        port=r.session_server_port,
        api_key=r.session_server_api_key,
        max_seq_len=r.max_seq_len,
        max_context_len=r.rollout_max_context_len,
        abort_hook=load_agent(r.custom_agent_function_path).abort,
        abort_args=cfg,
    )
