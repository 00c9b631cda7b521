"""The controller's view of an inference engine (one server, or a router over several).

Implementations: the SGLang HTTP client (`miles_aio.inference.client`), and for scheduler tests the
`FakeLatencyEngine` in `miles_aio.testing`. All speak in policy versions as ints; on the wire SGLang
carries them as strings.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

from miles_aio.types import GenerateOutput

__all__ = ["InferenceEngine", "PauseMode"]

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

    async def aclose(self) -> None: ...
