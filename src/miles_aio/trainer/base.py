"""The controller's view of the trainer: the awaitables the step loop drives (train, sync, save/load, close).

The real implementation is an actor over torch.distributed rank processes; scheduler tests use
`miles_aio.testing.FakeTrainer`. The controller owns the engine side of a weight push (pause, flush,
stamp the version, continue); `stage_weights` readies the tensors while the engines generate, and
`sync_weights` moves them into the (paused) engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from miles_aio.inference.base import InferenceEngine
from miles_aio.types import Group

__all__ = ["Trainer"]


@runtime_checkable
class Trainer(Protocol):
    async def train(self, step: int, batch: list[Group]) -> dict[str, float]:
        """One training step on `batch` (rollout_batch_size groups, sorted by sample index)."""
        ...

    async def stage_weights(self, *, version: int) -> bool:
        """Make the current weights ready for `version`'s push while the engines still generate (disk
        transfers: rank 0 writes them). True when `sync_weights(version=version)` then needs nothing of
        the trainer, so the rest of the push may run while the trainer trains the next step."""
        ...

    async def sync_weights(self, engine: InferenceEngine, *, version: int) -> None:
        """Copy the current weights (or those staged for `version`) into every engine (they are paused
        by the caller)."""
        ...

    async def save(self, step: int, directory: Path) -> None:
        """Write model/optimizer/RNG state for `step` under `directory`."""
        ...

    async def load(self, directory: Path) -> int | None:
        """Restore what `save` wrote (returns the saved step where the trainer knows it)."""
        ...

    async def aclose(self) -> None: ...
