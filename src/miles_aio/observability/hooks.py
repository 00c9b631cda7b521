"""miles' logging hooks: `--custom-rollout-log-function-path`, `--custom-eval-rollout-log-function-path`.

    def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool
        once per training step, after training: `rollout_id` the step's number (1 for the first step:
        the steps done once it is trained, as the metrics' `step`; miles' is 0-based), `samples` the
        trained batch's samples (flat list of `Sample`), `rollout_extra_metrics` a copy of the step's
        metrics (changes are not logged), `rollout_time` the seconds the step waited for data (its
        batch, plus the next batch's drain before a push; miles: the drain).
    def log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool
        once per eval point, at the first step record written after the point finished: `rollout_id`
        the point's `eval/step`, `data` = {dataset: {"metrics": {name: value}, "samples": [Sample],
        "rewards": [float | None], "truncated": [bool]}} ("samples", "rewards" and "truncated" when
        the evaluator generated the samples itself: modes 1 and 2; mode 3's external function keeps
        its own), `extra_metrics` every `eval/*` metric of the point. Not called for skipped points.
`args` is a flat namespace of every flag (`args.rollout_batch_size`, ...) plus `args.config` (the
`RunConfig`) and `args.run_dir`, so a miles hook reading `args.<flag>` keeps working. A hook may be a
plain or an `async def` function. Returning True skips the default logging of the step's rollout data
(as miles: its `rollout/*` metrics go to no sink but `metrics.jsonl`, the run's record; train/, perf/
and eval/ metrics are still logged) or of that eval point (its `eval/*` metrics likewise). A hook that
raises is logged with its traceback and counts as False: logging code never stops training.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import structlog

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError, PluginError
from miles_aio.import_paths import load_object
from miles_aio.metrics import reward_value
from miles_aio.types import Sample, Status

__all__ = ["LogHooks", "eval_hook_data", "flat_args", "resolve_log_hooks"]

log = structlog.get_logger("miles_aio.observability")

# eval/* metrics that are about the point, not one dataset
_POINT_KEYS = frozenset({"step", "version", "lag_steps", "push_wait_seconds", "duration_seconds"})


@dataclass(frozen=True, slots=True)
class LogHooks:
    rollout: Callable[..., Any] | None = None
    eval: Callable[..., Any] | None = None

    async def log_rollout(
        self,
        args: SimpleNamespace,
        step: int,
        samples: list[Sample],
        metrics: dict[str, float],
        seconds: float,
    ) -> bool:
        """Call the rollout hook (if any); True: skip the default logging of this step."""
        if self.rollout is None:
            return False
        return await _call(self.rollout, step, args, samples, dict(metrics), seconds)

    async def log_eval(
        self,
        args: SimpleNamespace,
        metrics: dict[str, float],
        samples: Mapping[str, Sequence[Sample]] | None = None,
    ) -> bool:
        """Call the eval hook (if any) for one finished point; True: skip its default logging."""
        if self.eval is None:
            return False
        rollout_id = int(metrics.get("eval/step", 0.0))
        return await _call(self.eval, rollout_id, args, eval_hook_data(metrics, samples), dict(metrics))


async def _call(fn: Callable[..., Any], *args: Any) -> bool:
    try:
        result = fn(*args)
        if inspect.isawaitable(result):
            result = await result
    except Exception:  # CancelledError is no Exception: it propagates
        log.exception("logging hook raised: default logging kept", hook=getattr(fn, "__qualname__", repr(fn)))
        return False
    return bool(result)


def resolve_log_hooks(cfg: RunConfig) -> LogHooks:
    """Import the configured hooks; a bad path is a ConfigError naming its flag."""

    def load(path: str | None, name: str) -> Callable[..., Any] | None:
        if path is None:
            return None
        try:
            fn = load_object(path)
        except PluginError as e:
            raise ConfigError(str(e), flags=[name]) from e
        if not callable(fn):
            raise ConfigError(f"{path!r} is not callable", flags=[name])
        return fn  # type: ignore[no-any-return]

    o = cfg.observability
    return LogHooks(
        rollout=load(o.custom_rollout_log_function_path, "--custom-rollout-log-function-path"),
        eval=load(o.custom_eval_rollout_log_function_path, "--custom-eval-rollout-log-function-path"),
    )


def flat_args(cfg: RunConfig) -> SimpleNamespace:
    """miles-style `args`: every component's fields as attributes, plus `config` and `run_dir`."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        part = getattr(cfg, f.name)
        if dataclasses.is_dataclass(part) and not isinstance(part, type):
            values.update({g.name: getattr(part, g.name) for g in dataclasses.fields(part)})
    return SimpleNamespace(**values, config=cfg, run_dir=cfg.run_dir)


def eval_hook_data(
    metrics: Mapping[str, float], samples: Mapping[str, Sequence[Sample]] | None = None
) -> dict[str, dict[str, Any]]:
    """`data` of the eval hook: per dataset its metrics, and rewards/truncated/samples when known."""
    data: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[1] not in _POINT_KEYS:
            data.setdefault(parts[1], {"metrics": {}})["metrics"][parts[2]] = value
    for name, ds in (samples or {}).items():
        entry = data.setdefault(name, {"metrics": {}})
        entry["samples"] = list(ds)
        entry["rewards"] = [reward_value(s.reward) for s in ds]
        entry["truncated"] = [s.status == Status.TRUNCATED for s in ds]
    return data
