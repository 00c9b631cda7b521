"""`WandbSink`: the step metrics to wandb (`--use-wandb`), a `MetricsSink`.

The run's files go under `<run-dir>/wandb`. Mode (`--wandb-mode auto`): `$WANDB_MODE` if set, else
online when an API key is configured (`$WANDB_API_KEY`, or `api.wandb.ai` in ~/.netrc), else offline —
so a run without credentials never waits on the network; `wandb sync <run-dir>/wandb/offline-run-*`
uploads it later. `wandb.init` and `finish` are synchronous: they run once, at the start and the end of
the run (a second or two), and `log` only hands the record to wandb's own service process.
"""

from __future__ import annotations

import dataclasses
import math
import netrc
import os
from pathlib import Path
from typing import Any

from miles_aio.config import RunConfig

__all__ = ["WandbSink", "wandb_mode"]


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    """The wandb mode for `--wandb-mode` (see the module docstring)."""
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if _has_api_key() else "offline"


def _config_dict(cfg: RunConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"run_dir": str(cfg.run_dir)}
    for f in dataclasses.fields(cfg):
        part = getattr(cfg, f.name)
        if dataclasses.is_dataclass(part) and not isinstance(part, type):
            for g in dataclasses.fields(part):
                v = getattr(part, g.name)
                out[g.name] = v if isinstance(v, int | float | str | bool | None) else str(v)
    return out


class WandbSink:
    """One wandb run; `log(step, metrics)` per step, `close()` finishes it."""

    def __init__(self, cfg: RunConfig) -> None:
        import wandb  # optional extra: imported only when --use-wandb

        o = cfg.observability
        directory: Path = cfg.run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.mode = wandb_mode(o.wandb_mode)
        self._run: Any = wandb.init(
            project=o.wandb_project or "miles_aio",
            group=o.wandb_group,
            name=o.wandb_run_name or cfg.run_dir.name,
            dir=str(directory),
            mode=self.mode,  # type: ignore[arg-type]
            config=_config_dict(cfg),
            settings=wandb.Settings(silent=True, x_disable_stats=True, disable_git=True, console="off"),
            reinit="create_new",
        )
        # eval/* is charted against the training step its weights came from (modes 2 and 3 land later)
        self._run.define_metric("eval/step")
        self._run.define_metric("eval/*", step_metric="eval/step")

    @property
    def run_dir(self) -> Path | None:
        """The wandb run's own directory (`<run-dir>/wandb/<mode>-run-<id>`)."""
        d = getattr(self._run, "dir", None)  # .../files
        return Path(d).parent if d else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: v for k, v in metrics.items() if math.isfinite(v)}
        self._run.log(clean, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            import wandb

            wandb.teardown()  # stop wandb's service process now, not when the controller exits
