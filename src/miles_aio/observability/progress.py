"""A progress bar over training steps (reward, staleness, tokens/s), as a metrics sink.

On a terminal it draws a rich progress bar on stderr, and log lines print above it. Elsewhere (CI,
files, pipes) it draws nothing: the controller's per-step log line is the progress.
"""

from __future__ import annotations

import sys
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["ProgressSink"]


class ProgressSink:
    def __init__(self, total_steps: int, *, file: IO[str] | None = None, force: bool | None = None) -> None:
        stream = file if file is not None else sys.stderr
        self.enabled = stream.isatty() if force is None else force
        self._progress: Progress | None = None
        if not self.enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]step"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream, force_terminal=force),
            redirect_stderr=True,
        )
        self._task = self._progress.add_task("train", total=total_steps, info="waiting for the first batch")
        self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._progress is None:
            return
        info = (
            f"reward {metrics.get('rollout/reward', 0.0):.3f}  "
            f"staleness {metrics.get('rollout/fully_async/avg_staleness', 0.0):.2f}  "
            f"{metrics.get('perf/generated_tokens_per_s', 0.0):,.0f} tok/s"
        )
        self._progress.update(self._task, completed=step, info=info)  # `step` counts steps done

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
