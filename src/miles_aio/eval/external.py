"""Mode 3: an external eval backend, `--eval-function-path pkg.mod:Class` (a `CheckpointEvalFn` subclass).

    class MyEval(CheckpointEvalFn):
        async def evaluate_checkpoint(self, checkpoint_dir, input):  # -> dict[str, float]
            if not await my_cluster_is_up():
                raise EvalSkip("cluster_down")          # logged as eval/skipped_cluster_down
            return {"mmlu/accuracy": await run_mmlu(checkpoint_dir)}   # logged as eval/mmlu/accuracy

The class is constructed once, with the run config, before the first point. Each point hands it an HF
model directory of the weights after `input.step` training steps, stamped `input.version`. Raising
`EvalSkip(reason)` skips the point (`eval/skipped_<reason>`); any other exception is logged with its
traceback as `eval/skipped_crashed`, and training continues either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_aio.config import RunConfig
from miles_aio.data.source import PromptRecord
from miles_aio.errors import ConfigError, PluginError
from miles_aio.eval.snapshots import EvalSkip
from miles_aio.import_paths import load_object

__all__ = ["CheckpointEvalFn", "CheckpointEvalInput", "EvalSkip", "ExternalEval", "load_eval_fn"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointEvalInput:
    """What one eval point is about: the weights after `step` steps, pushed as policy `version`."""

    step: int
    version: int
    datasets: Mapping[str, Sequence[PromptRecord]] = field(default_factory=dict)
    """The run's eval datasets (--eval-prompt-data or the recipe's), possibly empty."""
    config: RunConfig | None = None


class CheckpointEvalFn(ABC):
    """Evaluate one HF checkpoint directory; see the module docstring."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @abstractmethod
    async def evaluate_checkpoint(self, checkpoint_dir: Path, input: CheckpointEvalInput) -> dict[str, float]:
        """Metrics of the checkpoint; keys without an `eval/` prefix get one. Raise `EvalSkip` to skip."""


def load_eval_fn(cfg: RunConfig) -> CheckpointEvalFn:
    """Import and construct --eval-function-path; a bad path is a ConfigError naming the flag."""
    return eval_fn_class(cfg)(cfg)


def eval_fn_class(cfg: RunConfig) -> type[CheckpointEvalFn]:
    """Import --eval-function-path and check it is a CheckpointEvalFn subclass (nothing constructed)."""
    path = cfg.eval.eval_function_path
    if path is None:
        raise ConfigError("no external eval function", flags=["--eval-function-path"])
    try:
        cls = load_object(path)
    except PluginError as e:
        raise ConfigError(str(e), flags=["--eval-function-path"]) from e
    if not (isinstance(cls, type) and issubclass(cls, CheckpointEvalFn)):
        raise ConfigError(f"{path!r} is not a CheckpointEvalFn subclass", flags=["--eval-function-path"])
    return cls


class ExternalEval:
    """The mode-3 evaluator of `SnapshotEvalDispatcher`: hands each snapshot to the user's function."""

    def __init__(
        self, fn: CheckpointEvalFn, *, config: RunConfig, datasets: Mapping[str, Sequence[PromptRecord]]
    ) -> None:
        self.fn = fn
        self._config = config
        self._datasets = {name: list(records) for name, records in datasets.items()}

    async def evaluate_snapshot(self, snapshot: Path, *, step: int, version: int) -> dict[str, float]:
        """Consumes: the snapshot directory. Produces: the function's metrics under `eval/`."""
        out = await self.fn.evaluate_checkpoint(
            snapshot,
            CheckpointEvalInput(step=step, version=version, datasets=self._datasets, config=self._config),
        )
        if not isinstance(out, Mapping):
            raise TypeError(f"evaluate_checkpoint returned {type(out).__name__}, not a dict of metrics")
        return {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in out.items()}
