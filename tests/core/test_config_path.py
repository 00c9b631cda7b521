"""One typed path from flags to components: pure validation, one explicit resolve step, typed recipe
arguments, derived defaults that follow the flags they derive from, and short, precise CLI errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import structlog

from miles_aio.cli import parse_run_config
from miles_aio.config import (
    AUTO,
    ObservabilityConfig,
    SchedulerConfig,
    TrainConfig,
    config_warnings,
    resolve,
)
from miles_aio.errors import ConfigError
from miles_aio.recipe import NoOptions, RecipeArgs, main, parse_recipe
from tests.helpers import make_config

pytestmark = [pytest.mark.pure, pytest.mark.timeout(60)]
BASE = ["--rollout-batch-size", "4", "--num-rollout", "5", "--n-samples-per-prompt", "2", "--use-tis"]


def _model_with_layers(tmp_path: Path, layers: int) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return model


# -- validation is pure; resolve and config_warnings do the rest, once ---------------------------------------
def test_validation_reads_no_file_and_logs_nothing(tmp_path: Path) -> None:
    model = _model_with_layers(tmp_path, 3)
    with structlog.testing.capture_logs() as logs:
        train = TrainConfig(  # 3 layers do not split into 2 stages, but __post_init__ does not look
            train_backend="megatron",
            hf_checkpoint=model,
            pipeline_model_parallel_size=2,
            actor_num_gpus_per_node=2,
            use_tis=True,
        )
        TrainConfig(num_steps_per_rollout=2)
        cfg = make_config(num_steps_per_rollout=2)
        dataclasses.replace(cfg.train, lr=1e-5)
    assert not logs
    with pytest.raises(ConfigError, match="3 decoder layers") as info:
        resolve(cfg.replace(train=train))
    assert "--pipeline-model-parallel-size" in info.value.flags
    assert [w.event for w in config_warnings(cfg)] == ["num_steps_per_rollout_adds_off_policyness"]
    assert "--num-steps-per-rollout" in str(config_warnings(cfg)[0])


def test_an_uninstalled_wandb_is_found_by_resolve_not_by_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    obs = ObservabilityConfig(use_wandb=True)  # no environment probe in __post_init__
    with pytest.raises(ConfigError, match="wandb is not installed") as info:
        resolve(make_config().replace(observability=obs))
    assert info.value.flags == ("--use-wandb",)


def test_the_lr_decay_end_is_resolved_once_into_the_run_config() -> None:
    """The ranks train with `cfg.train` as resolved: its decay end is the run's own config's."""
    cfg = parse_run_config([*BASE, "--lr-decay-style", "cosine", "--global-batch-size", "4"])
    assert cfg.train.lr_decay_iters == 5 * 2  # num_rollout × 2 optimizer steps per rollout
    assert resolve(cfg) == cfg  # idempotent
    assert (
        parse_run_config([*BASE, "--lr-decay-style", "cosine", "--lr-decay-iters", "7"]).train.lr_decay_iters
        == 7
    )
    assert parse_run_config(BASE).train.lr_decay_iters is None  # constant: nothing to resolve
    unresolved = make_config(lr_decay_style="linear")
    assert unresolved.train.lr_decay_iters is None and resolve(unresolved).train.lr_decay_iters == 3


def test_an_optional_number_flag_takes_off_back_as_it_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` shows an unset optional number as "off"; the flag takes "off" to unset a recipe's value
    (the quickstart sets --decoupled-lr), and a wrong word exits 2 naming the flag and what it takes."""
    defaults = {"decoupled_lr": 5e-3, "decoupled_min_lr": 5e-4, "lr_decay_iters": 9}
    cfg = parse_run_config(BASE, defaults=defaults)
    assert (cfg.train.decoupled_lr, cfg.train.decoupled_min_lr, cfg.train.lr_decay_iters) == (5e-3, 5e-4, 9)
    off = ["--decoupled-lr", "off", "--decoupled-min-lr", "none", "--lr-decay-iters", "OFF"]
    cfg = parse_run_config([*BASE, *off], defaults=defaults)
    assert (cfg.train.decoupled_lr, cfg.train.decoupled_min_lr, cfg.train.lr_decay_iters) == (
        None,
        None,
        None,
    )
    assert parse_run_config([*BASE, "--decoupled-lr", "1e-3"]).train.decoupled_lr == 1e-3
    with pytest.raises(SystemExit) as info:
        parse_run_config([*BASE, "--decoupled-lr", "high"])
    assert info.value.code == 2
    assert "--decoupled-lr: must be a number or 'off', got 'high'" in capsys.readouterr().err


