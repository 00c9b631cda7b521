"""What every `python -m recipes.<name>` shares: flags, validation, `--dry-run`, logging, the run.

A recipe supplies its defaults, its own flags (a dataclass of `opt` fields, `Recipe.options`) and a
`build` coroutine-context that starts its engines and trainer; `main()` does the rest. Order matters:
every flag is parsed and validated, the config resolved and every plug-in resolved before `build`
starts any process, so a bad config exits 2 having started nothing.

Every callback gets the run's resolved `RunConfig` and a typed `RecipeArgs` (the recipe's options and
the SGLang passthrough arguments), never the argparse namespace: `parse_recipe` is the one path from
the command line to both.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import errno
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

import structlog

from miles_aio._aio import event_loop_factory
from miles_aio.checkpoint import has_checkpoint, latest_checkpoint
from miles_aio.cli import (
    DefaultsWhen,
    FlagParser,
    add_flags,
    apply_defaults_when,
    build_parser,
    component_from_values,
    config_error_exit,
    config_from_values,
    defaults_when_notes,
    parse_flags,
)
from miles_aio.config import RunConfig, log_config_warnings, resolve
from miles_aio.controller import Controller, RunSummary
from miles_aio.data.source import DataSource, PromptRecord, read_prompt_jsonl
from miles_aio.errors import ConfigError, format_run_error
from miles_aio.eval.external import eval_fn_class
from miles_aio.eval.fleet import open_eval_engines
from miles_aio.inference.base import InferenceEngine
from miles_aio.inference.engines import check_in_place_prefix_cache
from miles_aio.inference.sglang_args import check_sglang_args
from miles_aio.logs import configure_logging
from miles_aio.observability.hooks import resolve_log_hooks
from miles_aio.observability.progress import ProgressSink
from miles_aio.observability.wandb_sink import wandb_mode
from miles_aio.plot import plot_run
from miles_aio.plugins import Plugins, resolve_plugins
from miles_aio.rollout.context import Tokenizer
from miles_aio.trainer.base import Trainer

__all__ = [
    "DefaultsWhen",
    "NoOptions",
    "ParsedRecipe",
    "Recipe",
    "RecipeArgs",
    "RunParts",
    "main",
    "open_run_parts",
    "parse_recipe",
]

log = structlog.get_logger("miles_aio.recipe")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunParts:
    """What a recipe's `build` yields: the started engines and trainer."""

    engine: InferenceEngine
    trainer: Trainer
    tokenizer: Tokenizer | None
    model_path: Path | None = None
    """The initial HF model directory (dedicated eval engines, eval mode 2, start from it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NoOptions:
    """The options of a recipe with no flags of its own."""


OptionsT = TypeVar("OptionsT")
OptionsT_co = TypeVar("OptionsT_co", covariant=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeArgs(Generic[OptionsT_co]):
    """What a recipe's callbacks get besides the RunConfig."""

    options: OptionsT_co
    """The recipe's own flags, parsed and validated: an instance of its `Recipe.options` dataclass."""
    sglang_args: tuple[str, ...] = ()
    """`--sglang-<flag> [value]` as `--<flag> [value]`, for every SGLang server the run launches."""
    eval_sglang_args: tuple[str, ...] = ()
    """The same for the dedicated eval engines, with `--eval-sglang-<flag>` overrides."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe(Generic[OptionsT]):
    name: str
    description: str
    defaults: Mapping[str, Any]
    """Config defaults by field name: set one only for a flag the recipe means to pin; a derived default
    (e.g. --global-batch-size: every sample of a rollout) stays derived unless the user sets the flag."""
    build: Callable[[RunConfig, RecipeArgs[OptionsT]], AbstractAsyncContextManager[RunParts]]
    """Start engines and trainer for the config; stop them (all of them, always) on exit."""
    options: type[OptionsT] = NoOptions  # type: ignore[assignment]  # a recipe without flags of its own
    """A frozen dataclass of the recipe's own flags (`miles_aio.config.opt` fields, one flag each, shown
    in --help with the rest; `__post_init__` validates them, raising ConfigError)."""
    defaults_when: Sequence[DefaultsWhen] = ()
    """Defaults that hold only while other flags have given values (e.g. a TP size for megatron)."""
    prompts: Callable[[RunConfig, RecipeArgs[OptionsT]], list[PromptRecord]] | None = None
    """Built-in prompt data, used when --prompt-data is not given."""
    prepare: Callable[[RunConfig, RecipeArgs[OptionsT]], None] | None = None
    """Synchronous set-up before the event loop starts (e.g. building a model); not run by --dry-run."""
    eval_prompts: Callable[[RunConfig, RecipeArgs[OptionsT]], dict[str, list[PromptRecord]]] | None = None
    """Built-in eval datasets, used when --eval-prompt-data is not given."""
    plan: Callable[[RunConfig, RecipeArgs[OptionsT]], dict[str, Any]] | None = None
    """Extra lines for the --dry-run plan (processes, engines, devices)."""
    checkpoints_in_run_dir: bool = False
    """Without --save, checkpoint to <run-dir>/checkpoints (every --save-interval steps and at the end)."""
    check: Callable[[RunConfig, RecipeArgs[OptionsT]], None] | None = None
    """The recipe's own checks of the resolved config (ConfigError naming the flags), run before anything
    starts, by --dry-run too: e.g. that --hf-checkpoint names a model directory."""


def check_hf_checkpoint(cfg: RunConfig) -> Path:
    """`--hf-checkpoint` for a recipe that trains it: given, and an HF model directory on this machine
    (config.json beside the weights), else a ConfigError naming the flag (exit 2 before anything
    starts, instead of an engine or a trainer rank failing to load it minutes later)."""
    path = cfg.train.hf_checkpoint
    what = "the HF model directory to train (config.json + safetensors)"
    if path is None:
        raise ConfigError(f"is required: {what}", flags=["--hf-checkpoint"])
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory; give {what}", flags=["--hf-checkpoint"])
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json; give {what}", flags=["--hf-checkpoint"])
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedRecipe(Generic[OptionsT]):
    """A recipe's command line, parsed, validated and resolved (`parse_recipe`)."""

    cfg: RunConfig
    args: RecipeArgs[OptionsT]
    dry_run: bool = False
    log_format: Literal["console", "json"] = "console"
    log_level: str = "INFO"


