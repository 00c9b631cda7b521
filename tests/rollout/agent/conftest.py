"""Fixtures for the agent-session tests: a tiny chat model (role tokens, a chat template), its tokenizer,
and helpers that open a session server on a rollout context over any engine (the tests record what the
engine consumed and produced with `miles_aio.testing.recording.RecordingEngine`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import structlog

from miles_aio.config import RunConfig
from miles_aio.models.tiny import load_tokenizer
from miles_aio.rollout.agent import agent_sessions
from miles_aio.rollout.agent.server import SessionServer
from miles_aio.rollout.context import LimitedEngine, RolloutContext
from miles_aio.rollout.limiter import Limiter
from tests.engine.helpers import EngineProcess, ModelPair, model_pair

# Every character the tests' messages and tool calls use (the tokenizer drops the others).
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +=.,:;_-<>/{}[]\"'\n"


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    root = tmp_path_factory.mktemp("chat-weights")
    kw: dict[str, Any] = {
        "alphabet": ALPHABET,
        "chat_tokens": True,
        "hidden_size": 64,
        "max_position_embeddings": 1024,
    }
    return model_pair(root, **kw)


@pytest.fixture(scope="session")
def tokenizer(chat_models: ModelPair) -> Any:
    return load_tokenizer(chat_models.m1)


@pytest.fixture(scope="module")
def engine_proc(chat_models: ModelPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A real `python -m miles_aio.engine` serving m1 (weights root: the chat models' dir)."""
    proc = EngineProcess(
        chat_models.m1,
        "--weights-root", str(chat_models.root), "--max-running-requests", "128",
        log_dir=tmp_path_factory.mktemp("agent-engine-logs"),
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.stderr()


@contextlib.asynccontextmanager
async def serving(
    cfg: RunConfig, engine: Any, tokenizer: Any
) -> AsyncIterator[tuple[RolloutContext, SessionServer]]:
    """A rollout context on `engine` (through a limiter, as the controller builds it) whose session server
    serves for the duration of the block."""
    server = agent_sessions(cfg, tokenizer)
    assert server is not None
    ctx = RolloutContext(
        engine=LimitedEngine(engine, Limiter(256)),
        tokenizer=tokenizer,
        config=cfg,
        log=structlog.get_logger("tests.rollout.agent"),
        sessions=server,
    )
    async with server.running():
        yield ctx, server