def test_the_concurrency_bound_is_an_int_or_auto_never_a_rewritten_string() -> None:
    assert (
        parse_run_config(
            [*BASE, "--async-max-concurrent-samples", "12"]
        ).scheduler.async_max_concurrent_samples
        == 12
    )
    auto = parse_run_config([*BASE, "--async-max-concurrent-samples", "auto"]).scheduler
    assert auto.async_max_concurrent_samples == AUTO and auto.adaptive
    with pytest.raises(ConfigError, match="positive integer") as info:
        SchedulerConfig(async_max_concurrent_samples="12")  # type: ignore[arg-type]
    assert info.value.flags == ("--async-max-concurrent-samples",)


# -- recipes: typed arguments, derived defaults --------------------------------------------------------------
def test_recipe_callbacks_get_typed_arguments(tmp_path: Path) -> None:
    from recipes import gsm8k_qwen3, simulated

    parsed = parse_recipe(
        simulated.RECIPE,
        ["--run-dir", str(tmp_path), "--latency-p99-s", "1.5", "--sglang-context-length", "64"],
    )
    assert isinstance(parsed.args, RecipeArgs)
    assert parsed.args.options == simulated.Options(latency_p99_s=1.5)
    assert parsed.args.sglang_args == ("--context-length", "64")
    gsm = parse_recipe(gsm8k_qwen3.RECIPE, ["--run-dir", str(tmp_path), "--hf-checkpoint", str(tmp_path)])
    assert gsm.args.options == NoOptions()
    with pytest.raises(ConfigError) as info:  # the options validate themselves, naming their flags
        parse_recipe(simulated.RECIPE, ["--run-dir", str(tmp_path), "--latency-p99-s", "0.01"])
    assert "--latency-p99-s" in info.value.flags


@pytest.mark.parametrize(
    ("argv", "samples"),
    [(["--rollout-batch-size", "16"], 16 * 8), (["--n-samples-per-prompt", "1"], 32), ([], 256)],
)
def test_quickstart_single_flag_changes_keep_the_derived_global_batch(
    argv: list[str], samples: int, tmp_path: Path
) -> None:
    from recipes import quickstart

    cfg = parse_recipe(quickstart.RECIPE, ["--run-dir", str(tmp_path), *argv]).cfg
    assert cfg.samples_per_step == samples
    assert cfg.train.resolved_global_batch_size(samples) == samples  # one optimizer step per rollout
    assert not tmp_path.joinpath("checkpoints").exists()  # parsing writes nothing


def test_gsm8k_tensor_parallelism_is_megatron_only(tmp_path: Path) -> None:
    from recipes import gsm8k_qwen3

    def train(*argv: str) -> TrainConfig:
        base = ["--run-dir", str(tmp_path), "--hf-checkpoint", str(tmp_path)]
        return parse_recipe(gsm8k_qwen3.RECIPE, [*base, *argv]).cfg.train

    assert (train().train_backend, train().tensor_model_parallel_size) == ("megatron", 2)
    fsdp = train("--train-backend", "fsdp")
    assert (fsdp.train_backend, fsdp.tensor_model_parallel_size, fsdp.dp_size) == ("fsdp", 1, 4)
    assert train("--tensor-model-parallel-size", "4").tensor_model_parallel_size == 4  # a given flag wins
    with pytest.raises(ConfigError, match="needs --train-backend megatron"):  # given with fsdp: an error
        train("--train-backend", "fsdp", "--tensor-model-parallel-size", "2")


# -- CLI errors --------------------------------------------------------------------------------------------
def test_an_eval_dataset_error_names_eval_prompt_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from recipes import quickstart

    argv = [
        "--dry-run",
        "--run-dir",
        str(tmp_path / "run"),
        "--eval-prompt-data",
        "ds",
        str(tmp_path / "no.jsonl"),
    ]
    with pytest.raises(SystemExit) as e:
        main(quickstart.RECIPE, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --eval-prompt-data: prompt data file" in err and "does not exist" in err, err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (
            ["--rollout-temp", "0.5"],
            ["unrecognized arguments: --rollout-temp", "did you mean --rollout-temperature?"],
        ),
        (["--max-weight-stalenes", "2"], ["did you mean --max-weight-staleness?"]),
        (["--rollout-batch-size", "four"], ["argument --rollout-batch-size: invalid int value: 'four'"]),
        (
            ["--async-max-concurrent-samples", "x"],
            ["argument --async-max-concurrent-samples: must be a positive"],
        ),
    ],
)
def test_argparse_errors_are_short_and_suggest_the_flag(
    extra: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_run_config([*BASE, *extra], prog="prog")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) <= 3, err  # one usage line, the error, the suggestion; not every flag
    for needle in needles:
        assert needle in err, err
    assert "--adaptive-concurrency-interval-s" not in err  # the full usage is not printed


def test_an_uninstalled_uvloop_is_found_by_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    cfg = make_config()
    with pytest.raises(ConfigError, match="uvloop is not installed") as info:
        resolve(cfg.replace(driver=dataclasses.replace(cfg.driver, event_loop="uvloop")))
    assert info.value.flags == ("--event-loop",)
    assert resolve(cfg).driver.event_loop == "asyncio"  # the default needs nothing