@asynccontextmanager
async def open_run_parts(
    cfg: RunConfig, args: RecipeArgs[object], *, model_path: Path
) -> AsyncIterator[RunParts]:
    """The usual `Recipe.build`: rollout engines (`--rollout-backend`) and trainer ranks on `model_path`,
    with its tokenizer. SGLang and vLLM engines go on the GPUs after the trainer's."""
    from transformers import AutoTokenizer

    from miles_aio.inference.engines import open_engines
    from miles_aio.trainer.actor import TrainerActor

    t = cfg.train
    trainer_gpus = (
        t.actor_num_nodes * t.actor_num_gpus_per_node if cfg.engine.rollout_backend != "local" else 0
    )
    async with (
        open_engines(
            cfg, model_path=model_path, gpu_offset=trainer_gpus, sglang_args=args.sglang_args
        ) as router,
        TrainerActor.open(
            dataclasses.replace(t, hf_checkpoint=model_path), cfg, run_dir=cfg.run_dir
        ) as trainer,
    ):
        tokenizer = cast("Tokenizer", AutoTokenizer.from_pretrained(model_path))
        yield RunParts(engine=router, trainer=trainer, tokenizer=tokenizer, model_path=model_path)


def _parser(recipe: Recipe[Any]) -> FlagParser:
    parser = build_parser(
        f"python -m recipes.{recipe.name}",
        description=recipe.description,
        defaults=recipe.defaults,
        defaults_when=recipe.defaults_when,
    )
    general = parser.add_argument_group("run")
    general.add_argument(
        "--dry-run", action="store_true", help="Validate the config, print the plan, start nothing."
    )
    general.add_argument("--log-format", choices=["console", "json"], default="console", help="Log renderer.")
    general.add_argument("--log-level", default="INFO", help="Log level (default: INFO).")
    if dataclasses.fields(recipe.options):
        add_flags(
            parser.add_argument_group(recipe.name),
            recipe.options,
            notes=defaults_when_notes(recipe.defaults_when),
        )
    parser.epilog = (
        "SGLang passthrough: --sglang-<flag> [value] is given to every SGLang server this run launches "
        "as --<flag> [value]; --eval-sglang-<flag> [value] overrides or adds --<flag> for the dedicated "
        "eval engines (--eval-num-gpus) only."
    )
    return parser


