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

import contextlib
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
    """A trainer that can write its current weights as an HF model directory, and delete one it wrote
    (`TrainerActor`: its rank 0 does both, so the controller's loop never blocks on model-sized I/O)."""

    async def export_hf(self, directory: Path) -> Path: ...

    async def remove_hf(self, directory: Path) -> None: ...


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

    async def discard(self, snapshot: Snapshot) -> None:
        """Delete a retired snapshot this source made (`exported`); others are never touched."""
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
            with contextlib.suppress(Exception):  # a half-written export is no snapshot
                await self._trainer.remove_hf(path)
            raise EvalSkip("export_failed") from e
        return Snapshot(path, exported=True, export_time_s=time.monotonic() - t0)

    async def discard(self, snapshot: Snapshot) -> None:
        if snapshot.exported:
            await self._trainer.remove_hf(snapshot.path)


class ReuseSource:
    """`--save-hf FORMAT`: the checkpoint the periodic save wrote (checked when the point runs)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt

    async def take(self, steps_done: int) -> Snapshot:
        return Snapshot(hf_checkpoint_path(self.fmt, steps_done), exported=False)

    async def discard(self, snapshot: Snapshot) -> None:
        """--save-hf checkpoints are the user's: never deleted here."""


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
    """Deletes exported snapshots of settled points beyond the newest `keep` (never `--save-hf` ones),
    through the source that made them (the trainer's rank 0 deletes what it exported)."""

    def __init__(self, keep: int, source: SnapshotSource) -> None:
        self.keep = keep
        self._source = source
        self._exported: deque[Snapshot] = deque()

    async def retire(self, snapshot: Snapshot | None) -> None:
        """Register a settled point's snapshot; delete the oldest beyond `keep`."""
        if snapshot is None or not snapshot.exported:
            return
        self._exported.append(snapshot)
        while len(self._exported) > self.keep:
            old = self._exported.popleft()
            await self._source.discard(old)
            log.debug("retired eval snapshot", path=str(old.path))
