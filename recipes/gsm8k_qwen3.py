"""GSM8K with a Qwen3 model on GPUs: SGLang rollout engines + a megatron-core (or FSDP) trainer.

    python -m recipes.gsm8k_qwen3 \\
        --hf-checkpoint /models/Qwen3-4B \\
        --prompt-data /data/gsm8k/train.jsonl --input-key question --label-key answer \\
        --eval-prompt-data gsm8k /data/gsm8k/test.jsonl

Nothing is downloaded: bring the checkpoint and the JSONL files (GSM8K's `answer` field, ending in
`#### <number>`, is the label). The flags are miles' fully async flags, so a miles script ports by
changing its entry point.

GPU layout (one 8-GPU node, the default):
    GPUs 0-3  trainer: megatron-core, TP 2 × DP 2
              (--actor-num-gpus-per-node 4 --tensor-model-parallel-size 2)
    GPUs 4-7  rollout: 4 SGLang engines, 1 GPU each (--rollout-num-gpus 4 --rollout-num-gpus-per-engine 1)
Weights go from trainer rank 0 to the engines over NCCL (--update-weight-transfer-mode broadcast).
Multi-node: start the trainer ranks with torchrun on each node (--actor-num-nodes N); they dial the
controller. `--dry-run` prints this plan for your flags without starting anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from miles_aio.config import RunConfig
from miles_aio.recipe import (
    DefaultsWhen,
    NoOptions,
    Recipe,
    RecipeArgs,
    RunParts,
    check_hf_checkpoint,
    main,
    open_run_parts,
)

DEFAULTS: dict[str, Any] = {
    # rollout: as miles' Qwen3 fully async examples
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "num_rollout": 300,
    "rollout_max_response_len": 4096,
    "rollout_temperature": 1.0,
    "apply_chat_template": True,
    "custom_rm_path": "miles_aio.tasks.math:gsm8k_reward",
    "async_max_concurrent_samples": 512,
    "max_admission_staleness": 2,
    "async_data_buffer_capacity_factor": 2.0,
    "pause_generation_mode": "retract",
    # engines
    "rollout_backend": "sglang",
    "rollout_num_gpus": 4,
    "rollout_num_gpus_per_engine": 1,
    # checkpoints (to <run-dir>/checkpoints unless --save): step_50, step_100, ..., step_300
    "save_interval": 50,
    # eval on the shared engines
    "eval_interval": 10,
    "eval_temperature": 0.0,
    "n_samples_per_eval_prompt": 1,
}


def train_defaults() -> dict[str, Any]:
    # --global-batch-size stays derived (every sample of a rollout, 256 with these defaults)
    return {
        "train_backend": "megatron",
        "actor_num_gpus_per_node": 4,
        "lr": 1e-6,
        "eps_clip": 0.2,
        "eps_clip_high": 0.28,
        "use_tis": True,
        "update_weight_transfer_mode": "broadcast",
    }


MEGATRON_DEFAULTS = DefaultsWhen(
    when={"train_backend": "megatron"}, defaults={"tensor_model_parallel_size": 2}
)
"""TP 2 is megatron's: `--train-backend fsdp` keeps TP 1 (FSDP has no tensor parallelism)."""


def check(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> None:
    check_hf_checkpoint(cfg)  # --dry-run too: exit 2 naming the flag, before anything starts


def build(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> AbstractAsyncContextManager[RunParts]:
    return open_run_parts(cfg, args, model_path=check_hf_checkpoint(cfg))


def plan(cfg: RunConfig, args: RecipeArgs[NoOptions]) -> dict[str, Any]:
    t, e = cfg.train, cfg.engine
    trainer_gpus = t.actor_num_nodes * t.actor_num_gpus_per_node
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    parallel = f"{t.train_backend}, TP {tp} × PP {pp} × DP {trainer_gpus // (tp * pp)}"
    if t.actor_num_nodes > 1:
        trainer = (
            f"{t.actor_num_nodes} nodes × {t.actor_num_gpus_per_node} GPUs, ranks started by torchrun on "
            f"each node, dialing {t.trainer_host}:{t.trainer_port or '<a free port>'} ({parallel})"
        )
    else:
        trainer = f"0-{trainer_gpus - 1} ({parallel})"
    if e.sglang_urls:
        n = len(e.sglang_urls)
        rollout = f"{n} SGLang server{'s' * (n > 1)} given by --sglang-urls (running, not launched)"
    else:
        gpus = f"{trainer_gpus}-{trainer_gpus + e.rollout_num_gpus - 1}"
        rollout = f"{gpus} ({e.num_engines} SGLang engines × {e.rollout_num_gpus_per_engine} GPU)"
    return {
        "gpus": {"trainer": trainer, "rollout": rollout},
        "engines": list(e.sglang_urls) if e.sglang_urls else "launched by this run, on this machine",
        "weight_sync": t.update_weight_transfer_mode,
        "sglang_args": args.sglang_args if not e.sglang_urls else [],
        "eval_sglang_args": args.eval_sglang_args,
    }


RECIPE = Recipe(
    name="gsm8k_qwen3",
    description=(__doc__ or "").split("\n\n")[0],
    defaults={**DEFAULTS, **train_defaults()},
    defaults_when=[MEGATRON_DEFAULTS],
    build=build,
    plan=plan,
    check=check,
    checkpoints_in_run_dir=True,  # <run-dir>/checkpoints unless --save, every --save-interval steps
)


def cli(argv: Sequence[str] | None = None) -> None:
    main(RECIPE, argv)


if __name__ == "__main__":
    cli()
