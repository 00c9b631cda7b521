"""HF weight snapshots for eval modes 2 and 3: where each point's weights come from, and their retirement.

Two sources (`snapshot_source`):
  export  `--eval-hf-dir DIR`: a fresh `trainer.export_hf(DIR/step_<n>)` per point. The export is the
          only blocking part of a point (a collective across the trainer ranks); it is timed as
          `eval/export_time_seconds`, and a failure skips the point (`eval/skipped_export_failed`).
  reuse   `--save-hf FORMAT` (without `--eval-hf-dir`): the HF checkpoint that the periodic save wrote to
          `FORMAT.format(step=n)`; free, and never deleted here. Missing → `eval/skipped_ckpt_missing`.

`SnapshotRetirer` keeps the `--eval-keep-snapshots` newest *exported* directories of settled points and
deletes older ones (miles' `EvalDispatcher._retire`); `--save-hf` checkpoints are never registered.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import structlog

from miles_aio.config import RunConfig
from miles_aio.errors import ConfigError

__all__ = [
    "EvalSkip",
    "ExportSource",
    "HFExporter",
    "ReuseSource",
    "Snapshot",
    "SnapshotRetirer",
    "SnapshotSource",
    "hf_checkpoint_path",
    "save_hf_checkpoint",
    "snapshot_source",
]

log = structlog.get_logger("miles_aio.eval")


class EvalSkip(Exception):
    """Raise from an eval to skip its point; logged as `eval/skipped_<reason>` (training continues)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = "".join(c if c.isalnum() else "_" for c in reason.strip().lower()) or "unknown"


@runtime_checkable
class HFExporter(Protocol):
    """A trainer that can write its current weights as an HF model directory (`TrainerActor`)."""

    async def export_hf(self, directory: Path) -> Path: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One point's weights on disk. `exported` ones belong to eval and are retired; others never are."""

    path: Path
    exported: bool
    export_time_s: float = 0.0


class SnapshotSource(Protocol):
    async def take(self, steps_done: int) -> Snapshot:
        """The snapshot of the weights after `steps_done` steps; raises `EvalSkip` when there is none."""
        ...


def hf_checkpoint_path(fmt: str, steps_done: int) -> Path:
    """Where `--save-hf FORMAT` puts the weights trained for `steps_done` steps."""
    return Path(fmt.format(step=steps_done)).absolute()


def _exporter(trainer: object, flag: str) -> HFExporter:
    if not isinstance(trainer, HFExporter):
        raise ConfigError(
            f"the trainer ({type(trainer).__name__}) cannot export HF checkpoints", flags=[flag]
        )
    return trainer


async def save_hf_checkpoint(trainer: object, fmt: str, steps_done: int) -> Path:
    """The periodic save's HF export (`--save-hf`); consumes the trainer's current weights."""
    path = hf_checkpoint_path(fmt, steps_done)
    await _exporter(trainer, "--save-hf").export_hf(path)
    log.info("saved HF checkpoint", step=steps_done, path=str(path))
    return path


class ExportSource:
    """`--eval-hf-dir`: export the trainer's current weights to `root/step_<n>` (blocks the caller)."""

    def __init__(self, trainer: HFExporter, root: Path) -> None:
        self._trainer = trainer
        self.root = root

    async def take(self, steps_done: int) -> Snapshot:
        path = self.root / f"step_{steps_done}"
        t0 = time.monotonic()
        try:
            await self._trainer.export_hf(path)
        except Exception as e:  # CancelledError is not an Exception: it propagates
            log.error("eval snapshot export failed", step=steps_done, path=str(path), error=repr(e))
            await asyncio.to_thread(shutil.rmtree, path, True)  # a half-written export is no snapshot
            raise EvalSkip("export_failed") from e
        return Snapshot(path, exported=True, export_time_s=time.monotonic() - t0)


class ReuseSource:
    """`--save-hf FORMAT`: the checkpoint the periodic save wrote (checked when the point runs)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    async def take(self, steps_done: int) -> Snapshot:
        return Snapshot(hf_checkpoint_path(self.fmt, steps_done), exported=False)


def snapshot_source(cfg: RunConfig, trainer: object) -> SnapshotSource:
    """Export when --eval-hf-dir is given (miles' precedence), else reuse --save-hf checkpoints."""
    ev = cfg.eval
    if ev.eval_hf_dir is not None:
        return ExportSource(_exporter(trainer, "--eval-hf-dir"), ev.eval_hf_dir.absolute())
    if ev.save_hf is None:
        raise ConfigError("eval modes 2 and 3 need a snapshot source", flags=["--eval-hf-dir", "--save-hf"])
    return ReuseSource(ev.save_hf)


def snapshot_root(cfg: RunConfig) -> Path:
    """A directory every snapshot lies under (an eval engine's `--weights-root`); created if missing."""
    ev = cfg.eval
    if ev.eval_hf_dir is not None:
        root = ev.eval_hf_dir
    else:
        assert ev.save_hf is not None
        prefix = ev.save_hf.split("{", 1)[0]
        root = Path(prefix) if prefix.endswith("/") or not prefix else Path(prefix).parent
    root = root.absolute()
    root.mkdir(parents=True, exist_ok=True)
    return root


class SnapshotRetirer:
    """Deletes exported snapshots of settled points beyond the newest `keep` (never `--save-hf` ones)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._exported: deque[Path] = deque()

    async def retire(self, snapshot: Snapshot | None) -> None:
        """Register a settled point's snapshot; `rmtree` (in a thread) the oldest beyond `keep`."""
        if snapshot is None or not snapshot.exported:
            return
        self._exported.append(snapshot.path)
        while len(self._exported) > self.keep:
            old = self._exported.popleft()
            await asyncio.to_thread(shutil.rmtree, old, True)
            log.debug("retired eval snapshot", path=str(old))
