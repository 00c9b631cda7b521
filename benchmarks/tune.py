"""Tune concurrency, buffer size and staleness in the simulator: the Pareto front and a recommendation.

    python -m benchmarks.tune [--config sim.toml] [--FIELD VALUE ...] [--output bench-results/tune.json]
                              [--plot bench-results/tune.png] [--steps 15] [--concurrency 64 128 ...]

Sweeps, in `benchmarks.simulate` (the real controller on virtual time, fake engine and trainer):
  --async-max-concurrent-samples × --async-data-buffer-capacity-factor × --max-admission-staleness
  × --max-weight-staleness
and prints the Pareto front of throughput (trained samples/s, higher is better) vs mean staleness of
the trained groups (versions, lower is better), and a recommended config: the least stale point on the
front within --tolerance (5%) of the best throughput.

Then adaptive concurrency: the same workload with `--async-max-concurrent-samples auto` against every
fixed setting of the sweep (other knobs at their defaults), reported as auto / best fixed throughput.
The simulated workload is the base config (file and flags, as for benchmarks.simulate).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.simulate import SimConfig, load_config, run_sim
from miles_aio.errors import ConfigError

__all__ = ["pareto_front", "recommend"]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (throughput: higher is better, staleness: lower is better),
    sorted by staleness. A point is dominated if another is at least as good in both and better in one;
    of exact duplicates, the first is kept."""
    front = []
    for i, (t, s) in enumerate(points):
        dominated = any(
            (t2 >= t and s2 <= s and (t2 > t or s2 < s)) or ((t2, s2) == (t, s) and j < i)
            for j, (t2, s2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][1], -points[i][0]))


def recommend(points: Sequence[tuple[float, float]], tolerance: float = 0.05) -> int:
    """The least stale point among those within `tolerance` of the best throughput (ties: faster)."""
    best = max(t for t, _ in points)
    ok = [i for i, (t, _) in enumerate(points) if t >= best * (1 - tolerance)]
    return min(ok, key=lambda i: (points[i][1], -points[i][0]))


def _opt_int(text: str) -> int | None:
    return None if text.lower() in ("none", "off") else int(text)


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.simulate import build_parser as sim_parser

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tune",
        description=__doc__.split("\n\n")[0],
        parents=[sim_parser()],
        conflict_handler="resolve",
    )
    parser.add_argument("--output", type=Path, default=Path("bench-results/tune.json"), help="%(default)s")
    parser.add_argument("--plot", type=Path, default=None, help="PNG (default: --output with .png)")
    parser.add_argument(
        "--steps", type=int, default=15, help="steps per simulated run (default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64, 128, 256, 512, 1024],
        help="in-flight bounds (default: %(default)s)",
    )
    parser.add_argument(
        "--buffer-factors", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="(default: %(default)s)"
    )
    parser.add_argument(
        "--admission-staleness",
        type=_opt_int,
        nargs="+",
        default=[None, 1, 2],
        help="K values, none = off (default: %(default)s)",
    )
    parser.add_argument(
        "--weight-staleness", type=_opt_int, nargs="+", default=[None, 2], help="(default: %(default)s)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="throughput loss accepted (default: %(default)s)"
    )
    parser.add_argument("--no-adaptive", action="store_true", help="skip the auto vs fixed comparison")
    parser.add_argument(
        "--adaptive-steps",
        type=int,
        default=40,
        help="steps of the auto vs fixed runs (default: %(default)s)",
    )
    for action in parser._actions:  # the simulator's --validate/--validate-steps do not apply here
        if action.dest in ("validate", "validate_steps"):
            action.help = argparse.SUPPRESS
    return parser


