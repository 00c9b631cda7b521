"""Fully async GRPO on a CPU in minutes: a tiny Llama learns two-digit addition.

    python -m recipes.quickstart                      # 6-10 minutes on 2 cores (1000 steps)
    python -m recipes.quickstart --num-rollout 5      # a smoke run

What runs (all real processes, no GPU, no network):
  1. warm start: build a tiny Llama (2M parameters, character tokenizer) and fine-tune it on a little
     supervised data until it is right ~40% of the time (RL from random init never sees a reward);
  2. the embedded engine (`python -m miles_aio.engine`) serves it over SGLang's HTTP API;
  3. a trainer rank (torch.distributed, gloo) trains it with GRPO + truncated importance sampling +
     off-policy sequence masking;
  4. the controller runs fully async: rollout never waits for training; weights are pushed to the
     engine after every step (disk transfer), and 200 held-out problems are evaluated greedily every
     few steps on the same engine, without stopping rollout.
The run directory gets metrics.jsonl, ledger.jsonl, the final checkpoint and PNG plots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from miles_aio.config import RunConfig, opt
from miles_aio.data.source import PromptRecord
from miles_aio.errors import ConfigError
from miles_aio.models.tiny import Init
from miles_aio.recipe import DefaultsWhen, Recipe, RecipeArgs, RunParts, main, open_run_parts
from miles_aio.tasks.arithmetic import make_splits

DEFAULTS: dict[str, Any] = {
    # rollout: 32 prompts × 8 samples per step; answers are at most 3 digits + EOS
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "num_rollout": 1000,
    "rollout_max_response_len": 4,
    "rollout_temperature": 1.0,
    "custom_rm_path": "miles_aio.tasks.arithmetic:answer_reward",
    # fully async: bounded staleness, rollout runs ahead of training
    "max_admission_staleness": 2,
    "max_weight_staleness": 4,
    "async_data_buffer_capacity_factor": 2.0,
    # eval: greedy, held-out, on the shared engine
    "eval_interval": 25,
    "eval_temperature": 0.0,
    "eval_max_response_len": 4,
    "save_interval": 100,  # into <run-dir>/checkpoints unless --save is given; the last step too
    # trainer: one rank, GRPO with truncated importance sampling, one optimizer step per rollout (the
    # derived --global-batch-size: every sample of the rollout, whatever the batch flags say)
    # lr: with --model-init torch (the default) 1e-4 to 3e-4 all learn (with OPSM, below). What limits
    # the pace is how fast the policy can sharpen: its logits scale with lm_head, which AdamW moves by
    # ~lr per weight per step, so the embedding and lm_head get Megatron's --decoupled-lr, 50x the rest
    # (as µP-style recipes give the input and output layers their own lr); 20 warmup steps, cosine decay.
    # 1e-4 for the rest: 3 seeds ahead of 2e-4 at step 300 and at the end (docs/learning.md)
    "lr": 1e-4,
    "min_lr": 2e-5,
    "decoupled_lr": 5e-3,
    "decoupled_min_lr": 5e-4,
    "lr_warmup_iters": 20,
    "lr_decay_style": "cosine",
    "lr_decay_iters": 1000,  # fixed, not --num-rollout's: a smoke run (--num-rollout 5) just ends in warmup
    "use_tis": True,
    # DeepSeek-V3.2's off-policy sequence masking: a negative-advantage sample the policy has already moved
    # away from (mean log π_rollout − log π > --opsm-delta) is not pushed down further. Without it, at
    # --lr 3e-4 the run collapsed (48% → 4% by step 275, seed 0), most likely because its batches are
    # 2-3 versions old: the bare on-policy loop learned at 3e-4; with OPSM that run reached 78.5% at step
    # 300, and 3 seeds of 1000 steps end at 96.5-98.0% (session 24, docs/learning.md)
    "use_opsm": True,
    "micro_batch_size": 256,
    # the trainer sets the pace and the engine idles while it waits for the new weights: on 2 cores its
    # 2 threads took a step from 0.34 to 0.28 s (a 150-step run each; docs/learning.md)
    "trainer_num_threads": -1,
    # one step's 256 samples decode as one batch, not four waves of 64
    "engine_max_running_requests": 256,
    "update_weight_transfer_mode": "disk",
}


HIDDEN_SIZE = 256
"""The tiny Llama's width. At 128 (sessions 7-22) 1000 steps ended at 83-91.5% by seed (the bare loop at
80.5-92%); at 256 each step learns more, and every seed passes 90% within 5 minutes (docs/learning.md)."""

HIDDEN_SIZE_HELP = "Hidden size of the tiny Llama (its MLP is 4x as wide); a multiple of 2 × --model-heads."

VLLM_MIN_HEAD_DIM = 64
"""vLLM's CPU attention has kernels for head_dim 64 and up (256 hidden over 4 heads is 64)."""

