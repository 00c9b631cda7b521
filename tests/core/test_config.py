"""Invalid flags and combinations exit 2 before anything starts, naming the flags (table-driven)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles_aio.cli import parse_run_config
from miles_aio.config import RunConfig

pytestmark = pytest.mark.procs

BASE = ["--rollout-batch-size", "4", "--num-rollout", "2", "--n-samples-per-prompt", "2", "--use-tis"]

INVALID: list[tuple[list[str], list[str]]] = [
    (["--async-data-buffer-capacity-factor", "0"], ["--async-data-buffer-capacity-factor"]),
    (["--async-data-buffer-capacity-factor", "-1.5"], ["--async-data-buffer-capacity-factor"]),
    (["--async-data-buffer-capacity-factor", "nan"], ["--async-data-buffer-capacity-factor"]),
    (
        ["--async-data-buffer-capacity-factor", "0.1"],
        ["--async-data-buffer-capacity-factor", "--rollout-batch-size"],
    ),
    (["--async-max-concurrent-samples", "1"], ["--async-max-concurrent-samples", "--n-samples-per-prompt"]),
    (["--async-max-concurrent-samples", "0"], ["--async-max-concurrent-samples"]),
    (["--pause-generation-mode", "abort"], ["--pause-generation-mode", "--partial-rollout"]),
    (["--rollout-batch-size", "0"], ["--rollout-batch-size"]),
    (["--n-samples-per-prompt", "0"], ["--n-samples-per-prompt"]),
    (["--num-rollout", "-1"], ["--num-rollout"]),
    (["--update-weights-interval", "0"], ["--update-weights-interval"]),
    (["--max-weight-staleness", "-1"], ["--max-weight-staleness"]),
    (["--max-admission-staleness", "-2"], ["--max-admission-staleness"]),
    (["--save-interval", "5"], ["--save-interval", "--save"]),
    (["--save", "ck", "--save-interval", "0"], ["--save-interval"]),
    (["--eval-interval", "0"], ["--eval-interval"]),
    (
        ["--eval-interval", "3", "--update-weights-interval", "2"],
        ["--eval-interval", "--update-weights-interval"],
    ),
    (["--rollout-temperature", "-0.1"], ["--rollout-temperature"]),
    (["--rollout-top-p", "0"], ["--rollout-top-p"]),
    (["--rollout-top-p", "1.5"], ["--rollout-top-p"]),
    (["--rollout-max-response-len", "0"], ["--rollout-max-response-len"]),
    (["--rollout-max-context-len", "0"], ["--rollout-max-context-len"]),
    (["--sglang-server-concurrency", "0"], ["--sglang-server-concurrency"]),
    (["--stall-warning-s", "0"], ["--stall-warning-s"]),
    # argparse-level errors: wrong type, bad choice
    (["--rollout-submission-granularity", "token"], ["--rollout-submission-granularity"]),
    (["--async-unused-samples-handler", "keep"], ["--async-unused-samples-handler"]),
    (["--rollout-batch-size", "four"], ["--rollout-batch-size"]),
    # trainer and cross-component rules
    (["--no-use-tis"], ["--use-tis", "--allow-uncorrected-off-policy"]),
    (["--global-batch-size", "3"], ["--global-batch-size"]),
    (["--global-batch-size", "16"], ["--global-batch-size"]),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], ["--rollout-num-gpus"]),
    (["--eval-prompt-data", "only-a-name"], ["--eval-prompt-data"]),
    (["--train-backend", "jax"], ["--train-backend"]),
    (["--n-samples-per-eval-prompt", "0"], ["--n-samples-per-eval-prompt"]),
    # eval modes 2 and 3
    (
        ["--eval-num-gpus", "1", "--eval-function-path", "m:C", "--eval-interval", "2", "--eval-hf-dir", "d"],
        ["--eval-num-gpus", "--eval-function-path"],
    ),
    (
        ["--eval-sglang-urls", "http://e:1", "--eval-function-path", "m:C", "--eval-hf-dir", "d"],
        ["--eval-sglang-urls", "--eval-function-path"],
    ),
    (["--eval-sglang-urls", "http://e:1", "--eval-num-gpus", "1"], ["--eval-sglang-urls", "--eval-num-gpus"]),
    (["--eval-function-path", "m:C", "--eval-interval", "2"], ["--eval-hf-dir", "--save-hf"]),
    (["--eval-function-path", "m:C", "--eval-hf-dir", "d"], ["--eval-interval"]),
    (
        [
            *("--eval-function-path", "m:C", "--save-hf", "hf/{step}", "--eval-interval", "3"),
            *("--save", "ck", "--save-interval", "2"),
        ],
        ["--eval-interval", "--save-interval", "--save-hf"],
    ),
    (
        ["--eval-num-gpus", "1", "--save-hf", "hf/{step}", "--eval-interval", "2"],
        ["--eval-interval", "--save-interval", "--save-hf"],
    ),
    (["--save-hf", "hf/latest"], ["--save-hf"]),
    (["--save-hf", "hf/{rollout}"], ["--save-hf"]),
    (["--eval-num-gpus", "-1"], ["--eval-num-gpus"]),
    (["--eval-num-gpus", "3", "--eval-num-gpus-per-engine", "2"], ["--eval-num-gpus"]),
    (["--eval-max-in-flight", "0"], ["--eval-max-in-flight"]),
    (["--eval-keep-snapshots", "-1"], ["--eval-keep-snapshots"]),
    (["--eval-overflow-policy", "drop"], ["--eval-overflow-policy"]),
    (["--engine-admin-timeout-s", "0"], ["--engine-admin-timeout-s"]),
    (["--engine-max-restarts", "-1"], ["--engine-max-restarts"]),
    (["--trainer-heartbeat-timeout-s", "-1"], ["--trainer-heartbeat-timeout-s"]),
]


@pytest.mark.parametrize(("argv", "flags"), INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_config_exits_2_naming_the_flags(
    argv: list[str], flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_run_config(BASE + argv, prog="prog")
    assert e.value.code == 2
    err = capsys.readouterr().err
    for f in flags:
        assert f in err, f"{f} not named in: {err}"


def test_missing_required_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_run_config(["--num-rollout", "2"], prog="prog")
    assert e.value.code == 2
    assert "--rollout-batch-size" in capsys.readouterr().err


def test_valid_flags_build_a_frozen_config_with_derived_bounds() -> None:
    cfg = parse_run_config(
        [
            *BASE,
            "--async-data-buffer-capacity-factor",
            "1.5",
            "--rollout-stop-token-ids",
            "3",
            "4",
            "--no-rollout-shuffle",
        ]
    )
    assert isinstance(cfg, RunConfig)
    assert cfg.buffer_capacity_groups == 6
    assert cfg.max_in_flight_samples == 8
    assert cfg.rollout.rollout_stop_token_ids == (3, 4)
    assert cfg.data.rollout_shuffle is False
    with pytest.raises(AttributeError):
        cfg.rollout.rollout_batch_size = 3  # type: ignore[misc]


def test_recipe_defaults_are_overridden_by_flags() -> None:
    cfg = parse_run_config(
        ["--num-rollout", "7"], defaults={"rollout_batch_size": 3, "num_rollout": 1, "use_tis": True}
    )
    assert (cfg.rollout.rollout_batch_size, cfg.driver.num_rollout) == (3, 7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--custom-rm-path", "no.such.module:fn"], "--custom-rm-path"),
        (["--custom-generate-function-path", "miles_aio.types:Sample"], "--custom-generate-function-path"),
        (["--custom-async-data-buffer-path", "miles_aio.types:Sample"], "--custom-async-data-buffer-path"),
        (["--prompt-data", "/nonexistent/prompts.jsonl"], "--prompt-data"),
        (
            ["--eval-function-path", "no.such:Eval", "--eval-interval", "2", "--eval-hf-dir", "/tmp/x"],
            "--eval-function-path",
        ),
        (["--pause-generation-mode", "abort"], "--partial-rollout"),
    ],
)
def test_recipe_exits_2_before_starting_anything(argv: list[str], needle: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.simulated", "--run-dir", str(run_dir), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert not run_dir.exists()  # nothing started, nothing written


@pytest.mark.timeout(60)
def test_recipe_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.simulated", "--dry-run", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert '"samples_per_step": 32' in proc.stdout
    assert not run_dir.exists()
