"""Does a recipe learn, how fast, how robustly, and what does the runtime cost? One run answers all four.

    python -m benchmarks.learning                                  # quickstart: 3 seeds × 4 arms + baseline
    python -m benchmarks.learning --seeds 0 --arms async,bare      # one seed, quicker
    python -m benchmarks.learning --recipe tool_use --arms async
    python -m benchmarks.learning --output OUT --merge RUN_A RUN_B    # one table and figure from two runs

Arms (each a real `python -m recipes.<recipe>` run with its defaults, plus):
  async       nothing: the recipe as a user runs it (fully async, bounded staleness, TIS)
  on_policy   --max-admission-staleness 0: a group is only admitted if it trains on the weights it was
              sampled with (rollout waits for training)
  lr=X        --lr X (the robustness check: the recipe must not collapse at higher learning rates)
  bare        `benchmarks.bare_grpo` on the same warm-started model, same steps, batch, optimizer and
              schedule: one process, no runtime, all cores (quickstart only; the bar for throughput)
Every arm of a seed starts from the same warm-started model (the recipe's `--warm-start-seed`).

Prints, and writes to OUTPUT/learning.md and learning.json: held-out accuracy at fixed steps and at the
end (mean, min–max over seeds), RL seconds, completions per second, and the quickstart's completions/s
as a fraction of the bare loop's; OUTPUT/learning.png draws the async, on-policy and bare curves against
steps and against seconds of RL. RL seconds are the sum of the steps' wall times (`perf/step_time_s`;
startup, warm start and the last eval excluded) and the bare loop's sampling + update time (its evals
excluded), so the two are the same measure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The bare loop runs in this process, alone on the machine, one OpenMP thread per core. OpenMP's default
# wait policy (threads spin a little between parallel regions, then sleep) is its fastest; the PASSIVE
# one every process of a run gets from `import miles_aio` (miles_aio/__init__.py: there, several
# processes share the cores) made it 1.4x slower (150 steps, one 2-core AMD EPYC VM, session 21: 1,481
# against 2,073 completions/s), which flattered the runtime's ratio; ACTIVE (spin for ever) was as fast
# but kept a core busy after the loop, under the next seed's recipe run. OpenMP reads the policy when
# torch loads, so torch is imported here, before anything imports miles_aio. A policy the user set holds.
import torch  # noqa: F401

DEFAULT_ARMS = "async,on_policy,lr=2e-4,lr=3e-4,bare"
MARK_STEPS = (50, 100, 200, 300, 500, 700, 1000, 1300)
TARGET_ACCURACY = 0.9
"""The summary says when each run first reached this (issue [5/8]: 90% within 5 minutes of RL)."""
NONZERO_STD_FILTER = "miles_aio.rollout.filters:reward_nonzero_std"
"""A recipe with this --dynamic-sampling-filter-path gets a bare loop that filters the same way."""


@dataclass
class Result:
    arm: str
    seed: int
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, rl seconds, accuracy)
    completions_per_s: float = float("nan")
    rl_seconds: float = float("nan")
    wall_seconds: float = float("nan")
    error: str | None = None

    def at(self, step: int) -> float | None:
        """Accuracy of the last eval point at or before `step` (None past the end of the run)."""
        if not self.curve or step > self.curve[-1][0]:
            return None
        return max((p for p in self.curve if p[0] <= step), key=lambda p: p[0])[2]

    @property
    def final(self) -> float:
        return self.curve[-1][2] if self.curve else float("nan")

    def first_reached(self, accuracy: float) -> tuple[int, float] | None:
        """(step, seconds of RL) of the first eval point at or above `accuracy`; None if none is."""
        return next(((step, sec) for step, sec, acc in self.curve if acc >= accuracy), None)


def arm_flags(arm: str) -> list[str]:
    if arm == "async":
        return []
    if arm == "on_policy":
        return ["--max-admission-staleness", "0"]
    if arm.startswith("lr="):
        return ["--lr", arm.removeprefix("lr=")]
    raise SystemExit(f"benchmarks.learning: unknown arm {arm!r} (async, on_policy, lr=X, bare)")


def read_run(run_dir: Path, arm: str, seed: int) -> Result:
    """The eval curve (against steps and cumulative step seconds) and throughput of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds_at: dict[int, float] = {0: 0.0}
    total, samples = 0.0, 0.0
    for r in rows:
        total += float(r.get("perf/step_time_s") or 0.0)
        samples += float(r.get("rollout/samples") or 0.0)
        seconds_at[int(r["step"])] = total
    points = [json.loads(line) for line in (run_dir / "eval_points.jsonl").read_text().splitlines() if line]
    curve = []
    for p in points:
        acc = next((v for k, v in p.items() if k.startswith("eval/") and k.endswith("/accuracy")), None)
        if acc is None:
            continue
        step = int(p.get("eval/step", p.get("step", 0)))
        seconds = max((s for k, s in seconds_at.items() if k <= step), default=0.0)
        curve.append((step, seconds, float(acc)))
    curve.sort()
    return Result(arm, seed, curve, completions_per_s=samples / max(total, 1e-9), rl_seconds=total)


