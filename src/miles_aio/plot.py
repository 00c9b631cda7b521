"""Render PNGs from a run's metrics.jsonl: `python -m miles_aio.plot RUN_DIR [--out DIR]`.

Writes `reward.png` (reward and held-out accuracy when evaluated), `learning.png` (accuracy, reward
and staleness together), `staleness.png`, `bubbles.png` (trainer idle and rollout blocked ratios) and
`throughput.png` (tokens/s) next to the metrics. The x axis is steps done (the metrics' `step`); eval
points are drawn at the step whose weights they evaluated (`eval/step`: 0 before training).

Staleness has two measures: consume staleness (`rollout/fully_async/*`, at drain time, the one the
`--max-*-staleness` bounds are stated in) and train staleness (`rollout/train_staleness_*`, against the
policy that trains on the batch: one push more under the prefetch). A run whose records hold no consume
staleness (a custom buffer that reports none, from a run before the runtime measured it) still gets
`staleness.png`, with a note saying so, and `learning.png` shows train staleness instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "plot_run", "staleness_note"]

CONSUME_STALENESS = ("rollout/fully_async/avg_staleness", "rollout/fully_async/max_staleness")

PANELS: dict[str, list[str]] = {
    "reward": ["rollout/reward", "eval/*/accuracy"],
    "staleness": [
        "rollout/fully_async/avg_staleness",
        "rollout/fully_async/max_staleness",
        "rollout/train_staleness_mean",
    ],
    "bubbles": ["perf/trainer_idle_ratio", "perf/rollout_blocked_ratio"],
    "throughput": ["perf/generated_tokens_per_s", "perf/trained_tokens_per_s"],
}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _series(rows: list[dict[str, Any]], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    keys = sorted({k for r in rows for k in r})
    if "*" in pattern:
        head, tail = pattern.split("*")
        keys = [k for k in keys if k.startswith(head) and k.endswith(tail)]
    else:
        keys = [pattern] if pattern in keys else []
    out: dict[str, tuple[list[int], list[float]]] = {}
    for k in keys:
        # eval points are logged when they finish; plot them at the step whose weights they evaluated
        x_key = "eval/step" if k.startswith("eval/") else "step"
        pts = [(int(r.get(x_key, r["step"])), float(r[k])) for r in rows if r.get(k) is not None]
        if pts:
            out[k] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def staleness_note(rows: list[dict[str, Any]], buffer: str | None = None) -> str | None:
    """What a staleness plot says when the records hold no consume staleness (None when they do);
    `buffer`: the run's --custom-async-data-buffer-path, named in the note."""
    if any(r.get(k) is not None for r in rows for k in CONSUME_STALENESS):
        return None
    who = f"custom buffer {buffer}" if buffer else "the run's buffer"
    note = f"no consume staleness metrics (rollout/fully_async/*): {who} reports none"
    if any(r.get("rollout/train_staleness_mean") is not None for r in rows):
        note += "; train staleness shown"
    return note


def plot_run(run_dir: Path, out_dir: Path | None = None, *, buffer: str | None = None) -> list[Path]:
    """Write the PNGs (see the module docstring); `buffer` names a custom buffer in the staleness note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    out_dir = out_dir or run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    note = staleness_note(rows, buffer)
    written = []
    for name, patterns in PANELS.items():
        series = {k: v for p in patterns for k, v in _series(rows, p).items()}
        if not series and not (name == "staleness" and note and rows):
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_xlabel("steps done")
        ax.set_title(f"{run_dir.name}: {name}")
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
        if name == "staleness" and note:
            _note(ax, note)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    learning = _learning_figure(rows, run_dir.name, out_dir / "learning.png", note=note)
    return [*written, learning] if learning is not None else written


def _note(ax: Any, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=8,
        wrap=True,
        color="dimgray",
        bbox={"facecolor": "white", "edgecolor": "lightgray", "alpha": 0.9},
    )


def _smooth(ys: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _learning_figure(
    rows: list[dict[str, Any]], title: str, path: Path, *, note: str | None = None
) -> Path | None:
    """Held-out accuracy and train reward (top), staleness of the consumed groups (bottom; train
    staleness, with `note`, when the records hold no consume staleness)."""
    import matplotlib.pyplot as plt

    acc = {k: v for p in ("eval/*/accuracy",) for k, v in _series(rows, p).items()}
    reward = _series(rows, "rollout/reward").get("rollout/reward")
    stale = _series(rows, "rollout/fully_async/avg_staleness").get("rollout/fully_async/avg_staleness")
    stale_label = "consume staleness (at drain)"
    if stale is None:
        stale = _series(rows, "rollout/train_staleness_mean").get("rollout/train_staleness_mean")
        stale_label = "train staleness"
    if not acc and reward is None:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(2, 1))
    for label, (xs, ys) in acc.items():
        top.plot(xs, ys, marker="o", markersize=3, label=label.replace("eval/", "eval ").replace("/", " "))
    if reward is not None:
        top.plot(reward[0], _smooth(reward[1]), label="train reward (10-step mean)")
    top.set_ylim(0, 1)
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(fontsize=8)
    if stale is not None:
        bottom.plot(stale[0], _smooth(stale[1]), color="tab:green", label=f"{stale_label} (10-step mean)")
        bottom.set_ylabel("versions")
        bottom.legend(fontsize=8)
    if note:
        _note(bottom, note)
    bottom.set_xlabel("steps done")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_aio.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="A run directory holding metrics.jsonl.")
    parser.add_argument("--out", type=Path, default=None, help="Where to write the PNGs (default: RUN_DIR).")
    parser.add_argument(
        "--buffer",
        default=None,
        metavar="PKG.MOD:CLASS",
        help="The run's --custom-async-data-buffer-path, named when its records hold no consume staleness.",
    )
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        parser.error(f"{args.run_dir}/metrics.jsonl does not exist")
    for path in plot_run(args.run_dir, args.out, buffer=args.buffer):
        sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
