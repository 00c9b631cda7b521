"""`ObservabilityConfig`: the timeline trace, wandb and miles' logging hooks (re-exported by
`miles_aio.config`, where the other components' configs live)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from miles_aio._fields import flag, opt
from miles_aio.errors import ConfigError

__all__ = ["ObservabilityConfig", "check_observability_installed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservabilityConfig:
    """Timeline trace, wandb and miles' logging hooks (`miles_aio.observability`)."""

    trace: str = opt(
        "trace.json",
        "Chrome/Perfetto timeline trace; a relative path is under --run-dir; '' writes no trace.",
        metavar="PATH",
    )
    trace_max_events: int = opt(
        500_000, "Events the trace keeps (held in memory until the end); later ones are counted, not kept."
    )
    use_wandb: bool = opt(False, "Also log metrics to wandb (offline unless an API key is configured).")
    wandb_project: str | None = opt(None, "wandb project.", shown_default="miles_aio")
    wandb_group: str | None = opt(None, "wandb group of the run.")
    wandb_run_name: str | None = opt(None, "wandb run name.", shown_default="the --run-dir name")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = opt(
        "auto", "wandb mode; auto: $WANDB_MODE, else online with an API key, else offline."
    )
    custom_rollout_log_function_path: str | None = opt(
        None,
        "`log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`, "
        "called once per step; True: it logged the step's rollout data, so the default logging of the "
        "rollout/* metrics is skipped.",
        metavar="PKG.MOD:ATTR",
    )
    custom_eval_rollout_log_function_path: str | None = opt(
        None,
        "`log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool`, called once per eval "
        "point; True skips the default logging of that point.",
        metavar="PKG.MOD:ATTR",
    )

    def __post_init__(self) -> None:
        if self.trace_max_events < 0:
            raise ConfigError(f"must be >= 0, got {self.trace_max_events}", flags=["--trace-max-events"])
        named = [n for n in ("wandb_project", "wandb_group", "wandb_run_name") if getattr(self, n)]
        if named and not self.use_wandb:
            raise ConfigError("needs --use-wandb", flags=[*map(flag, named), "--use-wandb"])


def check_observability_installed(cfg: ObservabilityConfig) -> None:
    """What the flags ask for is installed here (`miles_aio.config.resolve` calls it once, in the
    controller process: it looks at the environment, which `__post_init__` never does)."""
    if cfg.use_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb is not installed (pip install 'miles_aio[wandb]')", flags=["--use-wandb"])