def sweep(base: SimConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    grid = itertools.product(
        args.concurrency, args.buffer_factors, args.admission_staleness, args.weight_staleness
    )
    for cap, factor, adm, wst in grid:
        cfg = dataclasses.replace(
            base,
            num_rollout=args.steps,
            async_max_concurrent_samples=str(cap),
            async_data_buffer_capacity_factor=factor,
            max_admission_staleness=adm,
            max_weight_staleness=wst,
        )
        r = run_sim(cfg)
        rows.append(
            {
                "async_max_concurrent_samples": cap,
                "async_data_buffer_capacity_factor": factor,
                "max_admission_staleness": adm,
                "max_weight_staleness": wst,
                "samples_per_s": r["samples_per_s"],
                "step_time_s": r["step_time_s"],
                "staleness_mean": r["staleness_mean"],
                "staleness_max": r["staleness_max"],
                "trainer_idle_ratio": r["trainer_idle_ratio"],
                "rollout_blocked_ratio": r["rollout_blocked_ratio"],
                "wasted_tokens": r["wasted_tokens"],
            }
        )
    return rows


def adaptive_vs_fixed(base: SimConfig, caps: Sequence[int], steps: int) -> dict[str, Any]:
    """Throughput of `auto` vs every fixed in-flight bound, on the same (base) workload."""
    fixed = {}
    for cap in caps:
        fixed[str(cap)] = run_sim(
            dataclasses.replace(base, num_rollout=steps, async_max_concurrent_samples=str(cap))
        )["samples_per_s"]
    auto = run_sim(dataclasses.replace(base, num_rollout=steps, async_max_concurrent_samples="auto"))
    best = max(fixed, key=lambda k: fixed[k])
    return {
        "steps": steps,
        "fixed_samples_per_s": fixed,
        "best_fixed": int(best),
        "best_fixed_samples_per_s": fixed[best],
        "auto_samples_per_s": auto["samples_per_s"],
        "auto_over_best_fixed": auto["samples_per_s"] / fixed[best],
        "auto_limit_per_step": auto["limit_per_step"],
        "auto_staleness_mean": auto["staleness_mean"],
    }


def plot(rows: list[dict[str, Any]], front: list[int], rec: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = sorted({r["async_max_concurrent_samples"] for r in rows})
    for cap in caps:
        pts = [r for r in rows if r["async_max_concurrent_samples"] == cap]
        ax.scatter(
            [r["staleness_mean"] for r in pts],
            [r["samples_per_s"] for r in pts],
            s=14,
            label=f"in-flight {cap}",
        )
    ax.plot(
        [rows[i]["staleness_mean"] for i in front],
        [rows[i]["samples_per_s"] for i in front],
        "k-",
        lw=1,
        label="Pareto front",
    )
    ax.scatter(
        [rows[rec]["staleness_mean"]], [rows[rec]["samples_per_s"]], s=160, facecolors="none", edgecolors="r"
    )
    ax.annotate("recommended", (rows[rec]["staleness_mean"], rows[rec]["samples_per_s"]), color="r")
    ax.set_xlabel("mean staleness of trained groups (versions)")
    ax.set_ylabel("throughput (trained samples/s)")
    ax.set_title("simulated sweep: throughput vs staleness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _describe(r: dict[str, Any]) -> str:
    return (
        f"--async-max-concurrent-samples {r['async_max_concurrent_samples']} "
        f"--async-data-buffer-capacity-factor {r['async_data_buffer_capacity_factor']:g}"
        + (
            ""
            if r["max_admission_staleness"] is None
            else f" --max-admission-staleness {r['max_admission_staleness']}"
        )
        + (
            ""
            if r["max_weight_staleness"] is None
            else f" --max-weight-staleness {r['max_weight_staleness']}"
        )
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)}
    try:
        base = load_config(args.config, overrides)
    except (ValueError, OSError, ConfigError) as e:
        sys.stderr.write(f"python -m benchmarks.tune: error: {e}\n")
        raise SystemExit(2) from e
    t0 = time.perf_counter()
    rows = sweep(base, args)
    points = [(r["samples_per_s"], r["staleness_mean"]) for r in rows]
    front, rec = pareto_front(points), recommend(points, args.tolerance)
    print(f"{len(rows)} simulated runs of {args.steps} steps in {time.perf_counter() - t0:.0f} s (real time)")
    print(f"Pareto front (throughput vs mean staleness), {len(front)} of {len(rows)} configs:")
    print(f"  {'samples/s':>9} {'staleness':>9} {'idle':>5} {'blocked':>7}  config")
    for i in front:
        r = rows[i]
        print(
            f"  {r['samples_per_s']:9.2f} {r['staleness_mean']:9.2f} {r['trainer_idle_ratio']:5.2f} "
            f"{r['rollout_blocked_ratio']:7.2f}  {_describe(r)}" + ("   <- recommended" if i == rec else "")
        )
    best = max(range(len(rows)), key=lambda i: rows[i]["samples_per_s"])
    print(f"recommended: {_describe(rows[rec])}")
    share = rows[rec]["samples_per_s"] / rows[best]["samples_per_s"]
    print(
        f"  {rows[rec]['samples_per_s']:.2f} samples/s ({share:.1%} of the fastest), "
        f"mean staleness {rows[rec]['staleness_mean']:.2f} "
        f"(fastest: {rows[best]['staleness_mean']:.2f})"
    )
    result: dict[str, Any] = {
        "benchmark": "tune",
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
        },
        "base": dataclasses.asdict(base),
        "steps": args.steps,
        "runs": rows,
        "pareto_front": front,
        "recommended": rec,
        "fastest": best,
    }
    if not args.no_adaptive:
        ad = adaptive_vs_fixed(base, args.concurrency, args.adaptive_steps)
        result["adaptive"] = ad
        print(
            f"adaptive concurrency: auto {ad['auto_samples_per_s']:.2f} samples/s vs best fixed "
            f"({ad['best_fixed']}) {ad['best_fixed_samples_per_s']:.2f}: "
            f"auto/best = {ad['auto_over_best_fixed']:.3f}"
        )
    png = args.plot or args.output.with_suffix(".png")
    plot(rows, front, rec, png)
    result["plot"] = str(png)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output} and {png}")


if __name__ == "__main__":
    main()
