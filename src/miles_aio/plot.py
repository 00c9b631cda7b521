"""Render PNGs from a run's metrics.jsonl: `python -m miles_aio.plot RUN_DIR [--out DIR]`.

Writes `reward.png` (reward and held-out accuracy when evaluated), `learning.png` (accuracy, reward
and staleness together), `staleness.png`, `bubbles.png` (trainer idle and rollout blocked ratios) and
`throughput.png` (tokens/s) next to the metrics. Eval points are drawn at the step they evaluated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "plot_run"]

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


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    out_dir = out_dir or run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, patterns in PANELS.items():
        series = {k: v for p in patterns for k, v in _series(rows, p).items()}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_xlabel("step")
        ax.set_title(f"{run_dir.name}: {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    learning = _learning_figure(rows, run_dir.name, out_dir / "learning.png")
    return [*written, learning] if learning is not None else written


def _smooth(ys: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _learning_figure(rows: list[dict[str, Any]], title: str, path: Path) -> Path | None:
    """Held-out accuracy and train reward (top), staleness of the consumed groups (bottom)."""
    import matplotlib.pyplot as plt

    acc = {k: v for p in ("eval/*/accuracy",) for k, v in _series(rows, p).items()}
    reward = _series(rows, "rollout/reward").get("rollout/reward")
    stale = _series(rows, "rollout/fully_async/avg_staleness").get("rollout/fully_async/avg_staleness")
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
        bottom.plot(stale[0], _smooth(stale[1]), color="tab:green", label="staleness of consumed groups")
        bottom.set_ylabel("versions")
        bottom.legend(fontsize=8)
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_aio.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="A run directory holding metrics.jsonl.")
    parser.add_argument("--out", type=Path, default=None, help="Where to write the PNGs (default: RUN_DIR).")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        parser.error(f"{args.run_dir}/metrics.jsonl does not exist")
    for path in plot_run(args.run_dir, args.out):
        sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
