"""Every recipe end to end, as a user runs it: real processes, real engines, real trainer ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_aio.ledger import check_conservation, read_ledger
from miles_aio.models.tiny import build_tiny_llama
from miles_aio.observability.registry import unknown_metrics
from miles_aio.tasks.arithmetic import make_splits, write_jsonl

RECIPES = ["simulated", "quickstart", "tool_use", "agent_calculator", "gsm8k_qwen3", "smollm2_math"]
FULLY_ASYNC = [
    "queue_size",
    "aborted_groups_filtered",
    "stale_groups_filtered",
    "avg_staleness",
    "max_staleness",
]
BUFFER_STALENESS = ["buffer_avg_staleness", "buffer_max_staleness"]  # absent (unknown) when empty
EVAL = ["reward", "accuracy", "truncated_ratio", "response_len", "weight_version/mean", "mixed_version_ratio"]


def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("gsm8k")
    model = build_tiny_llama(
        d / "model", alphabet="0123456789 abc#", hidden_size=32, num_heads=2, num_kv_heads=1
    )
    data = d / "train.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2 #### 2"}) + "\n")
    return model, data


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_dry_run_validates_and_starts_nothing(
    recipe: str, tmp_path: Path, gsm8k_files: tuple[Path, Path]
) -> None:
    extra: list[str] = []
    if recipe == "gsm8k_qwen3":
        model, data = gsm8k_files
        extra = [
            "--hf-checkpoint",
            str(model),
            "--prompt-data",
            str(data),
            "--input-key",
            "question",
            "--label-key",
            "answer",
            "--sglang-mem-fraction-static",
            "0.8",
            "--sglang-context-length",
            "4096",
            "--eval-sglang-mem-fraction-static",
            "0.6",
        ]
    proc = run(f"recipes.{recipe}", "--dry-run", "--run-dir", str(tmp_path / "run"), *extra)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["recipe"] == recipe
    assert plan["batch"]["samples_per_step"] > 0
    assert not (tmp_path / "run").exists()
    if recipe == "gsm8k_qwen3":
        assert plan["gpus"]["rollout"].startswith("4-7")
        assert plan["sglang_args"] == ["--mem-fraction-static", "0.8", "--context-length", "4096"]
        assert plan["eval_sglang_args"] == ["--context-length", "4096", "--mem-fraction-static", "0.6"]


@pytest.mark.timeout(300)
def test_quickstart_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        "recipes.quickstart",
        "--num-rollout",
        "4",
        "--eval-interval",
        "2",
        "--run-dir",
        str(run_dir),
        "--warm-start-accuracy",
        "0.0",
        "--rollout-batch-size",
        "8",
        "--global-batch-size",
        "64",
        "--micro-batch-size",
        "64",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps done
    for r in rows:
        for key in FULLY_ASYNC:
            assert f"rollout/fully_async/{key}" in r
        for key in BUFFER_STALENESS:
            assert (f"rollout/fully_async/{key}" in r) == (r["rollout/fully_async/queue_size"] > 0)
        assert {"perf/trainer_idle_ratio", "perf/rollout_blocked_ratio", "train/loss"} <= r.keys()
        assert "train/opsm_masked_seqs" in r  # the recipe's off-policy sequence masking is on
    evals = [r for r in rows if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [0, 2, 4]
    for r in evals:
        for key in EVAL:
            assert f"eval/held_out/{key}" in r
        assert r["eval/held_out/mixed_version_ratio"] == 0.0
        assert {"eval/lag_steps", "eval/duration_seconds"} <= r.keys()
    assert max(r["rollout/fully_async/max_staleness"] for r in rows) >= 0
    assert unknown_metrics({k for r in rows for k in r}) == []  # all in the metric registry
    check_conservation(read_ledger(run_dir / "ledger.jsonl"))
    assert (tmp_path / "ckpt" / "latest").read_text() == "4"  # step_4: the weights after 4 steps
    assert (run_dir / "learning.png").is_file() and (run_dir / "reward.png").is_file()


def test_quickstart_runs_on_uvloop(tmp_path: Path) -> None:
    """--event-loop uvloop: the whole run (engine client, trainer actor, signals) on uvloop's loop."""
    run_dir = tmp_path / "run"
    proc = run(
        "recipes.quickstart",
        *("--num-rollout", "2", "--run-dir", str(run_dir), "--warm-start-accuracy", "0.0"),
        *("--rollout-batch-size", "8", "--global-batch-size", "64", "--micro-batch-size", "64"),
        *("--event-loop", "uvloop"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "event_loop=uvloop" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.timeout(300)
def test_quickstart_with_a_dedicated_eval_engine(tmp_path: Path) -> None:
    """Eval mode 2 through the recipe: an eval engine launched from the recipe's model, loading an
    exported snapshot per point; every point has its own line in eval_points.jsonl."""
    run_dir, snaps = tmp_path / "run", tmp_path / "snaps"
    proc = run(
        "recipes.quickstart",
        *("--num-rollout", "3", "--eval-interval", "1", "--run-dir", str(run_dir)),
        *("--warm-start-accuracy", "0.0", "--rollout-batch-size", "8"),
        *("--global-batch-size", "64", "--micro-batch-size", "64"),
        *("--eval-num-gpus", "1", "--eval-hf-dir", str(snaps), "--eval-keep-snapshots", "1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = [json.loads(x) for x in (run_dir / "eval_points.jsonl").read_text().splitlines()]
    assert [p["eval/step"] for p in points] == [0.0, 1.0, 2.0, 3.0]
    for p in points:
        assert p["step"] == p["eval/step"]
        assert {"eval/lag_steps", "eval/export_time_seconds", "eval/held_out/accuracy"} <= p.keys()
        assert p["eval/held_out/weight_version/mean"] == p["eval/version"]  # the snapshot's version
    assert [d.name for d in snaps.iterdir()] == ["step_3"]  # older exports retired


@pytest.mark.timeout(300)
def test_tool_use_trains_two_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(
        "recipes.tool_use",
        "--num-rollout",
        "2",
        "--run-dir",
        str(run_dir),
        "--warm-start-accuracy",
        "0.0",
        "--rollout-batch-size",
        "8",
        "--global-batch-size",
        "64",
        "--micro-batch-size",
        "64",
        "--skip-eval-before-train",
        "--eval-interval",
        "100",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("train/loss" in r for r in rows)  # it trained, and logged its loss metrics
    assert not any("train/opsm_masked_seqs" in r for r in rows)  # as its figures were measured


HOOKS = "tests.recipes.agent_hooks"  # they write the trained and evaluated samples to the run dir


@pytest.mark.timeout(180)
def test_agent_calculator_trains_on_the_agents_sessions(tmp_path: Path) -> None:
    """The openai-client agent through the session endpoint, end to end: a short warm start that teaches
    tool calls, two GRPO steps, eval through the same agent. Every trained sample is a session's
    trajectory: the model's replies at loss mask 1, the tool's answers and the template's glue at 0."""
    run_dir = tmp_path / "run"
    held_out = write_jsonl(make_splits()[1][:4], tmp_path / "held_out.jsonl")
    proc = run(
        "recipes.agent_calculator",
        *("--num-rollout", "2", "--run-dir", str(run_dir), "--rollout-batch-size", "4"),
        *("--global-batch-size", "32", "--micro-batch-size", "32"),
        # 50 warm-start steps, no probe; taught to start a call, sampled cooler: tool calls for sure
        *("--warm-start-accuracy", "0", "--warm-start-check-every", "50", "--warm-start-call-share", "0.75"),
        *("--rollout-temperature", "0.5", "--eval-prompt-data", "held_out", str(held_out)),
        *("--eval-interval", "2", "--custom-rollout-log-function-path", f"{HOOKS}:log_rollout_data"),
        *("--custom-eval-rollout-log-function-path", f"{HOOKS}:log_eval_rollout_data"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["rollout/model_token_ratio"] < 1.0 for r in rows)
    assert unknown_metrics({k for r in rows for k in r}) == []
    trained = [json.loads(x) for x in (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    assert len(trained) == 2 * 4 * 8
    for s in trained:
        session = s["session"]
        assert session["requests"] >= 1 and session["rollbacks"] == 0  # the agent called its endpoint
        assert sum(s["loss_mask"]) == session["model_tokens"] > 0
        assert len(s["loss_mask"]) - sum(s["loss_mask"]) == session["context_tokens"]
    called = [s for s in trained if s["agent"]["tool_calls"]]
    assert called  # and then the model answered the tool's message: a second turn, context in between
    assert all(s["session"]["turns"] >= 2 and 0 in s["loss_mask"] and 1 in s["loss_mask"] for s in called)
    model_tokens = sum(r["rollout/model_token_ratio"] * r["rollout/tokens"] for r in rows)
    assert model_tokens == pytest.approx(sum(sum(s["loss_mask"]) for s in trained))
    evals = [json.loads(x) for x in (run_dir / "eval_samples_held_out.jsonl").read_text().splitlines()]
    assert sorted({e["step"] for e in evals}) == [0, 2] and len(evals) == 2 * 4
    assert all(e["session"]["requests"] >= 1 for e in evals)  # eval goes through the same agent
    assert [r["eval/step"] for r in rows if "eval/step" in r] == [0, 2]
    check_conservation(read_ledger(run_dir / "ledger.jsonl"))