PACKING = DefaultsWhen(when={"train_backend": "fsdp"}, defaults={"pack_shared_prompts": True})
"""The 8 samples of a prompt share it: the fsdp trainer forwards it once per micro-batch, not 8 times (the
same math; the trainer sets the pace on 2 cores). Megatron's backend has no packing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Options:
    """The quickstart's own flags."""

    warm_start_accuracy: float = opt(
        0.4, "Supervised warm start until this greedy accuracy on training problems."
    )
    warm_start_seed: int = opt(0, "Seed of the warm start: the model's init and its supervised batches.")
    warm_start_check_every: int = opt(
        10, "Supervised steps between two checks of that accuracy (it can rise ~10 points in 10 steps)."
    )
    model_init: Init = opt(
        "torch",
        "How the tiny Llama's weights are drawn before the warm start: torch (torch.nn's defaults; RL "
        "learns at lr 1e-4 to 3e-4) or transformers (N(0, 0.02); one Adam step at 3e-4 jolts the policy).",
    )

    model_heads: int = opt(
        4, "Attention heads of the tiny Llama (key/value heads min(2, this)); one of 1, 2, 4, 8."
    )
    model_hidden_size: int = opt(HIDDEN_SIZE, HIDDEN_SIZE_HELP)

    def __post_init__(self) -> None:
        if self.model_heads not in (1, 2, 4, 8):
            raise ConfigError(f"must be 1, 2, 4 or 8, got {self.model_heads}", flags=["--model-heads"])
        if self.model_hidden_size < 2 or self.model_hidden_size % (2 * self.model_heads):
            raise ConfigError(
                f"must be a positive multiple of 2 × --model-heads ({2 * self.model_heads}), got "
                f"{self.model_hidden_size}: each head's width is even, for its rotary embedding",
                flags=["--model-hidden-size", "--model-heads"],
            )
        if not 0.0 <= self.warm_start_accuracy <= 1.0:
            raise ConfigError(
                f"must be in [0, 1], got {self.warm_start_accuracy}", flags=["--warm-start-accuracy"]
            )
        if self.warm_start_check_every < 1:
            raise ConfigError(
                f"must be >= 1, got {self.warm_start_check_every}", flags=["--warm-start-check-every"]
            )


def model_shape(opts: Options) -> dict[str, Any]:
    """`build_tiny_llama`'s arguments for these options."""
    return {
        "init": opts.model_init,
        "hidden_size": opts.model_hidden_size,
        "intermediate_size": 4 * opts.model_hidden_size,
        "num_heads": opts.model_heads,
        "num_kv_heads": min(2, opts.model_heads),
    }


def check(cfg: RunConfig, args: RecipeArgs[Options]) -> None:
    """Before anything starts: a model the chosen engine can serve."""
    opts = args.options
    head_dim = opts.model_hidden_size // opts.model_heads
    if cfg.engine.rollout_backend == "vllm" and head_dim < VLLM_MIN_HEAD_DIM:
        raise ConfigError(
            f"vLLM's CPU attention needs a head width of at least {VLLM_MIN_HEAD_DIM}; "
            f"{opts.model_hidden_size} hidden over {opts.model_heads} heads is {head_dim}",
            flags=["--model-hidden-size", "--model-heads", "--rollout-backend"],
        )


def prompts(cfg: RunConfig, args: RecipeArgs[object]) -> list[PromptRecord]:
    train, _ = make_splits()
    return [PromptRecord(p.prompt, label=p.answer) for p in train]


def eval_prompts(cfg: RunConfig, args: RecipeArgs[object]) -> dict[str, list[PromptRecord]]:
    _, held_out = make_splits()
    return {"held_out": [PromptRecord(p.prompt, label=p.answer) for p in held_out]}


def prepare(cfg: RunConfig, args: RecipeArgs[Options]) -> None:
    """The supervised warm start (before the event loop starts; cached in the run directory)."""
    from miles_aio.tasks.arithmetic import warm_start

    model_dir = cfg.run_dir / "model"
    if not (model_dir / "model.safetensors").is_file():
        train, _ = make_splits()
        opts = args.options
        warm_start(
            model_dir,
            train,
            target_accuracy=opts.warm_start_accuracy,
            seed=opts.warm_start_seed,
            check_every=opts.warm_start_check_every,
            model_kwargs=model_shape(opts),
        )


def build(cfg: RunConfig, args: RecipeArgs[object]) -> AbstractAsyncContextManager[RunParts]:
    return open_run_parts(cfg, args, model_path=cfg.run_dir / "model")


def plan(cfg: RunConfig, args: RecipeArgs[object]) -> dict[str, Any]:
    return {
        "processes": {
            "controller": 1,
            "engines": cfg.engine.num_engines,
            "engine_backend": cfg.engine.rollout_backend,
            "trainer_ranks": cfg.train.actor_num_nodes * cfg.train.actor_num_gpus_per_node,
        },
        "model": "tiny Llama, warm-started by supervised fine-tuning",
    }


RECIPE = Recipe(
    name="quickstart",
    description=(__doc__ or "").split("\n\n")[0],
    defaults=DEFAULTS,
    defaults_when=[PACKING],
    check=check,
    build=build,
    options=Options,
    prompts=prompts,
    eval_prompts=eval_prompts,
    prepare=prepare,
    plan=plan,
    checkpoints_in_run_dir=True,
)


def cli(argv: Sequence[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
