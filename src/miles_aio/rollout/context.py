"""`RolloutContext`: everything a user's generate/reward coroutine may touch.

Users never see HTTP, versions or the limiter: `ctx.engine.generate(...)` takes a limiter slot for
the duration of one engine call (not for tool calls between turns), and the engine client handles
routing, retries and partial-rollout continuation. `ctx.engine.generate_stream(..., on_chunk=...)` is the
same call with the tokens handed out as they are produced (the agent endpoint's `stream: true`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, final

import structlog

from miles_aio._gc import request_done
from miles_aio.config import RunConfig
from miles_aio.inference.base import ChunkSink, InferenceEngine, PauseMode, WeightBroadcast, generate_streamed
from miles_aio.observability.trace import NullTracer, Tracer
from miles_aio.rollout.limiter import Limiter
from miles_aio.types import GenerateOutput

if TYPE_CHECKING:
    from miles_aio.rollout.agent.server import SessionServer

__all__ = ["LimitedEngine", "PromptIdCache", "RolloutContext", "Tokenizer"]


class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer that rollout code uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@final
class LimitedEngine:
    """An InferenceEngine whose `generate` holds one limiter slot per call; admin calls pass through."""

    def __init__(
        self, engine: InferenceEngine, limiter: Limiter, *, priority: int = 0, tracer: Tracer | None = None
    ) -> None:
        self.inner = engine
        self.limiter = limiter
        self.priority = priority
        self.generated_tokens = 0
        self.tracer = tracer if tracer is not None else NullTracer()
        """Gets one slice per call (named `eval generate` above the rollout priority)."""

    def with_priority(self, priority: int) -> LimitedEngine:
        """The same engine, limiter and tracer, queuing in another priority class (eval: above rollout)."""
        return LimitedEngine(self.inner, self.limiter, priority=priority, tracer=self.tracer)

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        # acquire/release rather than `async with limiter.slot(...)`: no slot object per request
        await self.limiter.acquire(self.priority)
        try:
            span, out = self.tracer.request_start(routing_key), None
            try:
                out = await self.inner.generate(
                    input_ids=input_ids, sampling_params=sampling_params, routing_key=routing_key
                )
            finally:
                self.tracer.request_end(span, self._name, group=routing_key, output=out)
        finally:
            self.limiter.release()
            request_done()  # paces the collector's young passes by requests (`miles_aio._gc`)
        self.generated_tokens += len(out.output_ids)
        return out

    @property
    def _name(self) -> str:
        return "eval generate" if self.priority > 0 else "generate"

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """`generate`, with tokens handed to `on_chunk` as the engine produces them (`StreamingEngine`); the
        limiter slot is held for the whole stream. An engine that cannot stream generates, and its output
        is one chunk."""
        async with self.limiter.slot(self.priority):
            span, out = self.tracer.request_start(routing_key), None
            try:
                out = await generate_streamed(
                    self.inner,
                    input_ids=input_ids,
                    sampling_params=sampling_params,
                    on_chunk=on_chunk,
                    routing_key=routing_key,
                )
            finally:
                name = "eval generate" if self.priority > 0 else "generate"
                self.tracer.request_end(span, name, group=routing_key, output=out)
                request_done()
        self.generated_tokens += len(out.output_ids)
        return out

    async def pause_generation(self, mode: PauseMode) -> None:
        await self.inner.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.inner.continue_generation()

    async def flush_cache(self) -> None:
        await self.inner.flush_cache()

    async def update_weight_version(self, version: int) -> None:
        await self.inner.update_weight_version(version)

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None:
        await self.inner.update_weights_from_disk(model_path, version=version)

    def weight_broadcast(self) -> WeightBroadcast | None:
        return self.inner.weight_broadcast()

    async def aclose(self) -> None:
        await self.inner.aclose()


@final
class PromptIdCache:
    """The token ids of recent groups' prompts, so a group's n samples tokenize their prompt once (on
    the quickstart, tokenizing every sample's prompt was a seventh of the controller's time).

    Keyed by group index and checked against the prompt itself (an eval group may share an index);
    holds the last `size` groups."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._ids: OrderedDict[int, tuple[object, tuple[int, ...]]] = OrderedDict()

    def get(self, group_index: int, prompt: object) -> list[int] | None:
        hit = self._ids.get(group_index)
        return list(hit[1]) if hit is not None and hit[0] == prompt else None

    def put(self, group_index: int, prompt: object, ids: list[int]) -> None:
        self._ids[group_index] = (prompt, tuple(ids))
        if len(self._ids) > self._size:
            self._ids.popitem(last=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutContext:
    engine: InferenceEngine
    tokenizer: Tokenizer | None
    config: RunConfig
    log: structlog.typing.FilteringBoundLogger
    evaluation: bool = False
    sessions: SessionServer | None = None
    """The agent session endpoint (`miles_aio.rollout.agent`), with --custom-agent-function-path."""
    prompt_ids: PromptIdCache = field(default_factory=PromptIdCache)
    """`single_turn.prompt_token_ids`' memo (shared by `dataclasses.replace` copies, e.g. eval's)."""