def run_recipe(recipe: str, arm: str, seed: int, out: Path, extra: list[str]) -> Result:
    run_dir = out / f"{arm}-seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", f"recipes.{recipe}", "--run-dir", str(run_dir),
        "--seed", str(seed), "--rollout-seed", str(seed), "--warm-start-seed", str(seed),
        *arm_flags(arm), *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    with (out / f"{arm}-seed{seed}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        return Result(arm, seed, error=f"exit {rc}: see {out / f'{arm}-seed{seed}.log'}", wall_seconds=wall)
    result = read_run(run_dir, arm, seed)
    result.wall_seconds = wall
    return result


def run_bare(recipe: str, seed: int, out: Path, model_from: Path, extra: list[str] | None = None) -> Result:
    """The bare loop on the warm-started model of this seed's first recipe run, with the recipe's
    steps, batch, lr and schedule (read from its RECIPE's defaults), as the runs' extra flags change them
    (`_bare_overrides`; the others have no bare-loop meaning)."""
    from benchmarks import bare_grpo

    defaults: dict[str, Any] = dict(importlib.import_module(f"recipes.{recipe}").RECIPE.defaults)
    defaults |= _bare_overrides(extra or [])
    model_dir = model_from / "model"
    if not (model_dir / "model.safetensors").is_file():
        return Result("bare", seed, error=f"no warm-started model in {model_from} (run an arm first)")
    steps = int(defaults["num_rollout"])
    decay = defaults.get("lr_decay_style", "constant")
    t0 = time.monotonic()
    res = bare_grpo.run(
        model_dir,
        steps=steps,
        lr=float(defaults["lr"]),
        seed=seed,
        prompts_per_step=int(defaults["rollout_batch_size"]),
        n=int(defaults["n_samples_per_prompt"]),
        max_new=int(defaults["rollout_max_response_len"]),
        eval_interval=int(defaults["eval_interval"]),
        warmup=int(defaults.get("lr_warmup_iters", 0)),
        decay_steps=None if decay == "constant" else int(defaults.get("lr_decay_iters") or steps),
        min_lr=float(defaults.get("min_lr", 0.0)),
        decoupled_lr=defaults.get("decoupled_lr"),
        decoupled_min_lr=defaults.get("decoupled_min_lr"),
        filter_zero_std=defaults.get("dynamic_sampling_filter_path") == NONZERO_STD_FILTER,
    )
    (out / f"bare-seed{seed}.json").write_text(json.dumps(res))
    curve = [(int(p["step"]), float(p["seconds"]), float(p["accuracy"])) for p in res["curve"]]
    return Result(
        "bare", seed, curve, completions_per_s=float(res["completions_per_s"]),
        rl_seconds=float(res["rl_seconds"]), wall_seconds=time.monotonic() - t0,
    )  # fmt: skip


def _bare_overrides(extra: list[str]) -> dict[str, Any]:
    """The recipe flags among `extra` that the bare loop follows (also in their `--flag=value` form): `--lr`,
    `--dynamic-sampling-filter-path`, the batch's shape and the number of steps and of lr-decay steps."""
    names = {
        f"--{name.replace('_', '-')}": name
        for name in (
            "lr", "dynamic_sampling_filter_path", "rollout_batch_size", "n_samples_per_prompt", "num_rollout",
            "lr_decay_iters",
        )
    }  # fmt: skip
    found: dict[str, Any] = {}
    for i, arg in enumerate(extra):
        flag, eq, value = arg.partition("=")
        if flag in names and (eq or i + 1 < len(extra)):
            found[names[flag]] = value if eq else extra[i + 1]
    return found


def _spread(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1%}" if values[0] <= 1.0 else f"{values[0]:.0f}"
    mean = statistics.fmean(values)
    return f"{mean:.1%} ({min(values):.1%}–{max(values):.1%})"


def summarize(results: list[Result], arms: list[str], seeds: list[int]) -> str:
    # a mark at or past a run's last eval point would repeat its "final" column
    marks = [s for s in MARK_STEPS if any(r.at(s) is not None and s < r.curve[-1][0] for r in results)]
    head = ["arm", "seeds", *[f"step {s}" for s in marks], "final", "RL s", "completions/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        rs = [r for r in results if r.arm == arm and r.error is None]
        if not rs:
            continue
        cells = [arm, ",".join(str(r.seed) for r in rs)]
        for s in marks:
            cells.append(_spread([v for r in rs if (v := r.at(s)) is not None]))
        cells.append(_spread([r.final for r in rs]))
        cells.append(f"{statistics.fmean(r.rl_seconds for r in rs):.0f}")
        cells.append(f"{statistics.fmean(r.completions_per_s for r in rs):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    ratios = []
    for seed in seeds:
        a = next((r for r in results if r.arm == "async" and r.seed == seed and r.error is None), None)
        b = next((r for r in results if r.arm == "bare" and r.seed == seed and r.error is None), None)
        if a and b:
            ratios.append(a.completions_per_s / b.completions_per_s)
    if ratios:
        lines.append("")
        lines.append(
            f"async completions/s ÷ bare loop's, same seed: {statistics.fmean(ratios):.2f}× "
            f"({', '.join(f'{x:.2f}' for x in ratios)})"
        )
    reached = []
    for r in results:
        if r.error is None:
            hit = r.first_reached(TARGET_ACCURACY)
            when = f"step {hit[0]} ({hit[1]:.0f} s)" if hit else "never"
            reached.append(f"{r.arm} seed {r.seed}: {when}")
    if reached:
        lines.append("")
        lines.append(f"first eval at ≥ {TARGET_ACCURACY:.0%}, seconds of RL: " + "; ".join(reached))
    for r in results:
        if r.error:
            lines.append(f"\n{r.arm} seed {r.seed} failed: {r.error}")
    return "\n".join(lines)


def figure(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for arm, color in (("async", "C0"), ("on_policy", "C1"), ("bare", "C7")):
        rs = [r for r in results if r.arm == arm and r.error is None and r.curve]
        for i, r in enumerate(rs):
            label = f"{arm} ({len(rs)} seed{'s' if len(rs) > 1 else ''})" if i == 0 else None
            steps, secs, accs = zip(*r.curve, strict=True)
            axes[0].plot(steps, accs, color=color, alpha=0.8, lw=1.2, label=label)
            axes[1].plot(secs, accs, color=color, alpha=0.8, lw=1.2, label=label)
    axes[0].set_xlabel("steps trained")
    axes[1].set_xlabel("seconds of RL")
    axes[0].set_ylabel("held-out accuracy (greedy)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    axes[1].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(r: Result) -> None:
    print(f"[learning]   final {r.final:.3f}, {r.rl_seconds:.0f} s RL, {r.error or 'ok'}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--recipe", default="quickstart", help="recipes.<name> (default: quickstart)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (default: 0,1,2)")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default: {DEFAULT_ARMS})")
    p.add_argument(
        "--output", type=Path, default=Path("bench-results/learning"), help="(default: %(default)s)"
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run nothing: redraw OUTPUT's table and figure from these earlier outputs' learning.json",
    )
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: flags for every recipe run")
    a = p.parse_args(argv)
    if a.merge:
        merged = [Result(**r) for d in a.merge for r in json.loads((d / "learning.json").read_text())]
        for r in merged:
            r.curve = [tuple(pt) for pt in r.curve]  # type: ignore[misc]
        write_outputs(merged, a.recipe, a.output, ",".join(sorted({str(r.seed) for r in merged})))
        return
    seeds = [int(s) for s in a.seeds.split(",") if s]
    arms = [x for x in a.arms.split(",") if x]
    if "bare" in arms and a.recipe != "quickstart":  # its numbers would look like a result
        p.error(f"--arms bare is quickstart only: benchmarks.bare_grpo has no {a.recipe} rollout")
    for arm in arms:
        if arm != "bare":
            arm_flags(arm)  # unknown arms fail before anything runs
    extra = [x for x in a.extra if x != "--"]
    out: Path = a.output
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    results: list[Result] = []
    for seed in seeds:
        first_run: Path | None = None
        for arm in arms:
            if arm == "bare":
                continue
            print(f"[learning] {a.recipe} {arm} seed {seed} ...", file=sys.stderr, flush=True)
            r = run_recipe(a.recipe, arm, seed, out, extra)
            results.append(r)
            _report(r)
            first_run = first_run or (out / f"{arm}-seed{seed}")
        if "bare" in arms:
            print(f"[learning] bare GRPO loop seed {seed} ...", file=sys.stderr, flush=True)
            r = run_bare(a.recipe, seed, out, first_run or out / f"async-seed{seed}", extra)
            results.append(r)
            _report(r)
    write_outputs(results, a.recipe, out, a.seeds)


def write_outputs(results: list[Result], recipe: str, out: Path, seeds_label: str) -> None:
    """OUTPUT/learning.md (the table), learning.json (every result) and learning.png; prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    arms = list(dict.fromkeys(r.arm for r in results))
    seeds = sorted({r.seed for r in results})
    table = summarize(results, arms, seeds)
    header = f"## benchmarks.learning: {recipe}, seeds {seeds_label}, {os.cpu_count()} cores\n\n"
    (out / "learning.md").write_text(header + table + "\n")
    (out / "learning.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    figure(results, out / "learning.png", f"{recipe}: held-out accuracy, seeds {seeds_label}")
    print(header + table)


if __name__ == "__main__":
    main()