def sglang_passthrough(
    parser: argparse.ArgumentParser, unknown: Sequence[str]
) -> tuple[list[str], list[str]]:
    """The launch_server arguments of the rollout engines and of the dedicated eval engines (mode 2).

    `--sglang-<flag> [value]` → `--<flag> [value]` for both fleets; `--eval-sglang-<flag> [value]`
    overrides (or adds) `--<flag>` for the eval engines only. Any other unknown argument is an error.
    """
    rollout: list[list[str]] = []
    overrides: list[list[str]] = []
    current: list[list[str]] | None = None
    for arg in unknown:
        for prefix, target in (("--eval-sglang-", overrides), ("--sglang-", rollout)):
            if arg.startswith(prefix):
                current = target
                target.append(["--" + arg.removeprefix(prefix)])
                break
        else:
            if current is None or arg.startswith("--"):
                parser.error(f"unrecognized arguments: {arg}")
            current[-1].append(arg)  # the value of the previous --sglang-* flag
    replaced = {group[0].split("=", 1)[0] for group in overrides}
    kept = [g for g in rollout if g[0].split("=", 1)[0] not in replaced]
    return [a for g in rollout for a in g], [a for g in kept + overrides for a in g]


def parse_recipe(
    recipe: Recipe[OptionsT],
    argv: Sequence[str] | None = None,
    *,
    parser: argparse.ArgumentParser | None = None,
) -> ParsedRecipe[OptionsT]:
    """The command line as the run's resolved RunConfig and the recipe's typed arguments: flags, then
    the recipe's conditional defaults for the flags not given, then validation (ConfigError naming the
    flags), then `miles_aio.config.resolve`. Starts nothing, writes nothing; argparse errors exit 2."""
    parser = _parser(recipe) if parser is None else parser
    flags = apply_defaults_when(parse_flags(parser, argv, known_only=True), recipe.defaults_when)
    sglang_args, eval_sglang_args = sglang_passthrough(parser, flags.unknown)
    values = flags.values
    run_dir = values["run_dir"] or Path("runs") / f"{recipe.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    if recipe.checkpoints_in_run_dir and values["save"] is None:
        values = {**values, "save": run_dir / "checkpoints"}
    cfg = resolve(config_from_values(values, run_dir=run_dir))
    args = RecipeArgs(
        options=component_from_values(recipe.options, values),
        sglang_args=tuple(sglang_args),
        eval_sglang_args=tuple(eval_sglang_args),
    )
    return ParsedRecipe(
        cfg=cfg,
        args=args,
        dry_run=values["dry_run"],
        log_format=values["log_format"],
        log_level=values["log_level"],
    )


def load_records(cfg: RunConfig, recipe: Recipe[OptionsT], args: RecipeArgs[OptionsT]) -> list[PromptRecord]:
    if cfg.data.prompt_data is not None:
        return read_prompt_jsonl(cfg.data.prompt_data, cfg.data)
    if recipe.prompts is None:
        raise ConfigError("this recipe has no built-in prompts; give a JSONL file", flags=["--prompt-data"])
    return recipe.prompts(cfg, args)


def load_eval_datasets(
    cfg: RunConfig, recipe: Recipe[OptionsT], args: RecipeArgs[OptionsT]
) -> dict[str, list[PromptRecord]]:
    if cfg.eval.datasets:
        return {
            name: read_prompt_jsonl(path, cfg.data, flag="--eval-prompt-data")
            for name, path in cfg.eval.datasets.items()
        }
    return recipe.eval_prompts(cfg, args) if recipe.eval_prompts is not None else {}


def check_writable_dir(path: Path, flag: str) -> None:
    """ConfigError naming `flag` unless `path` is (or can become) a directory this process can write.

    Probed by creating and removing an entry, without creating `path` itself (a `--dry-run` creates
    nothing): in the directory if it exists, else in its nearest existing ancestor. Permission bits
    alone would not do: root writes through them, yet not under a regular file, on a read-only mount,
    or in /proc.
    """
    path = Path(os.path.abspath(path))
    probe_in = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe_in))
        os.rmdir(tempfile.mkdtemp(prefix=".miles-aio-write-probe-", dir=probe_in))
    except OSError as exc:
        raise ConfigError(
            f"{path} is not a writable directory ({probe_in}: {exc.strerror or exc})", flags=[flag]
        ) from None


