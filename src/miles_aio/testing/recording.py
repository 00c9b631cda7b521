"""`RecordingEngine`: a FAKE at the engine seam (a test and benchmark seam, not an engine): it forwards every
call to a real engine and records what each generate consumed and produced, so a test can compare a
sample's tokens with the engine's own, call by call (the agent-session tests), or a benchmark can replay
the token ids a session built (`benchmarks.agent_sessions`).

    engine = RecordingEngine(client)           # any InferenceEngine (a StreamingEngine streams through)
    ...                                        # a rollout / session server on a context over `engine`
    engine.calls                               # [RecordedCall(input_ids, params, routing_key, out, ...)]
    engine.by_routing_key()                    # {routing key (a session id): its calls, in order}

`on_stream_chunk`, if set, is awaited after every chunk a `generate_stream` forwarded (a test holds a
stream there, mid-generation, to prove a consumer got tokens before the engine finished).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from miles_aio.inference.base import (
    ChunkSink,
    GenerateChunk,
    InferenceEngine,
    PauseMode,
    WeightBroadcast,
    generate_streamed,
)
from miles_aio.types import GenerateOutput

__all__ = ["RecordedCall", "RecordingEngine"]


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """One finished generate call, as it crossed the seam."""

    input_ids: list[int]
    params: dict[str, Any]
    routing_key: Hashable | None
    out: GenerateOutput
    chunks: list[GenerateChunk] | None = None
    """A streamed call's chunks, in order (None: a plain `generate`)."""


class RecordingEngine:
    """A fake engine wrapper (see the module docstring); implements InferenceEngine and StreamingEngine."""

    def __init__(
        self,
        inner: InferenceEngine,
        *,
        on_stream_chunk: Callable[[GenerateChunk], Awaitable[None]] | None = None,
    ) -> None:
        self.inner = inner
        self.on_stream_chunk = on_stream_chunk
        self.calls: list[RecordedCall] = []
        """Finished calls, in the order they finished (a failed call is not recorded)."""
        self.call_started = asyncio.Event()
        """Set whenever a call starts (a test clears it, then waits for its own call)."""

    def by_routing_key(self) -> dict[Hashable | None, list[RecordedCall]]:
        out: dict[Hashable | None, list[RecordedCall]] = {}
        for c in self.calls:
            out.setdefault(c.routing_key, []).append(c)
        return out

    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput:
        self.call_started.set()
        ids = list(input_ids)
        params, key = sampling_params, routing_key
        out = await self.inner.generate(input_ids=ids, sampling_params=params, routing_key=key)
        self.calls.append(RecordedCall(ids, dict(sampling_params), routing_key, out))
        return out

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        self.call_started.set()
        ids, chunks = list(input_ids), list[GenerateChunk]()

        async def forward(chunk: GenerateChunk) -> None:
            chunks.append(chunk)
            await on_chunk(chunk)
            if self.on_stream_chunk is not None:
                await self.on_stream_chunk(chunk)

        out = await generate_streamed(
            self.inner,
            input_ids=ids,
            sampling_params=sampling_params,
            on_chunk=forward,
            routing_key=routing_key,
        )
        self.calls.append(RecordedCall(ids, dict(sampling_params), routing_key, out, chunks))
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
