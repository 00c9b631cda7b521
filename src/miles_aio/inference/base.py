"""The controller's view of an inference engine (one server, or a router over several).

Implementations: the SGLang HTTP client (`miles_aio.inference.client`), and for scheduler tests the
`FakeLatencyEngine` in `miles_aio.testing`. All speak in policy versions as ints; on the wire SGLang
carries them as strings.

Streaming is an optional extra (`StreamingEngine.generate_stream`: the SGLang client, the router, the
rollout's `LimitedEngine`); `generate_streamed` calls it where an engine has it and falls back to one
`generate` (a single chunk) where it does not, so every fake engine keeps working unchanged.

Weights by broadcast: `InferenceEngine.weight_broadcast()` gives the `WeightBroadcast` side of a handle
(the servers a push reaches, as one torch.distributed weight-update group with trainer rank 0: SGLang's
`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`), or
None for a handle that loads weights from disk only. `EngineRouter` is its own (its push's members); a
handle on one server (`SGLangClient`, a fake) wraps itself in `SingleServerBroadcast`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

from miles_aio.types import GenerateOutput

__all__ = [
    "ChunkSink",
    "GenerateChunk",
    "InferenceEngine",
    "PauseMode",
    "SingleServerBroadcast",
    "StreamingEngine",
    "WeightBroadcast",
    "WeightGroupMember",
    "WeightGroupServer",
    "generate_streamed",
]

PauseMode = Literal["retract", "in_place", "abort"]


@runtime_checkable
class InferenceEngine(Protocol):
    """Async handle on one or more engine servers. Methods apply to every server behind the handle."""

    async def generate(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """One `/generate` call with `return_logprob`. Raises `EngineError` when retries are exhausted."""
        ...

    async def pause_generation(self, mode: PauseMode) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def update_weight_version(self, version: int) -> None:
        """Stamp `version` on every server (never aborting in-flight requests)."""
        ...

    async def update_weights_from_disk(self, model_path: str, *, version: int) -> None: ...

    def weight_broadcast(self) -> WeightBroadcast | None:
        """The servers that take weights by broadcast (`--update-weight-transfer-mode broadcast`), or None:
        this handle loads weights from disk only."""
        ...

    async def aclose(self) -> None: ...


# ---- streaming generate ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """Tokens a streaming generation produced since its previous chunk (lists of the same length)."""

    output_ids: list[int]
    output_log_probs: list[float]
    weight_versions: list[int | None]


ChunkSink: TypeAlias = Callable[[GenerateChunk], Awaitable[None]]
"""Awaited with each chunk, in order, as the engine produces it; the next one is read once it returns
(backpressure). An exception it raises ends the generation (the engine aborts the request) and comes out
of `generate_stream` as itself."""


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that can also hand out tokens while it generates (SGLang's `/generate` with `stream`)."""

    async def generate_stream(
        self,
        *,
        input_ids: list[int],
        sampling_params: Mapping[str, Any],
        on_chunk: ChunkSink,
        routing_key: Hashable | None = None,
    ) -> GenerateOutput:
        """`generate`, with `on_chunk` awaited for every piece of new tokens as it is produced. Returns the
        whole generation, the same `GenerateOutput` `generate` would return (the chunks' lists joined are
        its lists). Retried like `generate` until the first chunk is delivered; a failure after that raises
        `EngineUnavailable` (what the consumer was given cannot be taken back). Partial-rollout
        continuation goes on streaming."""
        ...


class _Generates(Protocol):
    async def generate(
        self, *, input_ids: list[int], sampling_params: Mapping[str, Any], routing_key: Hashable | None = None
    ) -> GenerateOutput: ...


async def generate_streamed(
    engine: _Generates,
    *,
    input_ids: list[int],
    sampling_params: Mapping[str, Any],
    on_chunk: ChunkSink,
    routing_key: Hashable | None = None,
) -> GenerateOutput:
    """`engine.generate_stream(...)` if it has one (`StreamingEngine`); else one `generate`, whose output
    is then the only chunk."""
    stream = getattr(engine, "generate_stream", None)
    if stream is not None:
        out: GenerateOutput = await stream(
            input_ids=input_ids, sampling_params=sampling_params, on_chunk=on_chunk, routing_key=routing_key
        )
        return out
    out = await engine.generate(input_ids=input_ids, sampling_params=sampling_params, routing_key=routing_key)
    if out.output_ids:
        await on_chunk(
            GenerateChunk(list(out.output_ids), list(out.output_log_probs), list(out.weight_versions))
        )
    return out


# ---- weights by broadcast -------------------------------------------------------------------------------


class WeightGroupMember(Protocol):
    """One server of a weight-update group, as the trainer sizes the group: its TP size (the ranks it
    takes) is `server_info()["tp_size"]` (1 if absent)."""

    async def server_info(self) -> dict[str, Any]: ...


class WeightBroadcast(Protocol):
    """The servers of an engine handle that take a weight push by broadcast from trainer rank 0, as one
    weight-update group of 1 + Σ TP sizes ranks (rank 0: the trainer; `push_clients()[i]` from
    `rank_offsets[i]` on). A group formed for another `membership_key()` is stale: a new one is formed."""

    def push_clients(self) -> Sequence[WeightGroupMember]:
        """The servers a weight transfer goes to now, in group-rank order."""
        ...

    def membership_key(self) -> tuple[Hashable, ...]:
        """One entry per `push_clients()` member, in the same order, naming that server's incarnation; it
        changes whenever a server leaves or joins the push (or restarts)."""
        ...

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        clients: Sequence[WeightGroupMember] | None = None,
    ) -> None:
        """The servers of `clients` (default: `push_clients()`) join the group; `rank_offsets[i]` is the
        first rank of `clients[i]`."""
        ...

    async def destroy_weights_update_group(
        self, group_name: str, *, clients: Sequence[WeightGroupMember] | None = None
    ) -> None:
        """The servers of `clients` (default: `push_clients()`) leave group `group_name`."""
        ...

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        last_bucket: bool = True,
    ) -> None:
        """The members receive these tensors, broadcast by trainer rank 0 in `names` order. A push of
        several buckets passes `last_bucket=False` for all but its last: SGLang applies each bucket on
        its own, vLLM applies the whole push as one update and finishes it on the last."""
        ...


class WeightGroupServer(WeightGroupMember, Protocol):
    """One server's own weight-update-group calls (`SGLangClient`, the fakes): SGLang's endpoints."""

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        last_bucket: bool = True,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class SingleServerBroadcast:
    """The `WeightBroadcast` of a handle on one server: that server is the whole push, always the same."""

    server: WeightGroupServer

    def push_clients(self) -> tuple[WeightGroupServer]:
        return (self.server,)

    def membership_key(self) -> tuple[Hashable, ...]:
        return (0,)

    def _named(self, clients: Sequence[WeightGroupMember] | None) -> bool:
        return clients is None or any(c is self.server for c in clients)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offsets: Sequence[int],
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        clients: Sequence[WeightGroupMember] | None = None,
    ) -> None:
        if not self._named(clients):
            return
        if len(rank_offsets) != 1:
            raise ValueError(f"{len(rank_offsets)} rank_offsets for one server")
        await self.server.init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offsets[0],
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    async def destroy_weights_update_group(
        self, group_name: str, *, clients: Sequence[WeightGroupMember] | None = None
    ) -> None:
        if self._named(clients):
            await self.server.destroy_weights_update_group(group_name)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
        last_bucket: bool = True,
    ) -> None:
        await self.server.update_weights_from_distributed(
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            version=version,
            group_name=group_name,
            last_bucket=last_bucket,
        )