def describe_plan(
    cfg: RunConfig, recipe: Recipe[OptionsT], args: RecipeArgs[OptionsT], n_prompts: int
) -> dict[str, Any]:
    r, s, b, d, o = cfg.rollout, cfg.scheduler, cfg.buffer, cfg.driver, cfg.observability
    plan: dict[str, Any] = {
        "recipe": recipe.name,
        "run_dir": str(cfg.run_dir),
        "prompts": n_prompts,
        "steps": d.num_rollout,
        "batch": {
            "groups_per_step": r.rollout_batch_size,
            "samples_per_group": r.n_samples_per_prompt,
            "samples_per_step": cfg.samples_per_step,
        },
        "scheduler": {
            "max_in_flight_samples": cfg.max_in_flight_samples,
            "granularity": s.rollout_submission_granularity,
            "max_admission_staleness": s.max_admission_staleness,
        },
        "buffer": {
            "capacity_groups": cfg.buffer_capacity_groups,
            "max_weight_staleness": b.max_weight_staleness,
            "unused_handler": b.async_unused_samples_handler,
        },
        "weights": {"update_interval": d.update_weights_interval, "pause_mode": d.pause_generation_mode},
        "checkpoints": {
            "save": None if d.save is None else str(d.save),
            "save_interval": d.save_interval,
            "load": None if d.load is None else str(latest_checkpoint(d.load)),
        },
        "observability": {
            "trace": str(cfg.run_dir / o.trace) if o.trace else None,
            "wandb": wandb_mode(o.wandb_mode) if o.use_wandb else None,
        },
    }
    if recipe.plan is not None:
        plan.update(recipe.plan(cfg, args))
    return plan


def main(recipe: Recipe[OptionsT], argv: Sequence[str] | None = None) -> RunSummary | None:
    """Parse, validate and resolve (exit 2 on error), then either print the plan (--dry-run) or run."""
    parser = _parser(recipe)
    try:
        parsed = parse_recipe(recipe, argv, parser=parser)
        cfg, args = parsed.cfg, parsed.args
        check_in_place_prefix_cache(cfg, args.sglang_args)
        sglang_warnings = check_sglang_args(cfg, args.sglang_args, args.eval_sglang_args)
        if recipe.check is not None:
            recipe.check(cfg, args)
        plugins = resolve_plugins(cfg)
        resolve_log_hooks(cfg)  # a bad --custom-*-log-function-path exits 2 before anything starts
        if cfg.eval.eval_function_path:
            eval_fn_class(cfg)  # likewise a bad --eval-function-path
        records = load_records(cfg, recipe, args)
        eval_datasets = load_eval_datasets(cfg, recipe, args)
        check_writable_dir(cfg.run_dir, "--run-dir")
        if cfg.driver.save is not None:  # found at the first save otherwise, after the run's first steps
            check_writable_dir(cfg.driver.save, "--save")
    except ConfigError as e:
        config_error_exit(parser, e)
    configure_logging(parsed.log_format, parsed.log_level)  # to stderr: stdout is --dry-run's plan only
    log_config_warnings(cfg)  # once, here: validation itself never logs
    for warning in sglang_warnings:
        log.warning(warning, sglang_args=list(args.sglang_args))
    d = cfg.driver
    if d.load is not None and not has_checkpoint(d.load):
        # miles' `--load X --save X` on its first run starts fresh; any other --load without a checkpoint
        # (a typo, the wrong directory) is an error rather than a silent restart from scratch
        if d.save is None or d.load.resolve() != d.save.resolve():
            what = f"{d.load} holds no checkpoint; an empty --load starts fresh only when it is also --save"
            config_error_exit(parser, ConfigError(what, flags=["--load", "--save"]))
        log.warning("no checkpoint under --load (= --save) yet: starting fresh", load=str(d.load))
        cfg = cfg.replace(driver=dataclasses.replace(d, load=None))
    if parsed.dry_run:
        plan = describe_plan(cfg, recipe, args, len(records))
        plan["eval"] = {name: len(recs) for name, recs in eval_datasets.items()} | {
            "interval": cfg.driver.eval_interval
        }
        sys.stdout.write(plan_json(plan) + "\n")
        return None
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if recipe.prepare is not None:
        recipe.prepare(cfg, args)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(cfg.driver.event_loop)) as runner:
            return runner.run(_run(recipe, cfg, args, plugins, records, eval_datasets))
    except ConfigError as e:  # found once engines answer (e.g. what servers given by URL run with)
        config_error_exit(parser, e)
    except Exception as e:  # the run failed: a short report, the cause on its last line (errors.py)
        sys.stderr.write(format_run_error(e))
        sys.stderr.flush()
        raise SystemExit(1) from None


async def _run(
    recipe: Recipe[OptionsT],
    cfg: RunConfig,
    args: RecipeArgs[OptionsT],
    plugins: Plugins,
    records: list[PromptRecord],
    eval_datasets: dict[str, list[PromptRecord]],
) -> RunSummary:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    source = DataSource(
        records,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        seed=cfg.data.rollout_seed,
        shuffle=cfg.data.rollout_shuffle,
    )
    stopper = _Stopper()  # from here on: a signal while engines start or stop still tears them down
    try:
        async with (
            recipe.build(cfg, args) as parts,
            open_eval_engines(
                cfg, model_path=parts.model_path, trainer=parts.trainer, sglang_args=args.eval_sglang_args
            ) as eval_engine,
        ):
            controller = Controller(
                cfg,
                engine=parts.engine,
                trainer=parts.trainer,
                source=source,
                plugins=plugins,
                tokenizer=parts.tokenizer,
                num_engines=cfg.engine.num_engines,
                sinks=[ProgressSink(cfg.driver.num_rollout)],
                eval_datasets=eval_datasets,
                eval_engine=eval_engine,
            )
            stopper.controller = stopper.ran = controller
            try:
                summary = await controller.run()
            finally:
                stopper.controller = None
    except asyncio.CancelledError:
        if stopper.received:  # a signal outside the steps (start-up, teardown), or a second one: all down
            log.warning(stop_line(cfg, stopper.ran, stopper.received[0], save_skipped=True))
            raise SystemExit(128 + stopper.received[0]) from None
        raise
    finally:
        stopper.remove()
    stopped = controller.stopped and bool(stopper.received)
    pngs = plot_run(cfg.run_dir, buffer=cfg.buffer.custom_async_data_buffer_path)
    log.info(
        "run stopped" if stopped else "run finished",
        steps=controller.steps_done,
        version=summary.version,
        wall_s=round(summary.wall_s, 2),
        run_dir=str(cfg.run_dir),
        ledger=summary.ledger_counts,
        plots=[p.name for p in pngs],
        event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],  # asyncio | uvloop
    )
    if stopped:  # stopped by a signal: checkpoint saved, children gone; the last line says where
        log.warning(stop_line(cfg, controller, stopper.received[0]))
        raise SystemExit(128 + stopper.received[0])
    return summary


def plan_json(plan: Mapping[str, Any]) -> str:
    """The --dry-run plan as JSON, non-ASCII as itself ("TP 2 × DP 2", not "\\u00d7") unless stdout
    cannot encode it."""
    text = json.dumps(plan, indent=2, ensure_ascii=False)
    try:
        text.encode(sys.stdout.encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return json.dumps(plan, indent=2)
    return text


def stop_line(
    cfg: RunConfig, controller: Controller | None, signum: int, *, save_skipped: bool = False
) -> str:
    """The last line of a run a signal stopped: how far it got, and what it saved where (or why not).

    `save_skipped`: the run was cancelled (a second signal, or one while engines start or stop), so the
    stop's own save did not happen; `controller` is None when the steps never started."""
    name, total = signal.Signals(signum).name, cfg.driver.num_rollout
    if controller is None:
        return f"stopped before the first step of {total} ({name}); nothing saved: the run had not started"
    done = controller.steps_done
    head = f"stopped early at step {done} of {total} ({name})" if done < total else f"stopped ({name})"
    last, where = controller.last_checkpoint_step, controller.last_checkpoint_dir
    resumes = ""
    if last is not None and where is not None:
        load = cfg.driver.save if controller.saved_this_run else where
        resumes = f"`--load {load}` resumes with step {last + 1}"
    if last == done and where is not None:
        if controller.saved_this_run:
            return f"{head}; saved {where} ({resumes})"
        return f"{head}; nothing new to save: no step finished since {where} was loaded ({resumes})"
    if cfg.driver.save is None:
        why = "nothing saved: no --save given"
    elif save_skipped:
        why = "nothing saved: a second signal skipped the save"
    elif done == controller.start_step:
        why = "nothing saved: no step finished"
    else:
        why = "nothing saved"
    return f"{head}; {why}" + (f"; {resumes}" if resumes else "")


class _Stopper:
    """SIGINT/SIGTERM handlers for a whole run. While the controller runs, the first signal asks it to
    stop after its step (saving a checkpoint) and a second cancels the run at once; while engines and
    trainer start or stop, a signal cancels at once (their context managers still stop every process)."""

    def __init__(self) -> None:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        self.controller: Controller | None = None
        self.ran: Controller | None = None  # the controller of the run, once its steps started
        self.received: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._handle, int(sig))

    def _handle(self, signum: int) -> None:
        self.received.append(signum)
        if self.controller is not None and len(self.received) == 1:
            self.controller.request_stop()
            return
        if self.controller is not None:  # a second signal while the steps run: the stop's save is skipped
            last = self.controller.last_checkpoint_step
            log.warning(
                "second signal: stopping now, skipping the checkpoint save; `--load` resumes from the last "
                "complete checkpoint and trains the steps after it again"
                if last is not None
                else "second signal: stopping now, skipping the checkpoint save; there is no checkpoint, "
                "a new run starts from scratch",
                signal=signal.Signals(signum).name,
                last_checkpoint_step=last,
            )
        if self.task is not None:
            self.task.cancel()

    def remove(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(sig)
